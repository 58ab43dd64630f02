// kiln_runner: run one prefill step of a Kiln export on one tensor-parallel rank, without Python.
//
// It reads the export manifest (version 5) once and checks its Ed25519 signature (manifest.sig beside it)
// against the keys it is given (--verify-key, KILN_VERIFY_KEY), picks the forward whose range of shapes
// holds --bucket BxT by the consumer contract's rule (docs/run-without-kiln.md: the fewest shapes, then the
// nearest hint, then the smallest name) among those whose target this CPU runs, copies that forward's
// package into a private directory while hashing it against the signed manifest's sha256 (the copy is what
// it loads: trust.h), reads and cuts this rank's weights from the checkpoint's safetensors file(s), registers a
// gloo process group under the manifest's group name (the packages' all-reduce is compiled against
// that name), binds the weights with load_constants (always before the first call: calling first
// crashes the process) and runs the forward on an empty KV cache. Rank 0 writes the logits.
//
// Process group: torch's own c10d::ProcessGroupGloo over a c10d::TCPStore that rank 0 hosts, as
// `torch.distributed.init_process_group("gloo")` builds it. The torch wheel ships no gloo headers, so
// we compile against Debian's libgloo-dev headers but link no gloo library: every gloo symbol comes
// from libtorch_cpu (torch's own gloo). This is sound because this file only names gloo types through
// pointers (shared_ptr<gloo::transport::Device>) and calls torch's out-of-line constructors; it never
// instantiates a gloo class itself, so the older headers' layouts never meet torch's code.
//
// Output: <out> holds the logits as raw little-endian float32, row-major; <out>.json says
// {"shape": [batch, tokens, vocab], "dtype": "float32", ...}.
#include "trust.h"

#include <ATen/Version.h>
#include <sys/utsname.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

json read_json(const fs::path& path) {
  std::ifstream in(path);
  if (!in) fail("cannot open " + path.string());
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    fail(path.string() + ": not valid JSON: " + e.what());
  }
}

// ----------------------------------------------------------------------------------- arguments

struct Args {
  fs::path manifest, checkpoint, packages, out;
  int rank = 0, world_size = 1, master_port = 29500;
  std::string master_addr = "127.0.0.1", bucket, key;
  std::vector<std::string> verify_keys;  // --verify-key FILE, repeatable (KILN_VERIFY_KEY is read as well)
  bool allow_unsigned = false;
  int64_t batch = 0, seq_tokens = 0;  // --bucket BxT: sequences, new tokens per sequence
  std::vector<int64_t> tokens;
  int64_t start_pos = 0;
  int timeout_s = 300;  // how long to wait for the other ranks (store, gloo)
};

const char* kUsage =
    "usage: kiln_runner --manifest M.json --packages DIR --bucket BxT --tokens ID,ID,...\n"
    "                   [--checkpoint DIR] [--rank R --world-size W --master-addr A --master-port P]\n"
    "                   [--start-pos N] [--out PATH] [--timeout-s S] [--key KEY]\n"
    "                   [--verify-key FILE ...] [--allow-unsigned]\n"
    "  --verify-key: a public key (PEM or base64) trusted to sign the manifest; repeatable. KILN_VERIFY_KEY\n"
    "                (PEM, base64 or a file path) is trusted too. The manifest's manifest.sig must verify.\n"
    "  --allow-unsigned: accept a manifest without manifest.sig if it says it was exported --unsigned\n"
    "  --packages: a local store's forwards/ folder (each forward is read at its manifest object under it)\n"
    "  --checkpoint: defaults to the manifest's model.checkpoint\n"
    "  --bucket: the shape to run; the forward whose range holds it is chosen (docs/run-without-kiln.md)\n"
    "  --key: the forward to run when the bucket has one per target (hosts of different ISAs)\n"
    "  --tokens: batch*tokens ids, row-major; --start-pos: every sequence's start (default 0)\n"
    "  --out: logits as raw float32 LE plus PATH.json; rank 0 writes it, or every rank if PATH has {rank}\n";

Args parse_args(int argc, char** argv) {
  Args a;
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; i += 2) {
    std::string k = argv[i];
    if (k == "-h" || k == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (k == "--allow-unsigned") {  // the one flag without a value
      a.allow_unsigned = true;
      --i;
      continue;
    }
    if (k.rfind("--", 0) != 0 || i + 1 >= argc) fail("bad argument '" + k + "'\n" + kUsage);
    if (k == "--verify-key") a.verify_keys.push_back(argv[i + 1]);
    else if (!kv.emplace(k.substr(2), argv[i + 1]).second) fail("--" + k.substr(2) + " is given twice\n" + kUsage);
  }
  auto take = [&](const std::string& k, bool required) {
    auto it = kv.find(k);
    if (it == kv.end()) {
      if (required) fail("--" + k + " is required\n" + kUsage);
      return std::string();
    }
    std::string v = it->second;
    kv.erase(it);
    return v;
  };
  a.manifest = take("manifest", true);
  a.packages = take("packages", true);
  a.bucket = take("bucket", true);
  if (auto x = a.bucket.find_first_of("xX"); x != std::string::npos) {
    a.batch = std::atoll(a.bucket.substr(0, x).c_str());
    a.seq_tokens = std::atoll(a.bucket.substr(x + 1).c_str());
  }
  if (a.batch < 1 || a.seq_tokens < 1) fail("--bucket " + a.bucket + " is not BxT with positive integers\n" + kUsage);
  std::stringstream ids(take("tokens", true));
  for (std::string id; std::getline(ids, id, ',');) a.tokens.push_back(std::stoll(id));
  a.checkpoint = take("checkpoint", false);
  a.out = take("out", false);
  a.key = take("key", false);
  if (auto v = take("rank", false); !v.empty()) a.rank = std::stoi(v);
  if (auto v = take("world-size", false); !v.empty()) a.world_size = std::stoi(v);
  if (auto v = take("master-addr", false); !v.empty()) a.master_addr = v;
  if (auto v = take("master-port", false); !v.empty()) a.master_port = std::stoi(v);
  if (auto v = take("start-pos", false); !v.empty()) a.start_pos = std::stoll(v);
  if (auto v = take("timeout-s", false); !v.empty()) a.timeout_s = std::stoi(v);
  if (!kv.empty()) fail("unknown argument --" + kv.begin()->first + "\n" + kUsage);
  if (a.rank < 0 || a.rank >= a.world_size) fail("--rank must be in [0, --world-size)");
  return a;
}

// ----------------------------------------------------------------------------------- dtypes

at::ScalarType kiln_dtype(const std::string& name) {  // the manifest spells dtypes as torch does
  static const std::map<std::string, at::ScalarType> m = {
      {"float32", at::kFloat}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16}, {"int64", at::kLong},
      {"float8_e4m3fn", at::kFloat8_e4m3fn}, {"int8", at::kChar}, {"uint8", at::kByte}};
  auto it = m.find(name);
  if (it == m.end()) fail("unsupported dtype '" + name + "' in the manifest");
  return it->second;
}

at::ScalarType safetensors_dtype(const std::string& name) {
  static const std::map<std::string, at::ScalarType> m = {
      {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16},
      {"I64", at::kLong},   {"I32", at::kInt},   {"I16", at::kShort}, {"I8", at::kChar},
      {"U8", at::kByte},    {"BOOL", at::kBool}, {"F8_E4M3", at::kFloat8_e4m3fn},
      {"F8_E8M0", at::kByte}};  // UE8M0 scales: their bytes, which the package takes as uint8
  auto it = m.find(name);
  if (it == m.end()) fail("unsupported safetensors dtype '" + name + "'");
  return it->second;
}

// ----------------------------------------------------------------------------------- safetensors

// One tensor of a safetensors file: where its bytes are, and what they are.
struct Entry {
  fs::path file;
  uint64_t begin = 0, end = 0;  // absolute byte offsets in `file`
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

// Reads the header of every file of a checkpoint: `model.safetensors`, or the files that
// `model.safetensors.index.json`'s weight_map names. Layout of one file: 8-byte little-endian header
// length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": ...},
// then the data; offsets count from the end of the header.
class Checkpoint {
 public:
  explicit Checkpoint(const fs::path& dir) {
    fs::path index = dir / "model.safetensors.index.json";
    std::set<std::string> files;
    if (fs::exists(index)) {
      json map = read_json(index);  // named: iterating a temporary's items() would dangle
      for (auto& [name, file] : map.at("weight_map").items()) files.insert(file.get<std::string>());
    } else {
      files.insert("model.safetensors");
    }
    for (const auto& f : files) read_header(dir / f);
  }

  // The tensor `name`, rows [offset, offset+length) of dimension `dim` when cut (dim < 0: whole).
  at::Tensor read(const std::string& name, int64_t dim, int64_t offset, int64_t length) const {
    const Entry& e = entry(name);
    std::vector<int64_t> shape = e.shape;
    if (dim >= static_cast<int64_t>(shape.size()) || (dim >= 0 && (offset < 0 || length < 0 || offset + length > shape[dim])))
      fail("the manifest cuts " + name + " outside its shape");
    uint64_t begin = e.begin, nbytes = e.end - e.begin;
    if (dim == 0) {  // a cut along the first dimension is one contiguous byte range: read only it
      uint64_t row = shape[0] ? nbytes / shape[0] : 0;
      begin += offset * row;
      nbytes = length * row;
      shape[0] = length;
    }
    // A fresh (aligned) buffer, never a view into the file: load_constants wants tensors owning their bytes.
    at::Tensor raw = torch::empty({static_cast<int64_t>(nbytes)}, at::kByte);
    std::ifstream in(e.file, std::ios::binary);
    in.seekg(static_cast<std::streamoff>(begin));
    if (!in.read(reinterpret_cast<char*>(raw.data_ptr()), static_cast<std::streamsize>(nbytes)))
      fail(e.file.string() + ": truncated data for " + name);
    at::Tensor t = raw.view(e.dtype).reshape(shape);
    if (dim > 0) t = t.narrow(dim, offset, length);
    return t;
  }

  const Entry& entry(const std::string& name) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) fail("the checkpoint has no tensor " + name);
    return it->second;
  }

 private:
  void read_header(const fs::path& file) {
    std::ifstream in(file, std::ios::binary);
    if (!in) fail("cannot open " + file.string());
    unsigned char len_le[8];
    if (!in.read(reinterpret_cast<char*>(len_le), 8)) fail(file.string() + ": not a safetensors file");
    uint64_t len = 0;
    for (int i = 7; i >= 0; --i) len = (len << 8) | len_le[i];
    uint64_t size = fs::file_size(file);
    if (len > size - 8) fail(file.string() + ": header length " + std::to_string(len) + " exceeds the file");
    std::string text(len, '\0');
    in.read(text.data(), static_cast<std::streamsize>(len));
    json header = json::parse(text);
    for (auto& [name, v] : header.items()) {
      if (name == "__metadata__") continue;
      Entry e{file, 8 + len + v.at("data_offsets")[0].get<uint64_t>(), 8 + len + v.at("data_offsets")[1].get<uint64_t>(),
              safetensors_dtype(v.at("dtype")), v.at("shape").get<std::vector<int64_t>>()};
      int64_t numel = 1;
      for (auto d : e.shape) numel *= d;
      if (e.end < e.begin || e.end > size || e.end - e.begin != numel * c10::elementSize(e.dtype))
        fail(file.string() + ": tensor " + name + "'s data_offsets do not match its dtype and shape");
      entries_[name] = std::move(e);
    }
  }

  std::map<std::string, Entry> entries_;
};

// ----------------------------------------------------------------------------------- weights

std::string shape_str(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

// This rank's package constants, as the layout says: each source tensor cut for the rank and cast; a stacked
// constant ("stack" not null) is allocated once and each source copied into its slice of the leading dimension.
// Where the ranks' shares differ, a constant's "shapes" and a cut's "lengths" are per rank.
std::unordered_map<std::string, at::Tensor> rank_weights(const json& layout, const std::vector<std::string>& names,
                                                         const Checkpoint& ckpt, int rank) {
  std::unordered_map<std::string, at::Tensor> out;
  for (const auto& name : names) {
    if (!layout.contains(name)) fail("the package needs constant " + name + " but the manifest's weights lack it");
    const json& w = layout.at(name);
    auto shape = (w.contains("shapes") ? w.at("shapes").at(rank) : w.at("shape")).get<std::vector<int64_t>>();
    bool stacked = !w.at("stack").is_null();
    const json& sources = w.at("sources");
    if (stacked ? (shape.empty() || shape[0] != static_cast<int64_t>(sources.size())) : sources.size() != 1)
      fail("weight " + name + "'s sources do not fit its shape " + shape_str(shape));
    at::Tensor constant = at::empty(shape, at::TensorOptions().dtype(kiln_dtype(w.at("dtype"))));
    for (size_t i = 0; i < sources.size(); ++i) {
      const json& src = sources[i];
      std::string tensor = src.at("tensor");
      auto full = src.at("full_shape").get<std::vector<int64_t>>();
      if (ckpt.entry(tensor).shape != full)
        fail("checkpoint tensor " + tensor + " is " + shape_str(ckpt.entry(tensor).shape) +
             " but the export expects " + shape_str(full));
      int64_t dim = -1, offset = 0, length = 0, repeat = 1;
      if (!src.at("cut").is_null()) {
        dim = src["cut"].at("dim");
        length = src["cut"].contains("lengths") ? src["cut"].at("lengths").at(rank) : src["cut"].at("length");
        offset = src["cut"].at("offsets").at(rank);
        repeat = src["cut"].value("repeat", 1);
      }
      // FP8 block scales may repeat each entry over a rank's sub-blocks before the cut (the manifest's `repeat`).
      at::Tensor part = repeat > 1 ? ckpt.read(tensor, -1, 0, 0).repeat_interleave(repeat, dim).narrow(dim, offset, length)
                                   : ckpt.read(tensor, dim, offset, length);
      at::Tensor slot = stacked ? constant.select(0, static_cast<int64_t>(i)) : constant;
      if (part.sizes() != slot.sizes())
        fail("weight " + name + " source " + tensor + " cuts to " + shape_str(part.sizes().vec()) +
             ", not the manifest's " + shape_str(slot.sizes().vec()));
      slot.copy_(part);
    }
    out[name] = constant;
  }
  return out;
}

// ----------------------------------------------------------------------------------- package

// A gloo world of `world_size` ranks over a TCPStore on master_addr:master_port (rank 0 hosts it),
// registered under `group_name`, the name the packages' _c10d_functional.all_reduce resolves. The
// registry holds only a weak reference: the caller keeps the group alive while the forward runs.
c10::intrusive_ptr<c10d::ProcessGroup> register_gloo_group(const std::string& group_name, const Args& a) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(a.master_port);
  opts.isServer = a.rank == 0;
  opts.numWorkers = a.world_size;
  opts.timeout = std::chrono::seconds(a.timeout_s);
  auto store = c10::make_intrusive<c10d::TCPStore>(a.master_addr, opts);
  auto gloo_opts = c10d::ProcessGroupGloo::Options::create(std::chrono::seconds(a.timeout_s));
  // As torch.distributed does: the interface GLOO_SOCKET_IFNAME names, else this host's address.
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  gloo_opts->devices.push_back(ifname ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
                                      : c10d::ProcessGroupGloo::createDefaultDevice());
  auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, a.rank, a.world_size, gloo_opts);
  auto group = c10::make_intrusive<c10d::ProcessGroup>(store, a.rank, a.world_size);
  group->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
  group->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
  group->setGroupName(group_name);
  c10d::register_process_group(group_name, group);
  return group;
}

// The forward's inputs per its interface: the ids, start positions, an empty (zero) KV cache of
// pages_per_seq*batch + 1 pages, sequence b's pages b*pages_per_seq .. (b+1)*pages_per_seq - 1 (a slot
// cache, DeepSeek-V4's: batch + 1 empty slots, sequence b's slot b), and, for a
// rope that goes by the sequence's length, each sequence's length: start position + the bucket's tokens.
// A dimension named in the interface is dynamic: 'batch' and 'tokens' are the bucket's, the page count ours.
std::vector<at::Tensor> make_inputs(const json& interface, const Args& a) {
  std::vector<at::Tensor> inputs;
  int64_t pages_per_seq = 0;
  for (const auto& in : interface.at("inputs"))
    if (in.at("name") == "block_table") pages_per_seq = in.at("shape")[1];
  for (const auto& in : interface.at("inputs")) {
    std::string name = in.at("name");
    std::vector<int64_t> shape;
    for (const auto& d : in.at("shape")) {
      if (!d.is_string()) shape.push_back(d.get<int64_t>());
      else if (d == "batch") shape.push_back(a.batch);
      else if (d == "tokens") shape.push_back(a.seq_tokens);
      else if (d == "num_slots") shape.push_back(a.batch + 1);  // a slot cache's (DeepSeek-V4's) slot count
      else shape.push_back(pages_per_seq * a.batch + 1);
    }
    auto dtype = kiln_dtype(in.at("dtype"));
    if (name == "tokens") {
      int64_t want = shape[0] * shape[1];
      if (static_cast<int64_t>(a.tokens.size()) != want)
        fail("bucket " + a.bucket + " takes " + std::to_string(want) + " token ids, got " +
             std::to_string(a.tokens.size()));
      inputs.push_back(torch::tensor(a.tokens, at::kLong).reshape(shape));
    } else if (name == "start_pos") {
      inputs.push_back(torch::full(shape, a.start_pos, at::kLong));
    } else if (name == "kv_cache") {
      inputs.push_back(torch::zeros(shape, dtype));
    } else if (name == "block_table") {
      inputs.push_back(torch::arange(shape[0] * shape[1], at::kLong).reshape(shape));
    } else if (name == "slots") {  // a slot cache (DeepSeek-V4's): sequence b's state is slot b
      inputs.push_back(torch::arange(shape[0], at::kLong));
    } else if (name == "seq_lens") {  // a rope that goes by the sequence's length: the step's whole prompt
      inputs.push_back(torch::full(shape, a.start_pos + a.seq_tokens, at::kLong));
    } else {
      fail("the interface has an input '" + name + "' this runner does not know");
    }
  }
  return inputs;
}

void write_logits(const at::Tensor& logits, const Args& a, const json& forward) {
  std::string path = a.out.string();
  if (auto at = path.find("{rank}"); at != std::string::npos) {
    path.replace(at, 6, std::to_string(a.rank));
  } else if (a.rank != 0) {
    return;  // every rank holds the same logits; rank 0 speaks for them
  }
  at::Tensor t = logits.to(at::kFloat).contiguous();  // x86/arm hosts are little-endian
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(t.data_ptr<float>()), static_cast<std::streamsize>(t.nbytes()));
  if (!out) fail("cannot write " + path);
  json side = {{"shape", t.sizes().vec()}, {"dtype", "float32"}, {"byte_order", "little"},
               {"bucket", a.bucket}, {"key", forward.at("key")}, {"rank", a.rank}, {"start_pos", a.start_pos}};
  std::ofstream(path + ".json") << side.dump(2) << "\n";
}

// Where a forward's package is under --packages (the store's forwards/ folder): its manifest object without the
// leading "forwards/" (<key>/<sha256>.pt2; a store written before keeps <key>.pt2). The manifest is signed, but
// a path that would leave the folder is refused all the same.
fs::path package_under_forwards(const json& forward) {
  std::string object = forward.at("object").get<std::string>();
  const std::string prefix = "forwards/";
  if (object.rfind(prefix, 0) == 0) object = object.substr(prefix.size());
  fs::path rel(object);
  if (rel.is_absolute()) fail("forward " + forward.at("key").get<std::string>() + ": its object leaves the packages folder");
  for (const auto& part : rel)
    if (part == "..") fail("forward " + forward.at("key").get<std::string>() + ": its object leaves the packages folder");
  return rel;
}

// Why a forward cannot run on this CPU ("" when it can): its target's machine and ISA level against
// uname's machine and torch's CPU capability (trust.h).
std::string target_problem(const json& forward) {
  struct utsname host {};
  uname(&host);
  std::string problem =
      kiln_trust::cpu_target_problem(forward.value("target", "(none)"), host.machine, at::get_cpu_capability());
  if (!problem.empty() || !forward.contains("target_cpu")) return problem;
  // The flags the compiling CPU had (the manifest's target_cpu), each one this CPU's /proc/cpuinfo must list.
  std::set<std::string> have;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    std::string name = line.substr(0, line.find(':'));
    name.erase(name.find_last_not_of(" \t") + 1);
    if (name == "flags" || name == "Features") {
      std::istringstream words(line.substr(line.find(':') + 1));
      for (std::string w; words >> w;) have.insert(w);
      break;
    }
  }
  std::string missing;
  for (const auto& flag : forward.at("target_cpu").value("isa_flags", json::array()))
    if (!have.count(flag.get<std::string>())) missing += (missing.empty() ? "" : ", ") + flag.get<std::string>();
  if (!missing.empty())
    return "it was compiled for target " + forward.at("target").get<std::string>() + ", on a CPU with instruction "
           "set(s) " + missing + " this CPU lacks: its code would stop with an illegal instruction";
  return "";
}

int run(const Args& a) {
  // Read once and checked before anything else is read; everything below trusts only these bytes.
  std::string signature_note;
  json manifest = kiln_trust::read_verified_manifest(a.manifest, kiln_trust::trusted_keys(a.verify_keys),
                                                     a.allow_unsigned, &signature_note);
  std::cerr << "rank " << a.rank << ": " << signature_note << "\n";
  if (manifest.value("version", 0) != 5)
    fail(a.manifest.string() + ": manifest version " + manifest.value("version", json()).dump() + ", this runner reads 5");
  // This runner is built against libtorch for the CPU and binds weights and inputs on the CPU: a CUDA
  // export's packages need the CUDA runtime and tensors on the GPU, so it says so instead of crashing.
  std::string device = manifest.value("runtime", json::object()).value("device", "cpu");
  if (device != "cpu")
    fail("the export's packages run on " + device + "; this runner runs CPU packages only (use the torch-only "
         "example, examples/torch_only.py, or kiln run on a GPU host)");
  int tp = manifest.at("tp");
  if (tp != a.world_size) fail("the export is tp " + std::to_string(tp) + " but --world-size is " + std::to_string(a.world_size));
  // This rank's forwards (where the ranks' shares differ, each lists the ranks it is for) whose range holds the
  // bucket; of those, the contract's choice (--key picks among targets).
  auto for_rank = [&](const json& f) {
    if (!f.contains("ranks")) return true;
    for (const auto& r : f.at("ranks"))
      if (r.get<int>() == a.rank) return true;
    return false;
  };
  auto holds = [&](const json& f) {
    return f.at("batch")[0] <= a.batch && a.batch <= f.at("batch")[1] && f.at("tokens")[0] <= a.seq_tokens &&
           a.seq_tokens <= f.at("tokens")[1];
  };
  auto rank_of = [&](const json& f) {
    int64_t shapes = (f.at("batch")[1].get<int64_t>() - f.at("batch")[0].get<int64_t>() + 1) *
                     (f.at("tokens")[1].get<int64_t>() - f.at("tokens")[0].get<int64_t>() + 1);
    int64_t near = std::llabs(f.at("hint")[0].get<int64_t>() - a.batch) + std::llabs(f.at("hint")[1].get<int64_t>() - a.seq_tokens);
    return std::make_tuple(shapes, near, f.at("shapes").get<std::string>());
  };
  std::vector<const json*> found;
  std::set<std::string> targets;
  std::string cannot_run;  // the forwards that hold the bucket but whose code this CPU cannot run, and why
  for (const auto& f : manifest.at("forwards"))
    if (for_rank(f) && holds(f) && (a.key.empty() || f.at("key") == a.key)) {
      if (std::string why = target_problem(f); !why.empty()) {
        cannot_run += "; forward " + f.at("key").get<std::string>() + ": " + why;
        continue;
      }
      found.push_back(&f);
      targets.insert(f.value("target", "?"));
    }
  if (found.empty() && !cannot_run.empty())
    fail("no forward of bucket " + a.bucket + " can run on this host" + cannot_run);
  if (found.empty()) fail("the export has no forward whose range holds bucket " + a.bucket + (a.key.empty() ? "" : " with key " + a.key));
  if (targets.size() > 1) {
    std::string keys;
    for (auto* f : found) keys += " " + f->at("key").get<std::string>() + " (" + f->value("target", "?") + ")";
    fail("bucket " + a.bucket + " has forwards for several targets; pick this host's with --key:" + keys);
  }
  const json* forward = *std::min_element(found.begin(), found.end(),
                                          [&](const json* x, const json* y) { return rank_of(*x) < rank_of(*y); });
  std::cerr << "rank " << a.rank << ": forward " << forward->at("key").get<std::string>() << " ("
            << forward->at("shapes").get<std::string>() << ") for " << a.bucket << "\n";
  if (!forward->value("python_free", true))
    fail("forward " + forward->at("key").get<std::string>() + " calls Python ops: it cannot run without Python");

  // A package is native code: load only what the signed manifest names, and only the bytes that were hashed
  // (the private copy; the store's file is never opened again, however long the other ranks take).
  fs::path package = a.packages / package_under_forwards(*forward);
  auto copy = std::make_unique<kiln_trust::PrivateCopy>(package, forward->at("sha256").get<std::string>());
  std::cerr << "rank " << a.rank << ": " << package.string() << " sha256 ok; loading its private copy "
            << copy->path().string() << "\n";

  fs::path ckpt_dir = a.checkpoint.empty() ? fs::path(manifest.at("model").at("checkpoint").get<std::string>()) : a.checkpoint;
  Checkpoint ckpt(ckpt_dir);

  const json& iface = forward->at("interface");
  std::vector<at::Tensor> inputs = make_inputs(iface, a);  // refuse bad input before waiting on other ranks
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  if (tp > 1) {
    if (iface.at("process_group").is_null()) fail("a tp > 1 forward without a process group in its interface");
    group = register_gloo_group(iface.at("process_group"), a);
  }

  setenv("AOTI_RUNTIME_CHECK_INPUTS", "1", 1);  // read at load time: a wrong input shape raises, not corrupts
  torch::inductor::AOTIModelPackageLoader loader(copy->path().string());
  copy.reset();  // the loader has extracted what it needs
  std::vector<std::string> names = loader.get_constant_fqns();
  auto weights = rank_weights(manifest.at("weights"), names, ckpt, a.rank);
  // Before the first run. user_managed: the package reads `weights` where they lie instead of copying them
  // (one copy of the rank's weights; `weights` outlives every run below).
  loader.load_constants(weights, /*use_inactive=*/false, /*check_full_update=*/true, /*user_managed=*/true);

  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> outputs = loader.run(inputs);
  const at::Tensor& logits = outputs.at(0);
  std::cerr << "rank " << a.rank << ": logits " << shape_str(logits.sizes().vec()) << "\n";
  if (!a.out.empty()) write_logits(logits, a, *forward);
  if (group) group->barrier()->wait();  // rank 0 hosts the store: let no rank leave while another still needs it
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const c10::Error& e) {
    std::cerr << "kiln_runner: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kiln_runner: " << e.what() << "\n";
    return 1;
  }
}
