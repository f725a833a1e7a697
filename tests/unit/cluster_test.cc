// `vrdma cluster`: the CA and node certificates it writes, checked with OpenSSL itself (a chain
// to ca.pem, the leaf's CN, EKU and CA:FALSE, the key matching the certificate, file modes) and
// what it refuses (overwrites, bad names, a directory others may write, another CA's leaf).
#include "cli/cluster.h"

#include <gtest/gtest.h>
#include <openssl/bn.h>
#include <openssl/x509v3.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace vrdma::cli {
namespace {

namespace fs = std::filesystem;

class ClusterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/vrdma-cluster-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    dir_ = root_ + "/cl";
  }
  void TearDown() override { fs::remove_all(root_); }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  X509Ptr cert(const std::string& name) {
    auto c = read_cert(path(name));
    EXPECT_TRUE(c) << c.status().message();
    return c ? std::move(c.value()) : X509Ptr();
  }

  static mode_t mode_of(const std::string& p) {
    struct stat st {};
    EXPECT_EQ(::lstat(p.c_str(), &st), 0) << p;
    return st.st_mode & 07777;
  }

  static std::string slurp(const std::string& p) {
    std::ifstream in(p);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

  std::string root_, dir_;
};

std::string cn_of(X509* c) {
  char buf[256] = {};
  X509_NAME_get_text_by_NID(X509_get_subject_name(c), NID_commonName, buf, sizeof(buf));
  return buf;
}

/// X509_verify_cert of `leaf` against `ca` alone, for `purpose` (X509_PURPOSE_*; 0: none).
bool chains_to(X509* leaf, X509* ca, int purpose = 0) {
  std::unique_ptr<X509_STORE, OsslFree<X509_STORE_free>> store(X509_STORE_new());
  std::unique_ptr<X509_STORE_CTX, OsslFree<X509_STORE_CTX_free>> ctx(X509_STORE_CTX_new());
  X509_STORE_add_cert(store.get(), ca);
  X509_STORE_CTX_init(ctx.get(), store.get(), leaf, nullptr);
  if (purpose != 0) X509_STORE_CTX_set_purpose(ctx.get(), purpose);
  return X509_verify_cert(ctx.get()) == 1;
}

TEST_F(ClusterTest, InitWritesAnEd25519CaThatAddNodeSignsWith) {
  auto init = cluster_init(dir_);
  ASSERT_TRUE(init) << init.status().message();
  EXPECT_EQ(mode_of(dir_), 0700u);
  EXPECT_EQ(mode_of(path("ca.key")), 0600u);
  EXPECT_NE(slurp(path("ca.key")).find("-----BEGIN PRIVATE KEY-----"), std::string::npos);

  X509Ptr ca = cert("ca.pem");
  ASSERT_TRUE(ca);
  const std::string ca_cn = cn_of(ca.get());
  ASSERT_EQ(ca_cn.size(), std::string("vrdma cluster CA ").size() + 8) << ca_cn;
  EXPECT_TRUE(ca_cn.starts_with("vrdma cluster CA "));
  EXPECT_EQ(ca_cn.find_first_not_of("0123456789abcdef", 17), std::string::npos) << ca_cn;
  EXPECT_EQ(X509_get_version(ca.get()), X509_VERSION_3);
  EXPECT_EQ(X509_check_ca(ca.get()), 1);
  EXPECT_EQ(X509_get_pathlen(ca.get()), 0);
  EXPECT_EQ(X509_get_key_usage(ca.get()), uint32_t{KU_KEY_CERT_SIGN | KU_CRL_SIGN});
  EXPECT_NE(X509_get0_subject_key_id(ca.get()), nullptr);
  EXPECT_TRUE(EVP_PKEY_is_a(X509_get0_pubkey(ca.get()), "ED25519"));
  EXPECT_TRUE(chains_to(ca.get(), ca.get()));

  auto add = cluster_add_node(dir_, "hostA");
  ASSERT_TRUE(add) << add.status().message();
  EXPECT_NE(add->text.find("copy ca.pem, hostA.pem, hostA.key"), std::string::npos) << add->text;
  EXPECT_NE(add->text.find("cluster_dir"), std::string::npos) << add->text;
  // -j says the same: the files, the names in the certificates, what to copy where.
  EXPECT_EQ(init->json["cert"], path("ca.pem"));
  EXPECT_EQ(init->json["subject"], ca_cn);
  EXPECT_EQ(init->json["issuer"], ca_cn);
  EXPECT_EQ(init->json["next"], "vrdma cluster add-node NAME --dir " + dir_);
  EXPECT_EQ(add->json["node"], "hostA");
  EXPECT_EQ(add->json["key"], path("hostA.key"));
  EXPECT_EQ(add->json["issuer"], ca_cn);
  EXPECT_EQ(add->json["copy"], nlohmann::json({"ca.pem", "hostA.pem", "hostA.key"}));
  EXPECT_EQ(add->json["copy_to"], kDefaultClusterDir);
  EXPECT_EQ(mode_of(path("hostA.key")), 0600u);

  X509Ptr leaf = cert("hostA.pem");
  ASSERT_TRUE(leaf);
  EXPECT_EQ(cn_of(leaf.get()), "hostA");
  EXPECT_TRUE(chains_to(leaf.get(), ca.get()));
  EXPECT_TRUE(chains_to(leaf.get(), ca.get(), X509_PURPOSE_SSL_CLIENT));
  EXPECT_TRUE(chains_to(leaf.get(), ca.get(), X509_PURPOSE_SSL_SERVER));
  EXPECT_EQ(verify_against(leaf.get(), ca.get()), "ok");
  EXPECT_EQ(X509_check_ca(leaf.get()), 0);
  EXPECT_TRUE(X509_get_extension_flags(leaf.get()) & EXFLAG_BCONS);  // CA:FALSE, stated
  EXPECT_EQ(X509_get_extended_key_usage(leaf.get()) & (XKU_SSL_SERVER | XKU_SSL_CLIENT),
            uint32_t{XKU_SSL_SERVER | XKU_SSL_CLIENT});
  EXPECT_EQ(X509_get_key_usage(leaf.get()), uint32_t{KU_DIGITAL_SIGNATURE});
  EXPECT_NE(X509_get0_authority_key_id(leaf.get()), nullptr);
  EXPECT_EQ(X509_check_host(leaf.get(), "hostA", 0, 0, nullptr), 1);  // SAN DNS:hostA
  std::unique_ptr<BIGNUM, OsslFree<BN_free>> serial(
      ASN1_INTEGER_to_BN(X509_get0_serialNumber(leaf.get()), nullptr));
  ASSERT_TRUE(serial);
  EXPECT_FALSE(BN_is_negative(serial.get()));
  EXPECT_GT(BN_num_bits(serial.get()), 64);  // 128 random bits (below 2^-64 to fail by chance)
  EXPECT_EQ(X509_cmp_time(X509_get0_notBefore(leaf.get()), nullptr), -1);  // already valid

  auto key = read_key(path("hostA.key"));
  ASSERT_TRUE(key) << key.status().message();
  EXPECT_TRUE(EVP_PKEY_is_a(key->get(), "ED25519"));
  EXPECT_EQ(X509_check_private_key(leaf.get(), key->get()), 1);

  // OpenSSL's own command line agrees, when it is installed.
  if (::access("/usr/bin/openssl", X_OK) == 0) {
    const std::string cmd = "/usr/bin/openssl verify -CAfile " + path("ca.pem") + " " +
                            path("hostA.pem") + " >/dev/null 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0);
  }

  auto show = cluster_show(dir_);
  ASSERT_TRUE(show) << show.status().message();
  EXPECT_TRUE(show->all_ok) << show->text;
  EXPECT_NE(show->text.find("hostA.pem: subject \"hostA\", issuer \"" + ca_cn), std::string::npos)
      << show->text;
}

TEST_F(ClusterTest, SanOnlyForDnsNamesAndDaysAreHonoured) {
  ASSERT_TRUE(cluster_init(dir_));
  ASSERT_TRUE(cluster_add_node(dir_, "node_1", 10));
  X509Ptr leaf = cert("node_1.pem");
  ASSERT_TRUE(leaf);
  EXPECT_EQ(X509_get_ext_d2i(leaf.get(), NID_subject_alt_name, nullptr, nullptr), nullptr);
  int days = 0, secs = 0;
  ASSERT_EQ(
      ASN1_TIME_diff(&days, &secs, X509_get0_notBefore(leaf.get()), X509_get0_notAfter(leaf.get())),
      1);
  EXPECT_EQ(days, 10);  // and the hour before now
  EXPECT_EQ(secs, 3600);

  EXPECT_TRUE(is_dns_name("hostA"));
  EXPECT_TRUE(is_dns_name("a-1.example.org"));
  EXPECT_FALSE(is_dns_name("node_1"));
  EXPECT_FALSE(is_dns_name("a..b"));
  EXPECT_FALSE(is_dns_name("a-.b"));
  EXPECT_FALSE(is_dns_name("10.0.0.1"));
  EXPECT_FALSE(is_dns_name("host."));
}

TEST_F(ClusterTest, RefusesToOverwriteWithoutForce) {
  ASSERT_TRUE(cluster_init(dir_));
  auto again = cluster_init(dir_);
  ASSERT_FALSE(again);
  EXPECT_EQ(again.err(), EEXIST);
  EXPECT_NE(again.status().message().find("ca.key"), std::string::npos);

  ASSERT_TRUE(cluster_add_node(dir_, "hostA"));
  const std::string before = slurp(path("hostA.pem"));
  auto dup = cluster_add_node(dir_, "hostA");
  ASSERT_FALSE(dup);
  EXPECT_EQ(dup.err(), EEXIST);
  EXPECT_NE(dup.status().message().find("hostA.key"), std::string::npos);
  EXPECT_EQ(slurp(path("hostA.pem")), before);

  auto forced = cluster_add_node(dir_, "hostA", kDefaultNodeDays, /*force=*/true);
  ASSERT_TRUE(forced) << forced.status().message();
  EXPECT_NE(slurp(path("hostA.pem")), before);
  EXPECT_EQ(mode_of(path("hostA.key")), 0600u);
  X509Ptr leaf = cert("hostA.pem");
  X509Ptr ca = cert("ca.pem");
  auto key = read_key(path("hostA.key"));
  ASSERT_TRUE(leaf && ca && key);
  EXPECT_TRUE(chains_to(leaf.get(), ca.get()));
  EXPECT_EQ(X509_check_private_key(leaf.get(), key->get()), 1);
  for (const auto& e : fs::directory_iterator(dir_)) {  // no temp file left behind
    EXPECT_FALSE(e.path().filename().string().starts_with(".")) << e.path();
  }

  // ca.pem alone (a half-copied directory) is refused too, and named.
  fs::remove(path("ca.key"));
  auto half = cluster_init(dir_);
  ASSERT_FALSE(half);
  EXPECT_NE(half.status().message().find("ca.pem"), std::string::npos);
}

TEST_F(ClusterTest, RefusesBadNodeNames) {
  ASSERT_TRUE(cluster_init(dir_));
  for (const std::string& name : std::initializer_list<std::string>{
           "", "ca", "a/b", std::string(64, 'n'), "-x", ".x", "a b", "../x"}) {
    auto r = cluster_add_node(dir_, name);
    ASSERT_FALSE(r) << name;
    EXPECT_EQ(r.err(), EINVAL) << name;
  }
  EXPECT_TRUE(check_node_name(std::string(63, 'n')));
  EXPECT_TRUE(check_node_name("x-1.y_2"));
  EXPECT_EQ(cluster_add_node(dir_, "ok", 0).err(), EINVAL);
}

TEST_F(ClusterTest, RefusesADirectoryOthersMayWriteOrASymlink) {
  ASSERT_EQ(::mkdir(dir_.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(dir_.c_str(), 0770), 0);
  auto r = cluster_init(dir_);
  ASSERT_FALSE(r);
  EXPECT_NE(r.status().message().find("writable by group or others"), std::string::npos)
      << r.status().message();
  EXPECT_FALSE(fs::exists(path("ca.key")));

  ASSERT_EQ(::chmod(dir_.c_str(), 0700), 0);
  const std::string link = root_ + "/link";
  fs::create_directory_symlink(dir_, link);
  auto s = cluster_init(link);
  ASSERT_FALSE(s);
  EXPECT_NE(s.status().message().find("symlink"), std::string::npos) << s.status().message();
  EXPECT_FALSE(fs::exists(path("ca.key")));
}

TEST_F(ClusterTest, AnotherCasLeafDoesNotVerify) {
  const std::string other = root_ + "/other";
  ASSERT_TRUE(cluster_init(dir_));
  ASSERT_TRUE(cluster_init(other));
  ASSERT_TRUE(cluster_add_node(other, "intruder"));
  X509Ptr ca = cert("ca.pem");
  auto foreign = read_cert(other + "/intruder.pem");
  ASSERT_TRUE(ca && foreign);
  EXPECT_FALSE(chains_to(foreign->get(), ca.get()));
  EXPECT_EQ(verify_against(foreign->get(), ca.get()), "unable to get local issuer certificate");

  fs::copy_file(other + "/intruder.pem", path("intruder.pem"));
  auto show = cluster_show(dir_);
  ASSERT_TRUE(show) << show.status().message();
  EXPECT_FALSE(show->all_ok);
  EXPECT_NE(show->text.find("intruder.pem: subject \"intruder\""), std::string::npos) << show->text;

  // The other CA's key beside this ca.pem: add-node notices the mismatch.
  fs::copy_file(other + "/ca.key", path("ca.key"), fs::copy_options::overwrite_existing);
  auto mixed = cluster_add_node(dir_, "hostB");
  ASSERT_FALSE(mixed);
  EXPECT_NE(mixed.status().message().find("does not match"), std::string::npos);
}

TEST_F(ClusterTest, AddNodeWithoutACaSaysToRunInit) {
  ASSERT_EQ(::mkdir(dir_.c_str(), 0700), 0);
  auto r = cluster_add_node(dir_, "hostA");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.err(), ENOENT);
  EXPECT_NE(r.status().message().find("vrdma cluster init"), std::string::npos);
}

}  // namespace
}  // namespace vrdma::cli
