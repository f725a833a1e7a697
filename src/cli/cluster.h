// `vrdma cluster init|add-node|show`: the credentials with which backends authenticate each
// other over TLS 1.3. A cluster CA (ca.key, ca.pem) signs one certificate per backend node whose
// subject CN is the node name. The layout of the directory is a contract with the transport,
// which reads ca.pem, <node>.pem and <node>.key from its cluster_dir (never ca.key).
// Runs in the CLI only; nothing here is shared with the data path.
#pragma once

#include <openssl/evp.h>
#include <openssl/x509.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "common/status.h"

namespace vrdma::cli {

inline constexpr const char* kDefaultClusterDir = "/etc/vrdma/cluster";
inline constexpr int kDefaultNodeDays = 825;  ///< the CA/Browser Forum's old leaf maximum
inline constexpr int kCaDays = 3653;          ///< ten years, leap days included

/// unique_ptr deleter calling an OpenSSL free function.
template <auto Free>
struct OsslFree {
  template <typename T>
  void operator()(T* p) const noexcept {
    Free(p);
  }
};
using PkeyPtr = std::unique_ptr<EVP_PKEY, OsslFree<EVP_PKEY_free>>;
using X509Ptr = std::unique_ptr<X509, OsslFree<X509_free>>;

/// Checks a node name: 1..63 bytes of [A-Za-z0-9._-], not starting with '.' or '-', not "ca"
/// (ca.pem is the CA's). EINVAL with a message otherwise.
Status check_node_name(std::string_view name);

/// True when `name` is a DNS name (dot-separated labels of letters, digits and inner hyphens,
/// the last not all digits, so an IPv4 address is not one): only then does the leaf get a SAN.
bool is_dns_name(std::string_view name);

/// What `init` and `add-node` made: what to tell the operator, and the same as JSON (-j):
/// dir, key and cert (the files' paths), subject, issuer and not_after (as `show` says them);
/// init adds `next` (the command to run next), add-node `node`, `copy` (the files the host
/// needs) and `copy_to` (where its backend looks for them by default).
struct MadeReport {
  std::string text;
  nlohmann::json json;
};

/// `vrdma cluster init`: creates `dir` (0700) when missing, refuses a symlink or a directory
/// writable by group/others, then writes ca.key (0600) and ca.pem. Refuses (EEXIST) when either
/// exists.
Result<MadeReport> cluster_init(const std::string& dir);

/// `vrdma cluster add-node`: signs a certificate for `name` with dir/ca.key and writes
/// dir/<name>.key (0600) and dir/<name>.pem, replacing existing ones only with `force`.
/// EINVAL for a bad name or day count. Says what to copy where.
Result<MadeReport> cluster_add_node(const std::string& dir, const std::string& name,
                                    int days = kDefaultNodeDays, bool force = false);

/// `vrdma cluster show`: one line per *.pem in `dir` (file, subject CN, issuer CN, not-after,
/// "ok" or OpenSSL's verify error against ca.pem).
struct ShowReport {
  std::string text;
  bool all_ok = true;  ///< every certificate verified
  /// The same, one object a file: file, subject, issuer, not_after, verdict ("ok" or why not);
  /// an unreadable one has file and error only.
  nlohmann::json certs = nlohmann::json::array();
};
Result<ShowReport> cluster_show(const std::string& dir);

/// "ok" when `cert` chains to `ca` (X509_verify_cert, default flags), else OpenSSL's reason.
std::string verify_against(X509* cert, X509* ca);

/// Reads a PEM certificate / private key file; EPROTO when it holds none.
Result<X509Ptr> read_cert(const std::string& path);
Result<PkeyPtr> read_key(const std::string& path);

}  // namespace vrdma::cli
