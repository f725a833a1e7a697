// A network impairer for the impaired hosts tests (tests/hosts/impair_lib.sh): an L2 forwarder
// between two interfaces with netem's semantics, since the test machines' kernel has no netem.
// Every frame that one interface receives leaves by the other, after the impairments of its
// direction: loss, duplication, corruption (one bit flipped past the IP header, so TCP's checksum
// catches it), a rate (a serialising link), a delay with jitter, reordering (a share of the
// frames skips the delay) and a link that is down (everything dropped, queued frames included).
//
//   impair --a IF --b IF [--delay MS] [--jitter MS] [--normal] [--loss %] [--dup %]
//          [--corrupt %] [--reorder %] [--rate MBIT] [--limit-mb MB] [--seed N] [--control FIFO]
//   impair --offloads-off IF...   (clears TX checksum, TSO, GSO and GRO of IF, then exits)
// Each impairment takes X (both directions) or X/Y (a->b, then b->a).
// Control: SIGUSR1 toggles the link, SIGUSR2 prints the counters; the FIFO takes lines "down",
// "up", "status" and "set OPTIONS" (the impairments anew, as on the command line: what the line
// does not name is zero). SIGTERM/SIGINT print the counters and exit.
// Frames are MTU-sized only if the senders' offloads are off (--offloads-off in their
// namespaces): a packet socket neither segments nor checksums what it forwards.
// Single thread: epoll over both packet sockets, a timerfd armed for the earliest due frame, a
// signalfd and the FIFO. Each direction's queue is a heap by due time, bounded in bytes.
#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/ethtool.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/sockios.h>
#include <net/if.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <queue>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr size_t kBatch = 64;        ///< frames per recvmmsg/sendmmsg
constexpr size_t kFrameMax = 65536;  ///< receive buffer per frame (any MTU a veth takes)
constexpr size_t kEthHeader = 14;

int64_t now_ns() {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

/// Wall-clock "HH:MM:SS.mmm (EPOCH.uuuuuu)" for the log lines the tests read times from.
std::string wall_time() {
  timespec ts;
  ::clock_gettime(CLOCK_REALTIME, &ts);
  tm t;
  ::localtime_r(&ts.tv_sec, &t);
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%02d:%02d:%02d.%03ld (%ld.%06ld)", t.tm_hour, t.tm_min, t.tm_sec,
                ts.tv_nsec / 1000000, static_cast<long>(ts.tv_sec), ts.tv_nsec / 1000);
  return buf;
}

void say(const std::string& line) {
  std::fprintf(stderr, "impair %s: %s\n", wall_time().c_str(), line.c_str());
  std::fflush(stderr);
}

[[noreturn]] void die(const std::string& why) {
  std::fprintf(stderr, "impair: %s\n", why.c_str());
  std::exit(2);
}

/// The impairments of one direction.
struct Params {
  double delay_ms = 0, jitter_ms = 0, loss = 0, dup = 0, corrupt = 0, reorder = 0, rate_mbit = 0;
  bool normal = false;  ///< jitter from a normal distribution (sigma = jitter) instead of uniform
  /// Frames need the queue (they wait for a time) rather than leaving at once.
  bool timed() const { return delay_ms > 0 || jitter_ms > 0 || rate_mbit > 0; }
};

/// The options as typed: "X" or "X/Y".
struct RawParams {
  std::string delay = "0", jitter = "0", loss = "0", dup = "0", corrupt = "0", reorder = "0",
              rate = "0";
  bool normal = false;
};

void add_param_options(CLI::App& app, RawParams& r) {
  app.add_option("--delay", r.delay, "one-way delay, ms");
  app.add_option("--jitter", r.jitter, "delay jitter, ms (uniform +-, or sigma with --normal)");
  app.add_flag("--normal", r.normal, "normal instead of uniform jitter");
  app.add_option("--loss", r.loss, "frames dropped, %");
  app.add_option("--dup", r.dup, "frames sent twice, %");
  app.add_option("--corrupt", r.corrupt, "frames with one bit flipped past the IP header, %");
  app.add_option("--reorder", r.reorder, "frames sent at once while the others wait, %");
  app.add_option("--rate", r.rate, "link rate, Mbit/s (0: unlimited)");
}

/// "X" -> {X, X}; "X/Y" -> {X, Y}.
std::pair<double, double> split_knob(const std::string& name, const std::string& v) {
  try {
    const auto slash = v.find('/');
    if (slash == std::string::npos) return {std::stod(v), std::stod(v)};
    return {std::stod(v.substr(0, slash)), std::stod(v.substr(slash + 1))};
  } catch (const std::exception&) {
    throw CLI::ValidationError(name, "'" + v + "' is not X or X/Y");
  }
}

std::pair<Params, Params> to_params(const RawParams& r) {
  Params ab, ba;
  const std::pair<const char*, std::pair<const std::string*, double Params::*>> knobs[] = {
      {"--delay", {&r.delay, &Params::delay_ms}},    {"--jitter", {&r.jitter, &Params::jitter_ms}},
      {"--loss", {&r.loss, &Params::loss}},          {"--dup", {&r.dup, &Params::dup}},
      {"--corrupt", {&r.corrupt, &Params::corrupt}}, {"--reorder", {&r.reorder, &Params::reorder}},
      {"--rate", {&r.rate, &Params::rate_mbit}}};
  for (const auto& [name, k] : knobs) {
    const auto [x, y] = split_knob(name, *k.first);
    if (x < 0 || y < 0) throw CLI::ValidationError(name, "negative");
    ab.*k.second = x;
    ba.*k.second = y;
  }
  ab.normal = ba.normal = r.normal;
  return {ab, ba};
}

std::string describe(const Params& p) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "delay %.1f ms jitter %.1f ms%s loss %.2f%% dup %.2f%% corrupt %.2f%% reorder "
                "%.2f%% rate %s",
                p.delay_ms, p.jitter_ms, p.normal ? " (normal)" : "", p.loss, p.dup, p.corrupt,
                p.reorder,
                p.rate_mbit > 0 ? (std::to_string(p.rate_mbit) + " Mbit/s").c_str() : "unlimited");
  return buf;
}

struct Frame {
  int64_t due;
  uint64_t seq;  ///< ties keep arrival order
  std::vector<uint8_t> bytes;
};
struct Later {
  bool operator()(const Frame& x, const Frame& y) const {
    return x.due != y.due ? x.due > y.due : x.seq > y.seq;
  }
};

struct Stats {
  uint64_t rx = 0, fwd = 0, fwd_bytes = 0, lost = 0, down = 0, qfull = 0, dup = 0, corrupt = 0,
           reorder = 0, txerr = 0, kdrop = 0;
  /// TCP payload bytes received, and of those dropped here or corrupted (what the senders' TCP
  /// must send again): the tests tell a sender's own repeats from the network's with them.
  uint64_t payload = 0, payload_spoilt = 0;
  int last_errno = 0;
};

/// Frames handed to sendmmsg together: pointers into the receive buffers (frames that leave at
/// once) or into `owned` (frames taken off the queue).
struct TxBatch {
  std::vector<iovec> iov;
  std::vector<std::vector<uint8_t>> owned;
  void add(uint8_t* p, size_t n) { iov.push_back({p, n}); }
  void add(std::vector<uint8_t>&& f) {
    owned.push_back(std::move(f));
    iov.push_back({owned.back().data(), owned.back().size()});
  }
};

struct Direction {
  std::string name;
  int in = -1, out = -1;
  Params p;
  std::priority_queue<Frame, std::vector<Frame>, Later> q;
  size_t queued_bytes = 0;
  int64_t link_free = 0;  ///< when the rate-limited link has sent what it was given
  Stats s;
  TxBatch tx;
};

class Impairer {
 public:
  Impairer(uint64_t seed, size_t limit_bytes) : rng_(seed), limit_(limit_bytes) {}

  Direction ab, ba;
  bool down = false;

  /// Receives what is waiting on d.in (up to a few batches), impairs and queues or sends it.
  void receive(Direction& d) {
    for (int round = 0; round < 4; ++round) {
      mmsghdr msgs[kBatch];
      iovec iov[kBatch];
      sockaddr_ll from[kBatch];
      for (size_t k = 0; k < kBatch; ++k) {
        iov[k] = {rxbuf_[k].data(), kFrameMax};
        msgs[k] = {};
        msgs[k].msg_hdr.msg_iov = &iov[k];
        msgs[k].msg_hdr.msg_iovlen = 1;
        msgs[k].msg_hdr.msg_name = &from[k];
        msgs[k].msg_hdr.msg_namelen = sizeof(from[k]);
      }
      const int got = ::recvmmsg(d.in, msgs, kBatch, MSG_DONTWAIT, nullptr);
      if (got <= 0) {
        if (got < 0 && errno != EAGAIN && errno != EINTR) die("recvmmsg: " + errno_str());
        break;
      }
      const int64_t now = now_ns();
      for (int k = 0; k < got; ++k) {
        if (from[k].sll_pkttype == PACKET_OUTGOING) continue;  // ours, sent on this interface
        ingress(d, rxbuf_[k].data(), msgs[k].msg_len, now);
      }
      flush(d, now);
      if (static_cast<size_t>(got) < kBatch) break;
    }
  }

  /// Sends every frame that is due, in both directions; returns the earliest due time left.
  std::optional<int64_t> run_due() {
    const int64_t now = now_ns();
    flush(ab, now);
    flush(ba, now);
    std::optional<int64_t> next;
    for (Direction* d : {&ab, &ba})
      if (!d->q.empty()) next = std::min(next.value_or(INT64_MAX), d->q.top().due);
    return next;
  }

  void print_stats(const char* why) {
    for (Direction* d : {&ab, &ba}) {
      tpacket_stats ks{};
      socklen_t len = sizeof(ks);
      if (::getsockopt(d->in, SOL_PACKET, PACKET_STATISTICS, &ks, &len) == 0)
        d->s.kdrop += ks.tp_drops;
      const Stats& s = d->s;
      char buf[512];
      std::snprintf(buf, sizeof(buf),
                    "%s %s: rx %lu fwd %lu (%lu bytes) lost %lu down %lu qfull %lu dup %lu "
                    "corrupt %lu reorder %lu txerr %lu%s%s kdrop %lu queued %zu (%zu bytes) "
                    "payload %lu spoilt %lu",
                    why, d->name.c_str(), s.rx, s.fwd, s.fwd_bytes, s.lost, s.down, s.qfull, s.dup,
                    s.corrupt, s.reorder, s.txerr, s.last_errno ? " last " : "",
                    s.last_errno ? std::strerror(s.last_errno) : "", s.kdrop, d->q.size(),
                    d->queued_bytes, s.payload, s.payload_spoilt);
      say(buf);
    }
  }

  void set_down(bool v) {
    if (v == down) return;
    down = v;
    say(v ? "link down" : "link up");
    if (!v) return;
    for (Direction* d : {&ab, &ba}) {  // what was on the wire is lost
      for (; !d->q.empty(); d->q.pop()) {
        ++d->s.down;
        d->s.payload_spoilt += tcp_payload(d->q.top().bytes.data(), d->q.top().bytes.size());
      }
      d->queued_bytes = 0;
      d->link_free = 0;
    }
  }

 private:
  static std::string errno_str() { return std::strerror(errno); }

  bool chance(double percent) { return percent > 0 && pct_(rng_) < percent; }

  int64_t delay_sample(const Params& p) {
    double ms = p.delay_ms;
    if (p.jitter_ms > 0) {
      if (p.normal)
        ms = std::normal_distribution<double>(p.delay_ms, p.jitter_ms)(rng_);
      else
        ms = std::uniform_real_distribution<double>(p.delay_ms - p.jitter_ms,
                                                    p.delay_ms + p.jitter_ms)(rng_);
    }
    return static_cast<int64_t>(std::max(0.0, ms) * 1e6);
  }

  /// TCP payload bytes of an IPv4 frame (0 for anything else).
  static size_t tcp_payload(const uint8_t* f, size_t n) {
    if (n < kEthHeader + 20 || f[12] != 0x08 || f[13] != 0x00 || f[kEthHeader + 9] != 6) return 0;
    const size_t ihl = size_t{f[kEthHeader] & 0x0fu} * 4;
    if (n < kEthHeader + ihl + 20) return 0;
    const size_t total = size_t{f[kEthHeader + 2]} << 8 | f[kEthHeader + 3];
    const size_t doff = size_t{f[kEthHeader + ihl + 12]} >> 4 << 2;
    return total > ihl + doff ? total - ihl - doff : 0;
  }

  /// Flips one random bit past the Ethernet and IP headers (so TCP's or UDP's checksum covers
  /// it); false for a frame with nothing past them.
  bool corrupt(uint8_t* f, size_t n) {
    if (n <= kEthHeader) return false;
    uint16_t type;
    std::memcpy(&type, f + 12, 2);
    size_t start = kEthHeader;
    if (type == htons(ETH_P_IP))
      start += size_t{f[kEthHeader] & 0x0fu} * 4;
    else if (type == htons(ETH_P_IPV6))
      start += 40;
    if (n <= start) return false;
    const size_t bit = std::uniform_int_distribution<size_t>(0, (n - start) * 8 - 1)(rng_);
    f[start + bit / 8] ^= static_cast<uint8_t>(1u << (bit % 8));
    return true;
  }

  /// One received frame (the receive buffer's bytes, which `corrupt` may change).
  void ingress(Direction& d, uint8_t* f, size_t n, int64_t now) {
    ++d.s.rx;
    const size_t payload = tcp_payload(f, n);
    d.s.payload += payload;
    if (down) {
      ++d.s.down;
      d.s.payload_spoilt += payload;
      return;
    }
    if (chance(d.p.loss)) {
      ++d.s.lost;
      d.s.payload_spoilt += payload;
      return;
    }
    const int copies = chance(d.p.dup) ? 2 : 1;
    if (copies == 2) ++d.s.dup;
    int good = 0;  // copies that leave intact
    for (int c = 0; c < copies; ++c) {
      const bool bad = chance(d.p.corrupt);
      if (!d.p.timed() && d.q.empty()) {  // leaves at once
        if (c == 0) {                     // from the receive buffer
          if (copies == 2) d.tx.add(std::vector<uint8_t>(f, f + n));  // the duplicate, clean
          if (bad && corrupt(f, n)) ++d.s.corrupt; else ++good;
          d.tx.add(f, n);
        } else if (bad && corrupt(d.tx.owned.back().data(), n)) {
          ++d.s.corrupt;
        } else {
          ++good;
        }
        continue;
      }
      if (d.queued_bytes + n > limit_) {
        ++d.s.qfull;
        continue;
      }
      int64_t t = now;
      if (d.p.rate_mbit > 0) {
        d.link_free = std::max(now, d.link_free) +
                      static_cast<int64_t>(static_cast<double>(n) * 8000.0 / d.p.rate_mbit);
        t = d.link_free;
      }
      if (chance(d.p.reorder))
        ++d.s.reorder;
      else
        t += delay_sample(d.p);
      Frame fr{t, seq_++, std::vector<uint8_t>(f, f + n)};
      if (bad && corrupt(fr.bytes.data(), n)) ++d.s.corrupt; else ++good;
      d.queued_bytes += n;
      d.q.push(std::move(fr));
    }
    if (good == 0) d.s.payload_spoilt += payload;
  }

  /// Moves d's due frames into its batch and sends the batch.
  void flush(Direction& d, int64_t now) {
    while (!d.q.empty() && d.q.top().due <= now) {
      // priority_queue::top is const: the frame is moved out through a cast, then popped.
      Frame& fr = const_cast<Frame&>(d.q.top());
      d.queued_bytes -= fr.bytes.size();
      if (down) {
        ++d.s.down;
        d.s.payload_spoilt += tcp_payload(fr.bytes.data(), fr.bytes.size());
      } else
        d.tx.add(std::move(fr.bytes));
      d.q.pop();
    }
    send(d);
  }

  void send(Direction& d) {
    std::vector<iovec>& iov = d.tx.iov;
    for (size_t at = 0; at < iov.size();) {
      const size_t n = std::min(kBatch, iov.size() - at);
      mmsghdr msgs[kBatch];
      for (size_t k = 0; k < n; ++k) {
        msgs[k] = {};
        msgs[k].msg_hdr.msg_iov = &iov[at + k];
        msgs[k].msg_hdr.msg_iovlen = 1;
      }
      const int sent = ::sendmmsg(d.out, msgs, static_cast<unsigned>(n), MSG_DONTWAIT);
      if (sent < 0 && errno == EINTR) continue;
      if (sent <= 0) {  // the frame at `at` failed: counted, dropped, the rest go on
        ++d.s.txerr;
        d.s.last_errno = errno;
        ++at;
        continue;
      }
      for (int k = 0; k < sent; ++k) {
        ++d.s.fwd;
        d.s.fwd_bytes += iov[at + static_cast<size_t>(k)].iov_len;
      }
      at += static_cast<size_t>(sent);
    }
    iov.clear();
    d.tx.owned.clear();
  }

  std::mt19937_64 rng_;
  std::uniform_real_distribution<double> pct_{0.0, 100.0};
  size_t limit_;
  uint64_t seq_ = 0;
  std::vector<std::vector<uint8_t>> rxbuf_ =
      std::vector<std::vector<uint8_t>>(kBatch, std::vector<uint8_t>(kFrameMax));
};

/// A packet socket that receives everything IF receives (not what is sent on it) and sends on
/// IF, non-blocking, with large buffers.
int open_packet_socket(const std::string& ifname) {
  const unsigned idx = ::if_nametoindex(ifname.c_str());
  if (idx == 0) die("no interface " + ifname);
  const int fd = ::socket(AF_PACKET, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, htons(ETH_P_ALL));
  if (fd < 0) die("socket(AF_PACKET): " + std::string(std::strerror(errno)));
  const int one = 1, buf = 32 << 20;
  if (::setsockopt(fd, SOL_PACKET, PACKET_IGNORE_OUTGOING, &one, sizeof(one)))
    say("PACKET_IGNORE_OUTGOING unsupported: outgoing frames are skipped by type");
  ::setsockopt(fd, SOL_PACKET, PACKET_QDISC_BYPASS, &one, sizeof(one));
  // FORCE lifts the sysctl caps (we run as root); the plain ones are the fallback.
  if (::setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &buf, sizeof(buf)))
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
  if (::setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &buf, sizeof(buf)))
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
  sockaddr_ll sll{};
  sll.sll_family = AF_PACKET;
  sll.sll_protocol = htons(ETH_P_ALL);
  sll.sll_ifindex = static_cast<int>(idx);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sll), sizeof(sll)))
    die("bind to " + ifname + ": " + std::strerror(errno));
  // Promiscuous: frames for the hosts' MACs, not this interface's, are the traffic.
  packet_mreq mr{};
  mr.mr_ifindex = static_cast<int>(idx);
  mr.mr_type = PACKET_MR_PROMISC;
  if (::setsockopt(fd, SOL_PACKET, PACKET_ADD_MEMBERSHIP, &mr, sizeof(mr)))
    die("promiscuous " + ifname + ": " + std::strerror(errno));
  // Whatever arrived before the bind (from any interface) is dropped.
  uint8_t junk[kEthHeader];
  while (::recv(fd, junk, sizeof(junk), MSG_DONTWAIT | MSG_TRUNC) >= 0) {
  }
  return fd;
}

/// The legacy ethtool ioctls (no ethtool binary on the test machines): TX checksumming, TSO,
/// GSO and GRO off, so the interface sends MTU-sized frames with their checksums filled in.
void offloads_off(const std::string& ifname) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) die("socket: " + std::string(std::strerror(errno)));
  for (const uint32_t cmd : {ETHTOOL_STSO, ETHTOOL_SGSO, ETHTOOL_SGRO, ETHTOOL_STXCSUM}) {
    ethtool_value v{cmd, 0};
    ifreq ifr{};
    std::snprintf(ifr.ifr_name, IFNAMSIZ, "%s", ifname.c_str());
    ifr.ifr_data = reinterpret_cast<char*>(&v);
    if (::ioctl(fd, SIOCETHTOOL, &ifr) && errno != EOPNOTSUPP)
      die("SIOCETHTOOL " + std::to_string(cmd) + " on " + ifname + ": " + std::strerror(errno));
  }
  ::close(fd);
}

/// Parses "set OPTIONS" from the control FIFO; nullopt (and a log line) when malformed.
std::optional<std::pair<Params, Params>> parse_set(const std::string& args) {
  CLI::App app{"set"};
  RawParams raw;
  add_param_options(app, raw);
  try {
    app.parse(args, false);
    return to_params(raw);
  } catch (const CLI::Error& e) {
    say("control: bad 'set " + args + "': " + e.what());
    return std::nullopt;
  }
}

void arm(int tfd, std::optional<int64_t> due) {
  itimerspec its{};
  if (due) {
    its.it_value.tv_sec = *due / 1000000000;
    its.it_value.tv_nsec = *due % 1000000000;
    if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0) its.it_value.tv_nsec = 1;
  }
  ::timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, nullptr);
}

void set_params(Impairer& im, const std::pair<Params, Params>& p) {
  im.ab.p = p.first;
  im.ba.p = p.second;
  say(im.ab.name + ": " + describe(p.first));
  say(im.ba.name + ": " + describe(p.second));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"impair: an L2 forwarder with netem's impairments"};
  std::string a, b, control;
  std::vector<std::string> off;
  uint64_t seed = std::random_device{}();
  double limit_mb = 64;
  RawParams raw;
  app.add_option("--a", a, "first interface");
  app.add_option("--b", b, "second interface");
  app.add_option("--seed", seed, "random seed (logged at start)");
  app.add_option("--limit-mb", limit_mb, "queue bound per direction, MB (over it: dropped)");
  app.add_option("--control", control, "a FIFO for down/up/status/set lines (made if missing)");
  app.add_option("--offloads-off", off, "clear the offloads of these interfaces and exit");
  add_param_options(app, raw);
  std::pair<Params, Params> params;
  try {
    app.parse(argc, argv);
    params = to_params(raw);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (!off.empty()) {
    for (const std::string& i : off) offloads_off(i);
    return 0;
  }
  if (a.empty() || b.empty()) die("--a and --b are required");

  // Signals through a signalfd: the loop handles them between batches.
  sigset_t sigs;
  sigemptyset(&sigs);
  for (const int s : {SIGUSR1, SIGUSR2, SIGTERM, SIGINT, SIGHUP}) sigaddset(&sigs, s);
  ::sigprocmask(SIG_BLOCK, &sigs, nullptr);
  const int sfd = ::signalfd(-1, &sigs, SFD_NONBLOCK | SFD_CLOEXEC);
  const int tfd = ::timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  if (sfd < 0 || tfd < 0 || ep < 0)
    die("signalfd/timerfd/epoll: " + std::string(std::strerror(errno)));

  Impairer im(seed, static_cast<size_t>(limit_mb * 1e6));
  const int fa = open_packet_socket(a), fb = open_packet_socket(b);
  im.ab.name = a + "->" + b;
  im.ab.in = fa;
  im.ab.out = fb;
  im.ba.name = b + "->" + a;
  im.ba.in = fb;
  im.ba.out = fa;

  int cfd = -1;
  if (!control.empty()) {
    if (::mkfifo(control.c_str(), 0600) && errno != EEXIST) die("mkfifo " + control);
    // Read-write: the FIFO never reports end-of-file when a writer goes away.
    cfd = ::open(control.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (cfd < 0) die("open " + control + ": " + std::strerror(errno));
  }
  for (const int fd : {fa, fb, tfd, sfd, cfd}) {
    if (fd < 0) continue;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    ::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  }
  say("seed " + std::to_string(seed) + ", queue bound " + std::to_string(limit_mb) + " MB");
  set_params(im, params);
  say("forwarding " + a + " <-> " + b);

  std::string pending;  // a control line not yet ended
  bool running = true;
  while (running) {
    epoll_event evs[8];
    const int n = ::epoll_wait(ep, evs, 8, -1);
    if (n < 0 && errno != EINTR) die("epoll_wait: " + std::string(std::strerror(errno)));
    for (int k = 0; k < n; ++k) {
      const int fd = evs[k].data.fd;
      if (fd == fa) {
        im.receive(im.ab);
      } else if (fd == fb) {
        im.receive(im.ba);
      } else if (fd == tfd) {
        uint64_t ticks;
        while (::read(tfd, &ticks, sizeof(ticks)) > 0) {
        }
      } else if (fd == sfd) {
        signalfd_siginfo si;
        while (::read(sfd, &si, sizeof(si)) == sizeof(si)) {
          if (si.ssi_signo == SIGUSR1)
            im.set_down(!im.down);
          else if (si.ssi_signo == SIGUSR2)
            im.print_stats("status");
          else
            running = false;
        }
      } else if (fd == cfd) {
        char buf[512];
        ssize_t got;
        while ((got = ::read(cfd, buf, sizeof(buf))) > 0) pending.append(buf, size_t(got));
        for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
          std::string line = pending.substr(0, nl);
          pending.erase(0, nl + 1);
          if (line == "down" || line == "up")
            im.set_down(line == "down");
          else if (line == "status")
            im.print_stats("status");
          else if (line.rfind("set", 0) == 0) {
            if (auto p = parse_set(line.substr(3))) set_params(im, *p);
          } else if (!line.empty()) {
            say("control: unknown line '" + line + "'");
          }
        }
      }
    }
    arm(tfd, im.run_due());
  }
  im.print_stats("exit");
  return 0;
}
