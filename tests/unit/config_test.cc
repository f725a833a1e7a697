// The backend's config file: defaults, overrides, and rejection (with the line) of anything wrong.
#include <gtest/gtest.h>

#include "backend/config.h"

namespace vrdma::backend {
namespace {

TEST(ConfigTest, EmptyFileKeepsDefaults) {
  Config c;
  ASSERT_TRUE(c.load_string("", "t.toml").is_ok());
  EXPECT_EQ(c.spin_us, 200);
  EXPECT_EQ(c.nice, -3);
  EXPECT_EQ(c.quotas.max_qps, 1024u);
  EXPECT_FALSE(c.metrics_enabled);
  EXPECT_EQ(c.metrics_listen, "127.0.0.1:9464");
  EXPECT_TRUE(c.direct_path);  // on by default (issue 25); the trust rule still applies
  EXPECT_TRUE(c.direct_remote);  // on by default too
  EXPECT_EQ(c.direct_trust, "kernel");
  EXPECT_TRUE(c.direct_tenants.empty());
}

// The direct path's trust rule: the kernel's by default; the operator may declare each uid, or
// named guests, one tenant.
TEST(ConfigTest, DirectTrust) {
  Config c;
  ASSERT_TRUE(c.load_string("[datapath]\ndirect_trust = \"uid\"\n"
                            "direct_tenants = [[\"a\", \"b\"], [\"c\"]]\n",
                            "t.toml")
                  .is_ok());
  EXPECT_EQ(c.direct_trust, "uid");
  EXPECT_EQ(c.direct_tenants, (std::vector<std::vector<std::string>>{{"a", "b"}, {"c"}}));
}

TEST(ConfigTest, ReadsTheExhaustionLimits) {
  Config c;
  EXPECT_EQ(c.max_pending_connections, 64);
  EXPECT_EQ(c.hello_timeout_ms, 5000);
  EXPECT_EQ(c.status_min_interval_ms, 100);
  EXPECT_EQ(c.quotas.max_segments, 4096u);
  EXPECT_EQ(c.quotas.max_segment_bytes, 128ull << 30);
  EXPECT_EQ(c.quotas.max_mapped_bytes, 32ull << 40);
  Status st = c.load_string(R"(
[backend]
max_pending_connections = 8
hello_timeout_ms = 250
status_min_interval_ms = 0
max_mapped_bytes = 1073741824
[quotas]
max_segments = 16
max_segment_bytes = 1048576
)",
                            "t.toml");
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(c.max_pending_connections, 8);
  EXPECT_EQ(c.hello_timeout_ms, 250);
  EXPECT_EQ(c.status_min_interval_ms, 0);
  EXPECT_EQ(c.quotas.max_mapped_bytes, 1ull << 30);
  EXPECT_EQ(c.quotas.max_segments, 16u);
  EXPECT_EQ(c.quotas.max_segment_bytes, 1ull << 20);
  st = c.load_string("[quotas]\nmax_segment = 3\n", "u.toml");
  EXPECT_NE(st.message().find("u.toml:2: unknown key \"max_segment\" in [quotas] (did you mean "
                              "max_segments?)"),
            std::string::npos)
      << st.message();
  st = c.load_string("[quotas]\nmax_mapped_bytes = 4096\n", "v.toml");
  EXPECT_NE(st.message().find("(it belongs in [backend])"), std::string::npos) << st.message();
}

TEST(ConfigTest, ReadsEverySection) {
  Config c;
  Status st = c.load_string(R"(
[backend]
socket = "/tmp/x.sock"
idle_exit_s = 5
log_level = "debug"
[datapath]
spin_us = 50
nice = 0
direct_path = false
direct_remote = false
[quotas]
max_qps = 7
max_mr_bytes = 1048576
[transport]
node = "a"
listen = "10.0.0.1:18515"
peers = ["10.0.0.2:18515", "10.0.0.3:18515"]
force = "tcp"
[metrics]
enabled = true
listen = "127.0.0.1:9000"
)",
                            "t.toml");
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(c.socket_path, "/tmp/x.sock");
  EXPECT_EQ(c.idle_exit_s, 5);
  EXPECT_EQ(c.log_level, "debug");
  EXPECT_EQ(c.spin_us, 50);
  EXPECT_EQ(c.nice, 0);
  EXPECT_FALSE(c.direct_path);  // the file turns the defaults off
  EXPECT_FALSE(c.direct_remote);
  EXPECT_EQ(c.quotas.max_qps, 7u);
  EXPECT_EQ(c.quotas.max_mr_bytes, 1048576u);
  EXPECT_EQ(c.node, "a");
  EXPECT_EQ(c.listen, "10.0.0.1:18515");
  ASSERT_EQ(c.peers.size(), 2u);
  EXPECT_EQ(c.peers[1], "10.0.0.3:18515");
  EXPECT_EQ(c.force, "tcp");
  EXPECT_TRUE(c.metrics_enabled);
  EXPECT_EQ(c.metrics_listen, "127.0.0.1:9000");
}

struct Bad {
  const char* text;
  const char* expect;  ///< a part of the message: the line and what is wrong
};

TEST(ConfigTest, RejectsWithTheLineAndChangesNothing) {
  const Bad cases[] = {
      {"[backend]\nspin_us = 5\n",
       "t.toml:2: unknown key \"spin_us\" in [backend] (it belongs in [datapath])"},
      {"[backend]\n\n[datapth]\n",
       "t.toml:3: unknown section [datapth] (did you mean [datapath]?)"},
      {"[quotas]\nmax_qp = 5\n",
       "t.toml:2: unknown key \"max_qp\" in [quotas] (did you mean max_qps?)"},
      {"[datapath]\nspin_us = \"fast\"\n", "t.toml:2: datapath.spin_us: expected an integer"},
      {"[quotas]\nmax_qps = 0\n", "t.toml:2: quotas.max_qps: 0 is out of range"},
      {"[datapath]\nnice = -21\n", "t.toml:2: datapath.nice: -21 is out of range"},
      {"[backend]\nlog_level = \"loud\"\n", "is not one of: debug, info, warn, error"},
      {"[transport]\nlisten = \"10.0.0.1\"\n",
       "t.toml:2: transport.listen: \"10.0.0.1\" is not ADDR:PORT"},
      {"[transport]\npeers = [\"a:0\"]\n", "transport.peers: \"a:0\" is not ADDR:PORT"},
      {"[metrics]\nenabled = 1\n", "t.toml:2: metrics.enabled: expected true or false"},
      {"[quotas]\nmax_qps = 3\nmax_cqs = \n", "t.toml:3:"},
      {"[datapath]\ndirect_trust = \"anyone\"\n", "is not one of: kernel, uid"},
      {"[datapath]\ndirect_tenants = [\"a\", \"b\"]\n",
       "t.toml:2: datapath.direct_tenants: expected an array of arrays of strings"},
      {"[datapath]\ndirect_tenants = [[\"a\", 1]]\n", "expected an array of arrays of strings"},
  };
  for (const Bad& b : cases) {
    Config c;
    Status st = c.load_string(b.text, "t.toml");
    EXPECT_FALSE(st.is_ok()) << b.text;
    EXPECT_NE(st.message().find(b.expect), std::string::npos) << st.message();
    EXPECT_EQ(c.quotas.max_qps, 1024u) << "a rejected file must change nothing";
  }
}

TEST(ConfigTest, NoSuggestionForAKeyFarFromAnyOther) {
  Config c;
  Status st = c.load_string("[quotas]\nsomething = 5\n", "t.toml");
  EXPECT_EQ(st.message(), "t.toml:2: unknown key \"something\" in [quotas]");
}

TEST(ConfigTest, MetricsSnapshotIntervalAndGuestNames) {
  Config c;
  EXPECT_EQ(c.metrics_min_interval_ms, 1000);
  EXPECT_FALSE(c.metrics_guest_names);
  EXPECT_TRUE(c.metrics_per_qp);
  Status st = c.load_string(
      "[metrics]\nmin_interval_ms = 250\nguest_names = true\nper_qp = false\n", "t.toml");
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(c.metrics_min_interval_ms, 250);
  EXPECT_TRUE(c.metrics_guest_names);
  EXPECT_FALSE(c.metrics_per_qp);
  const Bad cases[] = {
      {"[metrics]\nmin_interval_ms = -1\n",
       "t.toml:2: metrics.min_interval_ms: -1 is out of range"},
      {"[metrics]\nguest_names = \"yes\"\n",
       "t.toml:2: metrics.guest_names: expected true or false"},
      {"[metrics]\nguest_name = true\n",
       "t.toml:2: unknown key \"guest_name\" in [metrics] (did you mean guest_names?)"},
      {"[backend]\nmin_interval_ms = 5\n", "(it belongs in [metrics])"},
  };
  for (const Bad& b : cases) {
    Config d;
    st = d.load_string(b.text, "t.toml");
    EXPECT_FALSE(st.is_ok()) << b.text;
    EXPECT_NE(st.message().find(b.expect), std::string::npos) << st.message();
    EXPECT_EQ(d.metrics_min_interval_ms, 1000);
  }
}

TEST(ConfigTest, MetricsOnAUnixSocket) {
  Config c;
  EXPECT_EQ(c.metrics_socket_mode, 0600u);
  Status st = c.load_string(
      "[metrics]\nlisten = \"unix:/run/vrdma/metrics.sock\"\nsocket_mode = \"0660\"\n", "t.toml");
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(c.metrics_listen, "unix:/run/vrdma/metrics.sock");
  EXPECT_EQ(c.metrics_socket_mode, 0660u);
  const Bad cases[] = {
      {"[metrics]\nlisten = \"unix:metrics.sock\"\n",
       "t.toml:2: metrics.listen: \"unix:metrics.sock\": unix: needs an absolute path"},
      {"[metrics]\nlisten = \"unix:\"\n", "t.toml:2: metrics.listen: \"unix:\": unix: needs"},
      {"[metrics]\nlisten = \"unix:/run/vrdma/\"\n", "t.toml:2: metrics.listen: "},
      {"[metrics]\nlisten = \"metrics.sock\"\n",
       "t.toml:2: metrics.listen: \"metrics.sock\" is not"},
      {"[metrics]\n\nsocket_mode = \"0777\"\n", "t.toml:3: metrics.socket_mode: expected an octal"},
      {"[metrics]\nsocket_mode = \"0400\"\n", "t.toml:2: metrics.socket_mode: expected an octal"},
      {"[metrics]\nsocket_mode = \"066\"\n", "t.toml:2: metrics.socket_mode: expected an octal"},
      {"[metrics]\nsocket_mode = \"06608\"\n", "t.toml:2: metrics.socket_mode: expected an octal"},
      {"[metrics]\nsocket_mode = 660\n", "t.toml:2: metrics.socket_mode: expected an octal"},
      {"[metrics]\nsocket_mod = \"0600\"\n", "(did you mean socket_mode?)"},
  };
  for (const Bad& b : cases) {
    Config d;
    st = d.load_string(b.text, "t.toml");
    EXPECT_FALSE(st.is_ok()) << b.text;
    EXPECT_NE(st.message().find(b.expect), std::string::npos) << st.message();
    EXPECT_EQ(d.metrics_listen, "127.0.0.1:9464");
    EXPECT_EQ(d.metrics_socket_mode, 0600u);
  }
}

TEST(ConfigTest, DirectoryOnEtcd) {
  Config c;
  EXPECT_TRUE(c.etcd.empty());  // the embedded directory by default
  Status st = c.load_string(R"(
[directory]
etcd = ["http://10.0.0.9:2379", "https://10.0.0.10:2379"]
ca = "/etc/etcd/ca.pem"
prefix = "/lab/"
lease_s = 3
advertise = "10.0.0.1:7471"
)",
                            "t.toml");
  ASSERT_TRUE(st.is_ok()) << st.message();
  EXPECT_EQ(c.etcd.size(), 2u);
  EXPECT_EQ(c.etcd_ca, "/etc/etcd/ca.pem");
  EXPECT_EQ(c.etcd_prefix, "/lab/");
  EXPECT_EQ(c.etcd_lease_s, 3);
  EXPECT_EQ(c.advertise, "10.0.0.1:7471");
  st = c.load_string("[directory]\netcd = [\"10.0.0.9:2379\"]\n", "u.toml");
  EXPECT_NE(st.message().find("is not http://HOST:PORT"), std::string::npos) << st.message();
  st = c.load_string("[directory]\nlease_s = 1\n", "u.toml");
  EXPECT_NE(st.message().find("out of range"), std::string::npos) << st.message();
  EXPECT_EQ(c.etcd_lease_s, 3);  // a rejected file changes nothing
}

TEST(ConfigTest, MissingFile) {
  Config c;
  Status st = c.load_file("/nonexistent/vrdmad.toml");
  EXPECT_EQ(st.err(), ENOENT);
  EXPECT_NE(st.message().find("/nonexistent/vrdmad.toml"), std::string::npos);
}

}  // namespace
}  // namespace vrdma::backend
