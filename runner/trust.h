// What kiln_runner checks before it loads anything: the manifest's Ed25519 signature against the keys it
// is given, that a forward's target can run on this CPU, and a package's sha256 while copying it into a
// private directory (the copy is what gets loaded). OpenSSL's EVP does the hashing and the verifying.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kiln_trust {

// An Ed25519 public key the caller trusts: its 32 raw bytes and its fingerprint, 'ed25519:' + the first
// 32 hex digits of sha256(raw), as kiln/core/trust/signing.py names keys.
struct PublicKey {
  std::string raw;
  std::string fingerprint;
};

// Every public key in `text`: PEM blocks ("BEGIN PUBLIC KEY", Ed25519), or lines (or commas) of base64 of
// the 32 raw bytes ('#' lines are comments). Fails naming `source` otherwise; never prints key bytes.
std::vector<PublicKey> parse_public_keys(const std::string& text, const std::string& source);

// The keys of each `--verify-key FILE` and of KILN_VERIFY_KEY (PEM, base64, or the path of a file holding
// either), as `kiln verify` reads them. Empty when neither is given.
std::vector<PublicKey> trusted_keys(const std::vector<std::string>& files);

// The manifest at `path`, read once, its signature (manifest.sig beside it) checked against `keys`, and
// parsed from exactly the bytes that were verified. Fails naming the signature and the key when no key
// verifies it, or when it is missing (unless `allow_unsigned` and the manifest says it is unsigned).
// `note` says what was checked, for the log.
nlohmann::json read_verified_manifest(const std::filesystem::path& path, const std::vector<PublicKey>& keys,
                                      bool allow_unsigned, std::string* note);

// Why a forward compiled for CPU target `target` ('cpu-<machine>-<isa level>-<flags hash>') cannot run on
// a host of `machine` (uname -m) whose torch CPU capability is `isa_level` ("AVX512", any case), or "" when
// it can: another machine, or an ISA level above the host's. The flags behind a level are checked by the caller
// from the manifest's target_cpu (kiln_runner.cpp: target_problem).
std::string cpu_target_problem(const std::string& target, const std::string& machine, const std::string& isa_level);

// A package copied into a private directory (mkdtemp: mode 0700, the file 0600) while it is hashed. The
// copy is what the runner loads: the bytes hashed are the bytes loaded, whatever becomes of `source` (in a
// local store, a symlink any store writer can swap) afterwards. Fails, naming the package and both digests,
// when the digest is not `want_sha256`. The directory is removed with the object.
class PrivateCopy {
 public:
  PrivateCopy(const std::filesystem::path& source, const std::string& want_sha256);
  ~PrivateCopy();
  PrivateCopy(const PrivateCopy&) = delete;
  PrivateCopy& operator=(const PrivateCopy&) = delete;
  const std::filesystem::path& path() const { return file_; }

 private:
  std::filesystem::path dir_, file_;
};

}  // namespace kiln_trust
