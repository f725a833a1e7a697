// The cluster CA and the node certificates (cluster.h). Every file is written through a temp
// file created O_EXCL|O_NOFOLLOW with its final mode, then linked (or, with --force, renamed)
// into place, so a reader never sees half a key and a secret is never chmod'ed after the fact.
#include "cli/cluster.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <openssl/asn1.h>
#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509v3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <vector>

#include "common/unique_fd.h"

namespace vrdma::cli {
namespace {

using BioPtr = std::unique_ptr<BIO, OsslFree<BIO_free>>;
using BnPtr = std::unique_ptr<BIGNUM, OsslFree<BN_free>>;
using ExtPtr = std::unique_ptr<X509_EXTENSION, OsslFree<X509_EXTENSION_free>>;
using StorePtr = std::unique_ptr<X509_STORE, OsslFree<X509_STORE_free>>;
using StoreCtxPtr = std::unique_ptr<X509_STORE_CTX, OsslFree<X509_STORE_CTX_free>>;

constexpr mode_t kKeyMode = 0600;
constexpr mode_t kCertMode = 0644;

/// EPROTO with `what` and the reason at the head of OpenSSL's error queue (which it empties).
Status ossl_error(const std::string& what) {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return error(EPROTO, what);
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return error(EPROTO, fmt::format("{}: {}", what, buf));
}

Status errno_error(int err, const std::string& what) {
  return error(err, fmt::format("{}: {}", what, std::strerror(err)));
}

/// dir/name as messages show it; just `name` when `dir` is empty (a path of the caller's).
std::string path_in(const std::string& dir, std::string_view name) {
  return dir.empty() ? std::string(name) : fmt::format("{}/{}", dir, name);
}

Result<std::string> random_hex(size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  if (RAND_bytes(raw.data(), static_cast<int>(raw.size())) != 1) {
    return ossl_error("RAND_bytes");
  }
  std::string out;
  for (unsigned char c : raw) out += fmt::format("{:02x}", c);
  return out;
}

/// Opens the credentials directory, creating it (0700, parents 0755) when `create`. Refuses a
/// symlink and a directory that group or others may write: they could swap our files.
Result<UniqueFd> open_cluster_dir(const std::string& dir, bool create) {
  if (dir.empty()) return error(EINVAL, "the cluster directory is empty");
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    if (errno != ENOENT || !create) return errno_error(errno, dir);
    const std::filesystem::path parent = std::filesystem::path(dir).parent_path();
    std::error_code ec;
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    if (ec) return error(ec.value(), fmt::format("{}: {}", parent.string(), ec.message()));
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) return errno_error(errno, dir);
  } else if (S_ISLNK(st.st_mode)) {
    return error(EPERM, fmt::format("{} is a symlink; give the real directory", dir));
  }
  // O_NOFOLLOW closes the gap between lstat and open; fstat checks what we really hold.
  UniqueFd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) return errno_error(errno, dir);
  if (::fstat(fd.get(), &st) != 0) return errno_error(errno, dir);
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return error(EPERM, fmt::format("{} is writable by group or others (mode {:04o}); "
                                    "`chmod go-w {}` or choose another --dir",
                                    dir, st.st_mode & 07777, dir));
  }
  return fd;
}

/// Ok when dir/name does not exist; EEXIST naming it (then `hint`) when it does.
Status refuse_existing(int dirfd, const std::string& dir, const std::string& name,
                       const char* hint) {
  struct stat st {};
  if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
    return error(EEXIST, fmt::format("{} already exists{}", path_in(dir, name), hint));
  }
  if (errno != ENOENT) return errno_error(errno, path_in(dir, name));
  return Status::ok();
}

Status write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return error(errno, std::strerror(errno));
    data.remove_prefix(static_cast<size_t>(n));
  }
  return Status::ok();
}

/// Writes dir/name with `mode`: a temp file beside it, fsync'ed, then linkat (EEXIST when the
/// name exists) or, with `replace`, renameat over it. The temp name starts with '.', which no
/// node name may, so it never collides with a credential.
Status write_file_at(int dirfd, const std::string& dir, const std::string& name,
                     std::string_view data, mode_t mode, bool replace) {
  ASSIGN_OR_RETURN(const std::string suffix, random_hex(4));
  const std::string tmp = fmt::format(".{}.tmp-{}", name, suffix);
  UniqueFd fd(
      ::openat(dirfd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, mode));
  if (!fd.valid()) return errno_error(errno, path_in(dir, tmp));
  Status st = write_all(fd.get(), data);
  if (st && ::fsync(fd.get()) != 0) st = error(errno, std::strerror(errno));
  if (st) {
    const int rc = replace ? ::renameat(dirfd, tmp.c_str(), dirfd, name.c_str())
                           : ::linkat(dirfd, tmp.c_str(), dirfd, name.c_str(), 0);
    if (rc != 0) st = error(errno, std::strerror(errno));
  }
  if (!st || !replace) ::unlinkat(dirfd, tmp.c_str(), 0);
  if (!st) return error(st.err(), fmt::format("writing {}: {}", path_in(dir, name), st.message()));
  ::fsync(dirfd);  // the new name survives a crash; failure here loses nothing already written
  return Status::ok();
}

Result<std::string> read_at(int dirfd, const std::string& dir, const std::string& name) {
  UniqueFd fd(::openat(dirfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
  if (!fd.valid()) return errno_error(errno, path_in(dir, name));
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno_error(errno, path_in(dir, name));
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > (1u << 20)) return error(EFBIG, path_in(dir, name) + ": over 1 MiB");
  }
  return out;
}

Result<X509Ptr> parse_cert(const std::string& pem, const std::string& path) {
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (!bio) return ossl_error("BIO_new_mem_buf");
  X509Ptr cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (!cert) return ossl_error(path + " holds no PEM certificate");
  return cert;
}

Result<PkeyPtr> parse_key(std::string pem, const std::string& path) {
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (!bio) return ossl_error("BIO_new_mem_buf");
  PkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  OPENSSL_cleanse(pem.data(), pem.size());
  if (!key) return ossl_error(path + " holds no PEM private key");
  return key;
}

Result<PkeyPtr> generate_ed25519() {
  PkeyPtr key(EVP_PKEY_Q_keygen(nullptr, nullptr, "ED25519"));
  if (!key) return ossl_error("generating an Ed25519 key");
  return key;
}

/// The key as PEM PKCS#8 (unencrypted: the file mode protects it).
Result<std::string> key_pem(EVP_PKEY* key) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio ||
      PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) != 1) {
    return ossl_error("encoding the private key");
  }
  char* data = nullptr;
  const long len = BIO_get_mem_data(bio.get(), &data);
  std::string out(data, static_cast<size_t>(len));
  OPENSSL_cleanse(data, static_cast<size_t>(len));
  return out;
}

Result<std::string> cert_pem(X509* cert) {
  BioPtr bio(BIO_new(BIO_s_mem()));
  if (!bio || PEM_write_bio_X509(bio.get(), cert) != 1)
    return ossl_error("encoding the certificate");
  char* data = nullptr;
  const long len = BIO_get_mem_data(bio.get(), &data);
  return std::string(data, static_cast<size_t>(len));
}

std::string name_cn(const X509_NAME* name) {
  char buf[256] = {};
  if (X509_NAME_get_text_by_NID(name, NID_commonName, buf, sizeof(buf)) < 0) return "-";
  return buf;
}

/// "2035-01-01T12:00:00Z".
std::string not_after_text(const X509* cert) {
  std::tm tm{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(cert), &tm) != 1) return "?";
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

/// What a new certificate says; `issuer` null means self-signed by `subject_key`.
struct CertSpec {
  std::string cn;
  EVP_PKEY* subject_key = nullptr;
  X509* issuer = nullptr;
  EVP_PKEY* signing_key = nullptr;
  int days = 0;
  bool ca = false;
  bool san_dns = false;  ///< add subjectAltName DNS:<cn>
};

Status add_ext(X509* cert, X509V3_CTX* ctx, int nid, const char* value) {
  ExtPtr ext(X509V3_EXT_conf_nid(nullptr, ctx, nid, value));
  if (!ext || X509_add_ext(cert, ext.get(), -1) != 1) {
    return ossl_error(fmt::format("adding {} = {}", OBJ_nid2sn(nid), value));
  }
  return Status::ok();
}

Result<X509Ptr> make_cert(const CertSpec& s) {
  X509Ptr cert(X509_new());
  if (!cert) return ossl_error("X509_new");
  // 128 random bits, read unsigned, so the serial is positive (RFC 5280 4.1.2.2).
  unsigned char serial_bytes[16];
  if (RAND_bytes(serial_bytes, sizeof(serial_bytes)) != 1) return ossl_error("RAND_bytes");
  serial_bytes[15] |= 1;  // never zero
  BnPtr serial(BN_bin2bn(serial_bytes, sizeof(serial_bytes), nullptr));
  X509_NAME* subject = X509_get_subject_name(cert.get());
  const auto* cn = reinterpret_cast<const unsigned char*>(s.cn.c_str());
  if (!serial || !BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(cert.get())) ||
      X509_set_version(cert.get(), X509_VERSION_3) != 1 ||
      X509_NAME_add_entry_by_txt(subject, "CN", MBSTRING_UTF8, cn, -1, -1, 0) != 1 ||
      X509_set_issuer_name(cert.get(), s.issuer ? X509_get_subject_name(s.issuer) : subject) != 1 ||
      !X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600) ||
      !X509_time_adj_ex(X509_getm_notAfter(cert.get()), s.days, 0, nullptr) ||
      X509_set_pubkey(cert.get(), s.subject_key) != 1) {
    return ossl_error("filling in the certificate for " + s.cn);
  }
  X509V3_CTX ctx;
  X509V3_set_ctx(&ctx, s.issuer ? s.issuer : cert.get(), cert.get(), nullptr, nullptr, 0);
  if (s.ca) {
    RETURN_IF_ERROR(add_ext(cert.get(), &ctx, NID_basic_constraints, "critical,CA:TRUE,pathlen:0"));
    RETURN_IF_ERROR(add_ext(cert.get(), &ctx, NID_key_usage, "critical,keyCertSign,cRLSign"));
    RETURN_IF_ERROR(add_ext(cert.get(), &ctx, NID_subject_key_identifier, "hash"));
  } else {
    RETURN_IF_ERROR(add_ext(cert.get(), &ctx, NID_basic_constraints, "critical,CA:FALSE"));
    RETURN_IF_ERROR(add_ext(cert.get(), &ctx, NID_key_usage, "critical,digitalSignature"));
    RETURN_IF_ERROR(add_ext(cert.get(), &ctx, NID_ext_key_usage, "serverAuth,clientAuth"));
    if (s.san_dns) {
      RETURN_IF_ERROR(add_ext(cert.get(), &ctx, NID_subject_alt_name, ("DNS:" + s.cn).c_str()));
    }
    RETURN_IF_ERROR(add_ext(cert.get(), &ctx, NID_authority_key_identifier, "keyid:always"));
  }
  // EdDSA signs the message itself: no digest. Another CA key type (one brought from elsewhere)
  // gets SHA-256.
  const bool eddsa =
      EVP_PKEY_is_a(s.signing_key, "ED25519") || EVP_PKEY_is_a(s.signing_key, "ED448");
  if (X509_sign(cert.get(), s.signing_key, eddsa ? nullptr : EVP_sha256()) <= 0) {
    return ossl_error("signing the certificate for " + s.cn);
  }
  return cert;
}

struct LoadedCa {
  PkeyPtr key;
  X509Ptr cert;
};

Result<LoadedCa> load_ca(int dirfd, const std::string& dir) {
  for (const char* f : {"ca.key", "ca.pem"}) {
    if (::faccessat(dirfd, f, F_OK, AT_SYMLINK_NOFOLLOW) != 0 && errno == ENOENT) {
      return error(ENOENT, fmt::format("no {} (run `vrdma cluster init --dir {}` first)",
                                       path_in(dir, f), dir));
    }
  }
  ASSIGN_OR_RETURN(std::string key_text, read_at(dirfd, dir, "ca.key"));
  ASSIGN_OR_RETURN(PkeyPtr key, parse_key(std::move(key_text), path_in(dir, "ca.key")));
  ASSIGN_OR_RETURN(const std::string cert_text, read_at(dirfd, dir, "ca.pem"));
  ASSIGN_OR_RETURN(X509Ptr cert, parse_cert(cert_text, path_in(dir, "ca.pem")));
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return error(EPROTO, fmt::format("{} does not match {} (not the key of that CA)",
                                     path_in(dir, "ca.key"), path_in(dir, "ca.pem")));
  }
  if (X509_check_ca(cert.get()) == 0) {
    return error(EPROTO, fmt::format("{} is not a CA certificate", path_in(dir, "ca.pem")));
  }
  return LoadedCa{std::move(key), std::move(cert)};
}

}  // namespace

Status check_node_name(std::string_view name) {
  const auto bad = [&](const char* why) {
    return error(EINVAL, fmt::format("bad node name \"{}\": {}", name, why));
  };
  if (name.empty() || name.size() > 63) return bad("it must be 1..63 bytes");
  const bool charset = std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
  });
  if (!charset) return bad("only letters, digits, '.', '_' and '-' are allowed");
  if (name.front() == '.' || name.front() == '-') return bad("it may not start with '.' or '-'");
  if (name == "ca") return bad("\"ca\" is the cluster CA's (ca.pem)");
  return Status::ok();
}

bool is_dns_name(std::string_view name) {
  if (name.empty() || name.size() > 253) return false;
  bool all_digits = true;  // of the last label
  size_t label = 0;        // its length so far
  char prev = '.';
  for (char c : name) {
    if (c == '.') {
      if (label == 0 || prev == '-') return false;
      label = 0;
      all_digits = true;
    } else {
      const bool digit = c >= '0' && c <= '9';
      const bool alnum = digit || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
      if (!alnum && !(c == '-' && label > 0)) return false;
      if (++label > 63) return false;
      all_digits = all_digits && digit;
    }
    prev = c;
  }
  return label > 0 && prev != '-' && !all_digits;
}

Result<X509Ptr> read_cert(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string text, read_at(AT_FDCWD, "", path));
  return parse_cert(text, path);
}

Result<PkeyPtr> read_key(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, read_at(AT_FDCWD, "", path));
  return parse_key(std::move(text), path);
}

std::string verify_against(X509* cert, X509* ca) {
  StorePtr store(X509_STORE_new());
  StoreCtxPtr ctx(X509_STORE_CTX_new());
  if (!store || !ctx || X509_STORE_add_cert(store.get(), ca) != 1 ||
      X509_STORE_CTX_init(ctx.get(), store.get(), cert, nullptr) != 1) {
    return ossl_error("setting up verification").message();
  }
  const int rc = X509_verify_cert(ctx.get());
  ERR_clear_error();
  if (rc == 1) return "ok";
  return X509_verify_cert_error_string(X509_STORE_CTX_get_error(ctx.get()));
}

namespace {

/// The JSON members `init` and `add-node` share (MadeReport): the files of `stem`, `cert`'s names.
nlohmann::json made_json(const std::string& dir, const std::string& stem, X509* cert) {
  return {{"dir", dir},
          {"key", path_in(dir, stem + ".key")},
          {"cert", path_in(dir, stem + ".pem")},
          {"subject", name_cn(X509_get_subject_name(cert))},
          {"issuer", name_cn(X509_get_issuer_name(cert))},
          {"not_after", not_after_text(cert)}};
}

}  // namespace

Result<MadeReport> cluster_init(const std::string& dir) {
  ASSIGN_OR_RETURN(UniqueFd dirfd, open_cluster_dir(dir, /*create=*/true));
  const char* hint = "; refusing to replace the cluster CA (every node certificate depends on it)";
  RETURN_IF_ERROR(refuse_existing(dirfd.get(), dir, "ca.key", hint));
  RETURN_IF_ERROR(refuse_existing(dirfd.get(), dir, "ca.pem", hint));

  ASSIGN_OR_RETURN(const std::string tag, random_hex(4));
  ASSIGN_OR_RETURN(PkeyPtr key, generate_ed25519());
  const std::string cn = "vrdma cluster CA " + tag;
  ASSIGN_OR_RETURN(X509Ptr cert, make_cert({.cn = cn,
                                            .subject_key = key.get(),
                                            .signing_key = key.get(),
                                            .days = kCaDays,
                                            .ca = true}));
  ASSIGN_OR_RETURN(std::string secret, key_pem(key.get()));
  ASSIGN_OR_RETURN(const std::string pem, cert_pem(cert.get()));
  Status st = write_file_at(dirfd.get(), dir, "ca.key", secret, kKeyMode, false);
  OPENSSL_cleanse(secret.data(), secret.size());
  RETURN_IF_ERROR(st);
  if (st = write_file_at(dirfd.get(), dir, "ca.pem", pem, kCertMode, false); !st) {
    ::unlinkat(dirfd.get(), "ca.key", 0);  // so that init can simply be run again
    return st;
  }
  const std::string next = fmt::format("vrdma cluster add-node NAME --dir {}", dir);
  MadeReport made{fmt::format("created {} and {} (\"{}\", valid until {})\n"
                              "keep ca.key here, on no backend host: it signs node certificates; "
                              "the backends need only ca.pem\nnext, for each backend host: {}  "
                              "(NAME: that backend's vrdmad --node)\n",
                              path_in(dir, "ca.key"), path_in(dir, "ca.pem"), cn,
                              not_after_text(cert.get()), next),
                  made_json(dir, "ca", cert.get())};
  made.json["next"] = next;
  return made;
}

Result<MadeReport> cluster_add_node(const std::string& dir, const std::string& name, int days,
                                    bool force) {
  RETURN_IF_ERROR(check_node_name(name));
  if (days < 1) return error(EINVAL, fmt::format("--days must be at least 1 (got {})", days));
  ASSIGN_OR_RETURN(UniqueFd dirfd, open_cluster_dir(dir, /*create=*/false));
  ASSIGN_OR_RETURN(LoadedCa ca, load_ca(dirfd.get(), dir));
  const std::string key_file = name + ".key", cert_file = name + ".pem";
  if (!force) {
    const char* hint = " (--force replaces it)";
    RETURN_IF_ERROR(refuse_existing(dirfd.get(), dir, key_file, hint));
    RETURN_IF_ERROR(refuse_existing(dirfd.get(), dir, cert_file, hint));
  }

  ASSIGN_OR_RETURN(PkeyPtr key, generate_ed25519());
  ASSIGN_OR_RETURN(X509Ptr cert, make_cert({.cn = name,
                                            .subject_key = key.get(),
                                            .issuer = ca.cert.get(),
                                            .signing_key = ca.key.get(),
                                            .days = days,
                                            .san_dns = is_dns_name(name)}));
  ASSIGN_OR_RETURN(std::string secret, key_pem(key.get()));
  ASSIGN_OR_RETURN(const std::string pem, cert_pem(cert.get()));
  Status st = write_file_at(dirfd.get(), dir, key_file, secret, kKeyMode, force);
  OPENSSL_cleanse(secret.data(), secret.size());
  RETURN_IF_ERROR(st);
  if (st = write_file_at(dirfd.get(), dir, cert_file, pem, kCertMode, force); !st) {
    if (!force) ::unlinkat(dirfd.get(), key_file.c_str(), 0);  // ours: nothing was there
    return st;
  }
  MadeReport made{
      fmt::format(
          "created {} and {} (CN {}, signed by \"{}\", valid until {})\n"
          "copy ca.pem, {}, {} from {} to {} on host {} ({}: mode 0600, owned by vrdmad's user); "
          "set [transport] cluster_dir (or vrdmad --cluster-dir) if you put them elsewhere, and "
          "run vrdmad there with --node {}\n",
          path_in(dir, key_file), path_in(dir, cert_file), name,
          name_cn(X509_get_subject_name(ca.cert.get())), not_after_text(cert.get()), cert_file,
          key_file, dir, kDefaultClusterDir, name, key_file, name),
      made_json(dir, name, cert.get())};
  made.json["node"] = name;
  made.json["copy"] = {"ca.pem", cert_file, key_file};
  made.json["copy_to"] = kDefaultClusterDir;
  return made;
}

Result<ShowReport> cluster_show(const std::string& dir) {
  UniqueFd dirfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dirfd.valid()) return errno_error(errno, dir);
  ASSIGN_OR_RETURN(const std::string ca_text, read_at(dirfd.get(), dir, "ca.pem"));
  ASSIGN_OR_RETURN(X509Ptr ca, parse_cert(ca_text, path_in(dir, "ca.pem")));

  std::vector<std::string> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    if (f.ends_with(".pem") && !f.starts_with(".") && e.is_regular_file(ec)) files.push_back(f);
  }
  if (ec) return error(ec.value(), fmt::format("{}: {}", dir, ec.message()));
  std::sort(files.begin(), files.end(), [](const std::string& a, const std::string& b) {
    return (a == "ca.pem") != (b == "ca.pem") ? a == "ca.pem" : a < b;  // the CA first
  });

  ShowReport report;
  for (const std::string& f : files) {
    auto cert = read_at(dirfd.get(), dir, f);
    auto parsed = cert ? parse_cert(*cert, f) : Result<X509Ptr>(cert.status());
    if (!parsed) {
      report.all_ok = false;
      report.text += fmt::format("{}: unreadable: {}\n", f, parsed.status().message());
      report.certs.push_back({{"file", f}, {"error", parsed.status().message()}});
      continue;
    }
    X509* c = parsed->get();
    const std::string verdict = verify_against(c, ca.get());
    report.all_ok = report.all_ok && verdict == "ok";
    const std::string subject = name_cn(X509_get_subject_name(c));
    const std::string issuer = name_cn(X509_get_issuer_name(c));
    const std::string not_after = not_after_text(c);
    report.text += fmt::format("{}: subject \"{}\", issuer \"{}\", not after {}: {}\n", f, subject,
                               issuer, not_after, verdict);
    report.certs.push_back({{"file", f},
                            {"subject", subject},
                            {"issuer", issuer},
                            {"not_after", not_after},
                            {"verdict", verdict}});
  }
  return report;
}

}  // namespace vrdma::cli
