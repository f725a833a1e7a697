// The etcd client and the directory on etcd against a real etcd (Debian's etcd-server) that the
// test starts on free loopback ports with its data in a temp dir; skipped when etcd is not
// installed.
#include "directory/etcd.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <thread>

#include "directory/etcd_directory.h"
#include "free_port.h"

namespace vrdma::directory {
namespace {

using namespace std::chrono_literals;

using testing_util::free_port;

/// Whether [::1]:port can be bound now (IPv6 on loopback, and the port free there too).
bool ipv6_port_free(int port) {
  int s = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (s < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  a.sin6_port = htons(static_cast<uint16_t>(port));
  const bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(s);
  return ok;
}

bool until(const std::function<bool()>& f, std::chrono::milliseconds limit = 5000ms) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    if (f()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return f();
}

/// One etcd member on loopback, its data in a temp dir; stopped and removed at the end.
class Etcd {
 public:
  Etcd() {
    char tmpl[] = "/tmp/vrdma-etcd-test-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    client_ = free_port();
    peer_ = free_port();
    ipv6_ = ipv6_port_free(client_);
  }
  ~Etcd() {
    stop();
    std::filesystem::remove_all(dir_);
  }
  static bool installed() { return std::system("command -v etcd >/dev/null 2>&1") == 0; }
  std::string url() const {
    return fmt::format("{}://127.0.0.1:{}", tls_ ? "https" : "http", client_);
  }
  /// The client port on [::1] as well ("" when this host has no IPv6 loopback; not with TLS).
  std::string url6() const { return ipv6_ && !tls_ ? fmt::format("http://[::1]:{}", client_) : ""; }
  const std::string& dir() const { return dir_; }
  /// Serves TLS only, and only to clients with a certificate from its CA: makes (with the
  /// openssl command) DIR/ca.pem, server.{pem,key} for 127.0.0.1, client.{pem,key}. (etcd 3.4's
  /// gateway dials its own port with the server's certificate: that one needs clientAuth too.)
  bool use_tls() {
    const std::string cmd = fmt::format(R"(cd {} && set -e
k() {{ openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout $1.key -out $1.csr \
  -subj /CN=$1 2>/dev/null; }}
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout ca.key -out ca.pem \
  -days 1 -subj /CN=test-etcd-ca 2>/dev/null
k server; k client
printf 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n' >server.ext
printf 'extendedKeyUsage=clientAuth\n' >client.ext
for n in server client; do
  openssl x509 -req -in $n.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out $n.pem -days 1 \
    -extfile $n.ext 2>/dev/null
done)",
                                        dir_);
    const std::string script = dir_ + "/make-certs.sh";
    FILE* f = std::fopen(script.c_str(), "w");
    if (!f) return false;
    std::fputs(cmd.c_str(), f);
    std::fclose(f);
    tls_ = std::system(("bash " + script).c_str()) == 0;
    return tls_;
  }
  /// Starts etcd and waits until it answers. A port free_port() found may be taken by another
  /// program before etcd binds it (tests run in parallel): etcd then exits, and the first start
  /// tries again on new ports; a restart (`started_` set) keeps its ports, as its clients do.
  bool start() {
    for (int attempt = 0; attempt < 5; ++attempt) {
      if (attempt) {
        client_ = free_port();
        do peer_ = free_port();
        while (peer_ == client_);
        ipv6_ = ipv6_port_free(client_);
        std::filesystem::remove_all(dir_ + "/data");  // a member of the old ports, if any
      }
      bool died = false;
      if (start_once(died)) return started_ = true;
      if (!died || started_) break;
    }
    return false;
  }
  bool start_once(bool& died) {
    pid_ = ::fork();
    if (pid_ == 0) {
      const std::string c = url(), p = fmt::format("http://127.0.0.1:{}", peer_);
      const std::string data = dir_ + "/data", log = dir_ + "/log";
      const std::string cluster = "default=" + p;
      FILE* f = std::freopen(log.c_str(), "a", stdout);
      (void)f;
      ::dup2(STDOUT_FILENO, STDERR_FILENO);
      const std::string cert = dir_ + "/server.pem", key = dir_ + "/server.key",
                        ca = dir_ + "/ca.pem";
      if (tls_) {
        ::execlp("etcd", "etcd", "--data-dir", data.c_str(), "--listen-client-urls", c.c_str(),
                 "--advertise-client-urls", c.c_str(), "--listen-peer-urls", p.c_str(),
                 "--initial-advertise-peer-urls", p.c_str(), "--initial-cluster", cluster.c_str(),
                 "--cert-file", cert.c_str(), "--key-file", key.c_str(), "--client-cert-auth",
                 "--trusted-ca-file", ca.c_str(), nullptr);
      }
      const std::string listen = url6().empty() ? c : c + "," + url6();
      ::execlp("etcd", "etcd", "--data-dir", data.c_str(), "--listen-client-urls", listen.c_str(),
               "--advertise-client-urls", c.c_str(), "--listen-peer-urls", p.c_str(),
               "--initial-advertise-peer-urls", p.c_str(), "--initial-cluster", cluster.c_str(),
               nullptr);
      ::_exit(127);
    }
    EtcdClient cl({{url()},
                   tls_ ? dir_ + "/ca.pem" : "",
                   tls_ ? dir_ + "/client.pem" : "",
                   tls_ ? dir_ + "/client.key" : "",
                   500});
    const bool up = until(
        [&] {
          int status;
          if (::waitpid(pid_, &status, WNOHANG) == pid_) {
            pid_ = -1;
            died = true;
            return true;
          }
          return cl.range("/", true, nullptr).is_ok();
        },
        10000ms);
    if (died)
      std::fprintf(stderr, "etcd exited at start (a port taken meanwhile?); its log: %s/log\n",
                   dir_.c_str());
    return up && !died;
  }
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  std::string dir_;
  bool tls_ = false;
  bool ipv6_ = false;
  bool started_ = false;  ///< started once: its ports are what its clients know
  int client_ = 0, peer_ = 0;
  pid_t pid_ = -1;
};

class EtcdTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!Etcd::installed()) return;
    etcd_ = new Etcd();
    if (!etcd_->start()) {
      delete etcd_;
      etcd_ = nullptr;
    }
  }
  static void TearDownTestSuite() {
    delete etcd_;
    etcd_ = nullptr;
  }
  void SetUp() override {
    if (!Etcd::installed()) GTEST_SKIP() << "etcd is not installed (apt-get install etcd-server)";
    ASSERT_NE(etcd_, nullptr) << "etcd did not start";
    prefix_ = fmt::format("/t{}/", next_++);
  }
  EtcdOptions opts() const { return {{etcd_->url()}, {}, {}, {}, 1000}; }
  EtcdDirectory::Options dir_opts(const std::string& node, int port) const {
    EtcdDirectory::Options o;
    o.etcd = opts();
    o.prefix = prefix_;
    o.node = node;
    o.address = fmt::format("127.0.0.1:{}", port);
    o.lease_s = 2;
    o.leave_delay_ms = 0;  // a leave is written at once (the move tests the compare)
    return o;
  }
  static transport::GuestInfo guest(const std::string& name, uint16_t lid) {
    transport::GuestInfo g{name, lid, {}};
    for (size_t i = 0; i < name.size() && i < 16; ++i) g.gid[i] = static_cast<uint8_t>(name[i]);
    g.gid[15] = static_cast<uint8_t>(lid);
    return g;
  }

  static Etcd* etcd_;
  static int next_;
  std::string prefix_;
};
Etcd* EtcdTest::etcd_ = nullptr;
int EtcdTest::next_ = 0;

TEST_F(EtcdTest, PutRangeDeleteAndCreateIfAbsent) {
  EtcdClient c(opts());
  ASSERT_TRUE(c.put(prefix_ + "a", "1").is_ok());
  ASSERT_TRUE(c.put(prefix_ + "b", std::string("\0\xff x", 4)).is_ok());
  int64_t rev = 0;
  auto r = c.range(prefix_, true, &rev);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_EQ(r->size(), 2u);
  EXPECT_EQ((*r)[0].key, prefix_ + "a");
  EXPECT_EQ((*r)[1].value, std::string("\0\xff x", 4));  // bytes survive the base64
  EXPECT_GT(rev, 0);
  // Create-if-absent: the first wins, the second sees who holds it.
  const Compare absent{prefix_ + "lid", Compare::Target::kCreate, 0, {}};
  auto t1 = c.txn({absent}, {{Op::Kind::kPut, prefix_ + "lid", "x", 0}},
                  {{Op::Kind::kGet, prefix_ + "lid", {}, 0}});
  ASSERT_TRUE(t1.is_ok()) << t1.status().message();
  EXPECT_TRUE(t1->succeeded);
  auto t2 = c.txn({absent}, {{Op::Kind::kPut, prefix_ + "lid", "y", 0}},
                  {{Op::Kind::kGet, prefix_ + "lid", {}, 0}});
  ASSERT_TRUE(t2.is_ok());
  EXPECT_FALSE(t2->succeeded);
  ASSERT_EQ(t2->kvs.size(), 1u);
  EXPECT_EQ(t2->kvs[0].value, "x");
  // Compare-and-swap on the value.
  auto t3 = c.txn({{prefix_ + "lid", Compare::Target::kValue, 0, "x"}},
                  {{Op::Kind::kPut, prefix_ + "lid", "z", 0}}, {});
  ASSERT_TRUE(t3.is_ok());
  EXPECT_TRUE(t3->succeeded);
  ASSERT_TRUE(c.del(prefix_ + "a").is_ok());
  r = c.range(prefix_, true, nullptr);
  ASSERT_TRUE(r.is_ok());
  EXPECT_EQ(r->size(), 2u);  // b and lid
}

TEST_F(EtcdTest, LeaseKeepsAndRevokeRemoves) {
  EtcdClient c(opts());
  auto lease = c.lease_grant(5);
  ASSERT_TRUE(lease.is_ok()) << lease.status().message();
  ASSERT_TRUE(c.put(prefix_ + "n", "v", *lease).is_ok());
  auto ttl = c.lease_keepalive(*lease);
  ASSERT_TRUE(ttl.is_ok()) << ttl.status().message();
  EXPECT_EQ(*ttl, 5);
  auto left = c.lease_ttl(*lease);
  ASSERT_TRUE(left.is_ok());
  EXPECT_LE(*left, 5);
  auto r = c.range(prefix_ + "n", false, nullptr);
  ASSERT_EQ(r->size(), 1u);
  EXPECT_EQ((*r)[0].lease, *lease);
  ASSERT_TRUE(c.lease_revoke(*lease).is_ok());
  EXPECT_TRUE(c.range(prefix_ + "n", false, nullptr)->empty());
  EXPECT_EQ(c.lease_keepalive(*lease).err(), ENOENT);
}

TEST_F(EtcdTest, WatchSeesPutsAndDeletesInOrder) {
  EtcdClient w(opts()), c(opts());
  std::atomic<bool> stop{false};
  std::mutex mu;
  std::vector<WatchEvent> seen;
  int64_t rev = 0;
  ASSERT_TRUE(c.range(prefix_, true, &rev).is_ok());
  std::thread t([&] {
    Status st = w.watch(
        prefix_, rev + 1,
        [&](const std::vector<WatchEvent>& evs) {
          std::lock_guard<std::mutex> l(mu);
          seen.insert(seen.end(), evs.begin(), evs.end());
          return true;
        },
        stop);
    EXPECT_TRUE(st.is_ok()) << st.message();
  });
  ASSERT_TRUE(c.put(prefix_ + "k1", "a").is_ok());
  ASSERT_TRUE(c.put("/elsewhere", "b").is_ok());  // not under the prefix
  ASSERT_TRUE(c.del(prefix_ + "k1").is_ok());
  EXPECT_TRUE(until([&] {
    std::lock_guard<std::mutex> l(mu);
    return seen.size() >= 2;
  }));
  stop = true;
  t.join();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_FALSE(seen[0].deleted);
  EXPECT_EQ(seen[0].kv.value, "a");
  EXPECT_TRUE(seen[1].deleted);
  EXPECT_EQ(seen[1].kv.key, prefix_ + "k1");
}

TEST_F(EtcdTest, UnreachableFailsFastAndFailsOver) {
  const std::string dead = fmt::format("http://127.0.0.1:{}", free_port());
  EtcdClient c({{dead}, {}, {}, {}, 500});
  EXPECT_EQ(c.last_heard().at, std::chrono::steady_clock::time_point{});
  const auto t0 = std::chrono::steady_clock::now();
  auto r = c.range("/", true, nullptr);
  EXPECT_EQ(r.err(), EHOSTUNREACH);
  EXPECT_NE(r.status().message().find("unreachable"), std::string::npos) << r.status().message();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  // What the call learnt, stamped when it ended (the directory orders its threads' news by it).
  EXPECT_FALSE(c.last_heard().answered);
  EXPECT_GE(c.last_heard().at, t0);
  EXPECT_EQ(c.last_heard().why, r.status().message());
  // The next endpoint answers: the call succeeds, and later calls start there.
  EtcdClient two({{dead, etcd_->url()}, {}, {}, {}, 500});
  ASSERT_TRUE(two.put(prefix_ + "x", "1").is_ok());
  EXPECT_EQ(two.endpoint(), etcd_->url());
  EXPECT_TRUE(two.last_heard().answered);
  EXPECT_GT(two.last_heard().at, c.last_heard().at);
  // A refusal is an answer too: etcd is there.
  EXPECT_EQ(two.lease_keepalive(0x7fff1234).err(), ENOENT);
  EXPECT_TRUE(two.last_heard().answered);
}

TEST_F(EtcdTest, DirectoryFindsPeersGuestsAndMoves) {
  auto a = EtcdDirectory::start(dir_opts("a", 1001));
  auto b = EtcdDirectory::start(dir_opts("b", 1002));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  std::vector<EtcdDirectory::Change> at_b;
  auto drain = [&] {
    (*b)->poll([&](const EtcdDirectory::Change& c) { at_b.push_back(c); });
    return true;
  };
  auto saw = [&](EtcdDirectory::Change::Kind k, const std::string& node) {
    drain();
    for (const auto& c : at_b)
      if (c.kind == k && c.node == node) return true;
    return false;
  };
  ASSERT_TRUE(until([&] { return saw(EtcdDirectory::Change::Kind::kPeerUp, "a"); }));
  for (const auto& c : at_b) {
    if (c.kind == EtcdDirectory::Change::Kind::kPeerUp) {
      EXPECT_EQ(c.address, "127.0.0.1:1001");
    }
  }
  // A guest of a: b finds it by LID and GID; a does not list its own.
  const auto g = guest("g1", 0x101);
  (*a)->announce(g, true);
  ASSERT_TRUE(until([&] { return (*b)->locate_lid(0x101) == "a"; }));
  EXPECT_EQ((*b)->locate_gid(g.gid), "a");
  EXPECT_EQ((*a)->locate_lid(0x101), "");
  // Another guest with that LID is refused (the LID is a's guest's) and not published.
  const auto clash = guest("g2", 0x101);
  (*b)->announce(clash, true);
  ASSERT_TRUE(until([&] { return (*b)->status_json()["counters"]["lid_conflicts"] == 1; }));
  EXPECT_EQ((*a)->locate_gid(clash.gid), "");
  // g1 moves to b: compare-and-swap of its entry; a's late "down" does not remove b's entry.
  at_b.clear();
  (*b)->announce(g, true);
  ASSERT_TRUE(until([&] { return (*a)->locate_lid(0x101) == "b"; }));
  (*a)->announce(g, false);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ((*a)->locate_lid(0x101), "b");
  EXPECT_EQ((*a)->locate_gid(g.gid), "b");
  const auto js = (*a)->status_json();
  for (const auto& n : js["nodes"]) {
    if (n["node"] == "b") {
      ASSERT_EQ(n["guests"].size(), 1u);
      EXPECT_EQ(n["guests"][0]["generation"], 2);
    }
  }
  EXPECT_EQ((*b)->status_json()["counters"]["moves_here"], 1);
  EXPECT_GT((*b)->status_json()["counters"]["requests"], 5);
  EXPECT_EQ((*b)->status_json()["counters"]["failures"], 0);
  // a stops cleanly: its lease is revoked, b hears it left at once.
  at_b.clear();
  a->reset();
  EXPECT_TRUE(until([&] { return saw(EtcdDirectory::Change::Kind::kPeerDown, "a"); }, 1500ms));
}

// Over IPv6: etcd reached at http://[::1]:PORT, a node advertising "[ADDR]:PORT". Each node's
// QP count reaches the others with its keepalive; its lease TTL and the watch lag are reported.
TEST_F(EtcdTest, Ipv6QpCountsLeaseTtlAndWatchLag) {
  if (etcd_->url6().empty()) GTEST_SKIP() << "no IPv6 on loopback";
  auto oa = dir_opts("a", 1001);
  oa.etcd.endpoints = {etcd_->url6()};
  oa.address = "[fd00::1]:1001";
  auto a = EtcdDirectory::start(oa);
  auto b = EtcdDirectory::start(dir_opts("b", 1002));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  std::vector<EtcdDirectory::Change> at_b;
  ASSERT_TRUE(until([&] {
    (*b)->poll([&](const EtcdDirectory::Change& c) { at_b.push_back(c); });
    return !at_b.empty();
  }));
  EXPECT_EQ(at_b[0].kind, EtcdDirectory::Change::Kind::kPeerUp);
  EXPECT_EQ(at_b[0].address, "[fd00::1]:1001");
  EXPECT_EQ((*a)->status_json()["endpoint"], etcd_->url6());
  (*a)->set_qps(7);
  auto node_a = [&] {
    const nlohmann::json js = (*b)->status_json();
    for (const auto& n : js["nodes"])
      if (n["node"] == "a") return n;
    return nlohmann::json::object();
  };
  // The count goes with a keepalive (every third of the 2 s lease); the TTL is asked then too.
  ASSERT_TRUE(until([&] { return node_a().value("qps", 0) == 7; }, 3000ms)) << node_a();
  ASSERT_TRUE(until([&] { return node_a().value("lease_ttl_s", 0) > 0; }, 3000ms)) << node_a();
  const auto js = (*a)->status_json();
  ASSERT_TRUE(js.contains("watch_lag_ms")) << js;
  EXPECT_GE(js["watch_lag_ms"], 0);
  EXPECT_LT(js["watch_lag_ms"], 2000);
  // The rewrite is not a new peer: b hears nothing more of a.
  at_b.clear();
  (*b)->poll([&](const EtcdDirectory::Change& c) { at_b.push_back(c); });
  EXPECT_TRUE(at_b.empty());
}

// A guest that leaves is deleted from etcd only after leave_delay_ms: one back by then keeps its
// entry (its peers never see it vanish), one that stays away goes.
TEST_F(EtcdTest, LeavesAreWrittenAfterTheirDelay) {
  auto o = dir_opts("a", 1001);
  o.leave_delay_ms = 300;
  auto a = EtcdDirectory::start(o);
  auto b = EtcdDirectory::start(dir_opts("b", 1002));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  const auto g = guest("g1", 0x201);
  (*a)->announce(g, true);
  ASSERT_TRUE(until([&] { return (*b)->locate_lid(0x201) == "a"; }));
  (*a)->announce(g, false);
  (*a)->announce(g, true);  // back at once: nothing is deleted
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ((*b)->locate_lid(0x201), "a");
  (*a)->announce(g, false);
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ((*b)->locate_lid(0x201), "a");  // not yet
  EXPECT_TRUE(until([&] { return (*b)->locate_lid(0x201).empty(); }, 2000ms));
  EXPECT_EQ((*b)->locate_gid(g.gid), "");
}

// A lease that ended while the backend lives (revoked here; etcd away longer than the lease does
// the same): its keepalive hears so, and it registers again with its guests.
TEST_F(EtcdTest, LostLeaseRegistersAgain) {
  auto a = EtcdDirectory::start(dir_opts("a", 1001));
  auto b = EtcdDirectory::start(dir_opts("b", 1002));
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  (*a)->announce(guest("g1", 0x301), true);
  ASSERT_TRUE(until([&] { return (*b)->locate_lid(0x301) == "a"; }));
  const std::string id = (*a)->status_json()["lease_id"];
  EtcdClient c(opts());
  ASSERT_TRUE(c.lease_revoke(static_cast<int64_t>(std::stoull(id, nullptr, 16))).is_ok());
  EXPECT_TRUE(until([&] { return (*b)->locate_lid(0x301).empty(); }, 2000ms));
  EXPECT_TRUE(until([&] { return (*a)->status_json()["counters"]["registrations"] == 2; }));
  EXPECT_TRUE(until([&] { return (*b)->locate_lid(0x301) == "a"; }));
}

TEST_F(EtcdTest, DeadBackendVanishesWithItsLease) {
  EtcdClient c(opts());
  // A backend that died: its node entry under a lease nobody keeps alive.
  auto lease = c.lease_grant(2);
  ASSERT_TRUE(lease.is_ok());
  ASSERT_TRUE(c.put(prefix_ + "nodes/dead",
                    R"({"node":"dead","address":"127.0.0.1:9","registered_unix":1})", *lease)
                  .is_ok());
  auto b = EtcdDirectory::start(dir_opts("b", 1002));
  ASSERT_TRUE(b.is_ok());
  bool up = false, down = false;
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(until(
      [&] {
        (*b)->poll([&](const EtcdDirectory::Change& ch) {
          up |= ch.kind == EtcdDirectory::Change::Kind::kPeerUp && ch.node == "dead";
          down |= ch.kind == EtcdDirectory::Change::Kind::kPeerDown && ch.node == "dead";
        });
        return up && down;
      },
      6000ms));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 4s);
}

// TLS with client certificates: the client's CA, certificate and key reach curl; without the
// certificate etcd refuses the handshake, and that is an error, not a hang.
TEST(EtcdTlsTest, ClientCertificateIsPresentedAndRequired) {
  if (!Etcd::installed()) GTEST_SKIP() << "etcd is not installed (apt-get install etcd-server)";
  Etcd etcd;
  ASSERT_TRUE(etcd.use_tls()) << "openssl could not make the test credentials";
  ASSERT_TRUE(etcd.start());
  const std::string d = etcd.dir();
  EtcdClient c({{etcd.url()}, d + "/ca.pem", d + "/client.pem", d + "/client.key", 1000});
  ASSERT_TRUE(c.put("/tls/k", "v").is_ok());
  auto r = c.range("/tls/", true, nullptr);
  ASSERT_TRUE(r.is_ok()) << r.status().message();
  ASSERT_EQ(r->size(), 1u);
  EtcdClient anonymous({{etcd.url()}, d + "/ca.pem", {}, {}, 1000});
  EXPECT_FALSE(anonymous.range("/tls/", true, nullptr).is_ok());
  EtcdClient untrusting({{etcd.url()}, {}, d + "/client.pem", d + "/client.key", 1000});
  EXPECT_FALSE(untrusting.range("/tls/", true, nullptr).is_ok());  // not the system's CAs
}

// etcd goes away and comes back: what the copy knew still answers, the backend registers again.
TEST(EtcdRestartTest, DirectoryRegistersAgainWhenEtcdReturns) {
  if (!Etcd::installed()) GTEST_SKIP() << "etcd is not installed (apt-get install etcd-server)";
  Etcd etcd;
  ASSERT_TRUE(etcd.start());
  EtcdDirectory::Options oa;
  oa.etcd = {{etcd.url()}, {}, {}, {}, 500};
  oa.node = "a";
  oa.address = "127.0.0.1:1001";
  oa.lease_s = 2;
  auto ob = oa;
  ob.node = "b";
  auto a = EtcdDirectory::start(oa);
  auto b = EtcdDirectory::start(ob);
  ASSERT_TRUE(a.is_ok() && b.is_ok());
  (*a)->announce({"ga", 0x55, {1}}, true);
  ASSERT_TRUE(until([&] { return (*b)->locate_lid(0x55) == "a"; }));
  etcd.stop();
  ASSERT_TRUE(until([&] { return !(*a)->reachable() && !(*b)->reachable(); }));
  EXPECT_EQ((*b)->locate_lid(0x55), "a");  // existing routes stay
  EXPECT_EQ((*b)->locate_lid(0x56), "");   // nothing new is made up
  EXPECT_EQ((*b)->status_json()["reachable"], false);
  EXPECT_NE((*b)->unavailable().find("unreachable"), std::string::npos) << (*b)->unavailable();
  std::this_thread::sleep_for(2500ms);  // longer than the lease
  ASSERT_TRUE(etcd.start());
  EXPECT_TRUE(until([&] { return (*a)->reachable() && (*a)->registered(); }, 10000ms));
  EXPECT_TRUE(until([&] { return (*b)->unavailable().empty(); }));
  EXPECT_TRUE(until([&] { return (*b)->locate_lid(0x55) == "a"; }, 10000ms));
  EtcdClient c({{etcd.url()}, {}, {}, {}, 500});
  EXPECT_TRUE(until([&] { return c.range("/vrdma/guests/ga", false, nullptr)->size() == 1; }));
}

}  // namespace
}  // namespace vrdma::directory
