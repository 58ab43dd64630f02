// kiln_runner's checks before loading (trust.h): signature, target, digest while copying.
//
// Why the manifest's raw bytes are what gets verified, not a C++ re-encoding: Kiln signs
// DOMAIN + json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=True) (kiln/core/trust/signing.py
// canonical_bytes) and stores json.dumps(m, sort_keys=True, indent=2) + "\n" (kiln/store/base.py
// json_bytes): the same tokens in the same order, every number and string spelled the same, differing
// only in the whitespace between tokens. Removing that whitespace gives back the signed bytes exactly,
// where re-encoding with nlohmann could spell a float (1e-06) or an escape differently from Python. A
// manifest re-encoded some other way (keys reordered, non-ASCII written raw) therefore fails to verify
// even if its content is unchanged: it was not written by Kiln.
#include "trust.h"

#include <fcntl.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>

namespace fs = std::filesystem;
using nlohmann::json;

namespace kiln_trust {
namespace {

const std::string kDomain = "kiln-manifest-v1\n";  // kiln/core/trust/signing.py DOMAIN
const char* kVerifyKeyEnv = "KILN_VERIFY_KEY";

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error(msg); }

std::string read_file(const fs::path& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read " + what + " " + path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string hex(const unsigned char* bytes, size_t n) {
  std::string out;
  char byte[3];
  for (size_t i = 0; i < n; ++i) std::snprintf(byte, sizeof byte, "%02x", bytes[i]), out += byte;
  return out;
}

// Incremental sha256 (EVP), hex digest.
class Sha256 {
 public:
  Sha256() : ctx_(EVP_MD_CTX_new(), EVP_MD_CTX_free) {
    if (!ctx_ || EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) != 1) fail("OpenSSL: cannot start sha256");
  }
  void update(const void* data, size_t n) { EVP_DigestUpdate(ctx_.get(), data, n); }
  std::string hex_digest() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EVP_DigestFinal_ex(ctx_.get(), md, &n);
    return hex(md, n);
  }

 private:
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx_;
};

std::string sha256_hex(const std::string& data) {
  Sha256 h;
  h.update(data.data(), data.size());
  return h.hex_digest();
}

std::string strip(const std::string& s) {
  auto begin = std::find_if_not(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c); });
  auto end = std::find_if_not(s.rbegin(), s.rend(), [](unsigned char c) { return std::isspace(c); }).base();
  return begin < end ? std::string(begin, end) : std::string();
}

// The bytes `text` is the base64 of (whitespace ignored, padding required), or "" when it is not base64.
std::string base64_decode(const std::string& text) {
  std::string s;
  for (char c : text)
    if (!std::isspace(static_cast<unsigned char>(c))) s += c;
  if (s.empty() || s.size() % 4) return "";
  std::string out(s.size() / 4 * 3, '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(s.data()), static_cast<int>(s.size()));
  if (n < 0) return "";
  size_t pad = s.size() - s.find_last_not_of('=') - 1;  // EVP_DecodeBlock counts padding as zero bytes
  if (pad > 2) return "";
  out.resize(n - pad);
  return out;
}

PublicKey key_of(const std::string& raw) { return {raw, "ed25519:" + sha256_hex(raw).substr(0, 32)}; }

std::vector<std::string> base64_lines(const std::string& text) {
  std::string lines = text;
  std::replace(lines.begin(), lines.end(), ',', '\n');
  std::vector<std::string> out;
  std::istringstream in(lines);
  for (std::string line; std::getline(in, line);)
    if (!strip(line).empty() && strip(line)[0] != '#') out.push_back(strip(line));
  return out;
}

bool looks_like_base64_keys(const std::string& text) {
  auto lines = base64_lines(text);
  return std::all_of(lines.begin(), lines.end(), [](const std::string& l) { return base64_decode(l).size() == 32; });
}

bool ed25519_verify(const PublicKey& key, const std::string& signature, const std::string& data) {
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(
      EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, nullptr, reinterpret_cast<const unsigned char*>(key.raw.data()),
                                  key.raw.size()),
      EVP_PKEY_free);
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  return pkey && ctx && EVP_DigestVerifyInit(ctx.get(), nullptr, nullptr, nullptr, pkey.get()) == 1 &&
         EVP_DigestVerify(ctx.get(), reinterpret_cast<const unsigned char*>(signature.data()), signature.size(),
                          reinterpret_cast<const unsigned char*>(data.data()), data.size()) == 1;
}

// `text` without the whitespace between JSON tokens (see the file's comment); strings are kept as they are.
std::string without_whitespace(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      out += c;
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
      out += c;
    } else if (c != ' ' && c != '\n' && c != '\r' && c != '\t') {
      out += c;
    }
  }
  return out;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

}  // namespace

std::vector<PublicKey> parse_public_keys(const std::string& text, const std::string& source) {
  std::vector<PublicKey> keys;
  const std::string begin = "-----BEGIN ";
  if (text.find(begin) != std::string::npos) {
    for (size_t at = text.find(begin); at != std::string::npos; at = text.find(begin, at + 1)) {
      size_t label_end = text.find("-----", at + begin.size());
      if (label_end == std::string::npos) fail(source + " holds a malformed PEM block");
      std::string label = text.substr(at + begin.size(), label_end - at - begin.size());
      std::string end = "-----END " + label + "-----";
      size_t stop = text.find(end, label_end);
      if (stop == std::string::npos) fail(source + " holds a PEM block without its END line");
      if (label.find("PRIVATE KEY") != std::string::npos)
        fail(source + " holds a private key; give verifiers the public key only (the .pub file that `kiln keygen` "
                      "writes)");
      std::string block = text.substr(at, stop + end.size() - at);
      std::unique_ptr<BIO, decltype(&BIO_free)> bio(BIO_new_mem_buf(block.data(), static_cast<int>(block.size())),
                                                    BIO_free);
      std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(
          bio ? PEM_read_bio_PUBKEY(bio.get(), nullptr, nullptr, nullptr) : nullptr, EVP_PKEY_free);
      std::string raw(32, '\0');
      size_t n = raw.size();
      if (!pkey || EVP_PKEY_id(pkey.get()) != EVP_PKEY_ED25519 ||
          EVP_PKEY_get_raw_public_key(pkey.get(), reinterpret_cast<unsigned char*>(raw.data()), &n) != 1 || n != 32)
        fail(source + " holds a PEM block that is not an Ed25519 public key");
      keys.push_back(key_of(raw));
      at = stop;
    }
  } else {
    for (const auto& line : base64_lines(text)) {
      std::string raw = base64_decode(line);
      if (raw.size() != 32) fail(source + " is neither PEM nor base64 of 32-byte Ed25519 public keys");
      keys.push_back(key_of(raw));
    }
  }
  if (keys.empty()) fail(source + " holds no public key");
  return keys;
}

std::vector<PublicKey> trusted_keys(const std::vector<std::string>& files) {
  std::vector<PublicKey> keys;
  for (const auto& f : files) {
    auto more = parse_public_keys(read_file(f, "--verify-key"), "--verify-key " + f);
    keys.insert(keys.end(), more.begin(), more.end());
  }
  const char* env = std::getenv(kVerifyKeyEnv);
  std::string value = strip(env ? env : "");
  if (!value.empty()) {
    // As kiln/host/trust/signers.py reads it: the key itself (PEM or base64), else the path of a file holding it.
    std::string path = value.rfind("~/", 0) == 0 && std::getenv("HOME") ? std::getenv("HOME") + value.substr(1) : value;
    if (value.find("-----BEGIN") == std::string::npos && !looks_like_base64_keys(value) && fs::is_regular_file(path))
      value = read_file(path, kVerifyKeyEnv);
    auto more = parse_public_keys(value, kVerifyKeyEnv);
    keys.insert(keys.end(), more.begin(), more.end());
  }
  return keys;
}

json read_verified_manifest(const fs::path& path, const std::vector<PublicKey>& keys, bool allow_unsigned,
                            std::string* note) {
  const std::string stored = read_file(path, "the manifest");  // read once: what is verified is what is parsed
  const fs::path sig_path = path.parent_path() / "manifest.sig";
  const std::string what = "manifest " + path.string();
  const std::string canonical = without_whitespace(stored);
  json manifest;
  try {
    manifest = json::parse(canonical);
  } catch (const json::exception& e) {
    fail(path.string() + ": not valid JSON: " + e.what());
  }
  if (!fs::exists(sig_path)) {
    if (!allow_unsigned)
      fail(what + " is not signed (" + sig_path.string() + " is missing); refusing to load anything from it. "
           "Pass --allow-unsigned only if it was exported with --unsigned on purpose.");
    if (!manifest.is_object() || manifest.value("signing", json::object()).value("signed", json()) != json(false))
      fail(what + " says it was signed but its signature " + sig_path.string() + " is missing; refusing the export.");
    *note = "signature: none (unsigned export accepted because of --allow-unsigned)";
    return manifest;
  }
  json sig;
  try {
    sig = json::parse(read_file(sig_path, "the signature"));
  } catch (const json::exception&) {
    fail("the signature " + sig_path.string() + " is not JSON; refusing the export.");
  }
  const char* fields[] = {"key_fingerprint", "public_key", "manifest_sha256", "signature"};
  bool well_formed = sig.is_object() && sig.value("kiln_signature", json()) == json(1) &&
                     sig.value("algorithm", json()) == json("ed25519");
  for (const char* f : fields) well_formed = well_formed && sig.contains(f) && sig.at(f).is_string();
  if (!well_formed) fail("the signature " + sig_path.string() + " of " + what + " is malformed; refusing the export.");
  if (keys.empty())
    fail("no key to check the signature " + sig_path.string() + " of " + what + " with (it names key " +
         sig.at("key_fingerprint").get<std::string>() + "): pass --verify-key FILE (the .pub that `kiln keygen` "
         "wrote) or set KILN_VERIFY_KEY.");
  const std::string fp = sig.at("key_fingerprint");
  auto key = std::find_if(keys.begin(), keys.end(), [&](const PublicKey& k) { return k.fingerprint == fp; });
  if (key == keys.end()) {
    std::string known;
    for (const auto& k : keys) known += (known.empty() ? "" : ", ") + k.fingerprint;
    fail(what + " is signed by key " + fp + " (" + sig_path.string() + "), which is not a trusted verify key " +
         "(trusted: " + known + "); refusing the export. Pass the signer's public key with --verify-key FILE " +
         "or KILN_VERIFY_KEY if you trust it.");
  }
  const std::string data = kDomain + canonical;
  if (!ed25519_verify(*key, base64_decode(sig.at("signature")), data)) {
    bool changed = sha256_hex(data) != sig.at("manifest_sha256").get<std::string>();
    fail("the signature " + sig_path.string() + " of " + what + " does not verify with key " + fp + ": " +
         (changed ? "the manifest was changed after it was signed" : "the signature was changed") +
         "; refusing the export.");
  }
  if (manifest.value("signing", json::object()).value("key_fingerprint", json()) != json(fp))
    fail(what + " names another signing key than the one that signed it (" + fp + "); refusing the export.");
  *note = "signature ok: signed by " + fp;
  return manifest;
}

std::string cpu_target_problem(const std::string& target, const std::string& machine, const std::string& isa_level) {
  // 'cpu-<machine>-<level>-<hash>' (kiln/core/machine/cpu_target.py); the machine may not hold a '-', the rest do not.
  size_t hash_at = target.rfind('-');
  size_t level_at = hash_at == std::string::npos || hash_at < 5 ? std::string::npos : target.rfind('-', hash_at - 1);
  if (target.rfind("cpu-", 0) != 0 || level_at == std::string::npos || level_at < 5)
    return "its target '" + target + "' is not a CPU target this runner can check";
  std::string their_machine = target.substr(4, level_at - 4);
  std::string level = target.substr(level_at + 1, hash_at - level_at - 1);
  std::string host_level = lower(isa_level);
  if (their_machine != machine)
    return "it was compiled for target " + target + " (machine " + their_machine + ") and this host's machine is " +
           machine;
  // Every level runs DEFAULT code, and x86's AVX512 runs AVX2 code; other pairs only their own.
  if (level != host_level && level != "default" && !(level == "avx2" && host_level == "avx512"))
    return "it was compiled for target " + target + ", ISA level " + level + ", and this CPU's level is " +
           host_level + " (torch's CPU capability): its code would stop with an illegal instruction";
  return "";
}

PrivateCopy::PrivateCopy(const fs::path& source, const std::string& want_sha256) {
  const char* tmp = std::getenv("TMPDIR");
  std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/kiln-runner-XXXXXX";
  if (!mkdtemp(templ.data())) fail("cannot make a private directory " + templ + " to copy packages into");
  dir_ = templ;
  file_ = dir_ / source.filename();
  int in = ::open(source.c_str(), O_RDONLY | O_CLOEXEC);
  if (in < 0) {
    fs::remove_all(dir_);
    fail("cannot open package " + source.string());
  }
  int out = ::open(file_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  Sha256 hash;
  std::vector<char> buf(1 << 20);
  bool ok = out >= 0;
  for (ssize_t n; ok && (n = ::read(in, buf.data(), buf.size())) != 0;) {
    ok = n > 0 && ::write(out, buf.data(), n) == n;  // a regular file on a local disk writes whole chunks
    if (ok) hash.update(buf.data(), n);
  }
  ::close(in);
  if (out >= 0 && ::close(out) != 0) ok = false;
  if (!ok) {
    fs::remove_all(dir_);
    fail("cannot copy package " + source.string() + " into " + dir_.string() + " to check it");
  }
  std::string digest = hash.hex_digest();
  if (digest != want_sha256) {
    fs::remove_all(dir_);
    fail(source.string() + ": sha256 " + digest + " does not match the manifest's " + want_sha256 +
         "; refusing to load it");
  }
}

PrivateCopy::~PrivateCopy() {
  std::error_code ignored;
  fs::remove_all(dir_, ignored);
}

}  // namespace kiln_trust
