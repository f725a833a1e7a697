// What operators see: the device's resource report (iproute2 field names, counters per QP and
// per guest, error completions by status), its Prometheus rendering, and the `vrdma res show` /
// `vrdma stat` selection and text built from it.
#include "backend/report.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/resource.h>

#include <regex>
#include <set>
#include <sstream>

#include "cli/show.h"
#include "device_fixture.h"

namespace vrdma::engine::devtest {
namespace {

using nlohmann::json;

json qp_row(const json& report, const std::string& guest) {
  for (const auto& q : report["res"]["qp"])
    if (q["guest"] == guest) return q;
  return nullptr;
}

/// The device plus the backend's reporter: the status document as the server builds it.
class OpsTest : public DeviceTest {
 protected:
  /// Connects a to b and sends one 100-byte message.
  void one_message() {
    connect_both();
    post_recv(qb_, 1, mb_.addr, 1024, mb_.mr.lkey);
    post_send(qa_, 2, ma_.addr, 100, ma_.mr.lkey);
    dev_.poll(now_);
  }
  json status() { return rep_.status(dev_); }

  backend::Config cfg_;
  backend::Reporter rep_{cfg_};
};

TEST_F(DeviceTest, ReportListsEveryResourceWithItsOwner) {
  connect_both();
  json r = dev_.report();
  ASSERT_EQ(r["res"]["qp"].size(), 2u);
  json a = qp_row(r, "a"), b = qp_row(r, "b");
  ASSERT_TRUE(a.is_object() && b.is_object()) << r.dump();
  EXPECT_EQ(a["lqpn"], qa_.qpn);
  EXPECT_EQ(a["rqpn"], qb_.qpn);
  EXPECT_EQ(b["rqpn"], qa_.qpn);
  EXPECT_EQ(a["type"], "RC");
  EXPECT_EQ(a["state"], "RTS");
  EXPECT_EQ(a["transport"], "shm");
  EXPECT_EQ(a["transport_why"], "destination guest on this backend");
  EXPECT_EQ(a["pid"], 4242);
  EXPECT_TRUE(a.contains("sq-psn") && a.contains("rq-psn") && a.contains("pdn"));
  EXPECT_EQ(a["pdn"], a_.pd);
  // One PD, one MR, two CQs (send and receive) per guest.
  auto count = [&](const char* type, const char* guest) {
    size_t n = 0;
    for (const auto& x : r["res"][type]) n += x["guest"] == guest;
    return n;
  };
  EXPECT_EQ(count("pd", "a"), 1u);
  EXPECT_EQ(count("mr", "b"), 1u);
  EXPECT_EQ(count("cq", "a"), 2u);
  EXPECT_EQ(count("srq", "a"), 0u);
  const json& mr = r["res"]["mr"][0];
  EXPECT_EQ(mr["mrlen"], kMemBytes);
  EXPECT_EQ(mr["lkey"], mr["rkey"]);
}

TEST_F(OpsTest, ReportCountsMessagesAndErrorsPerQpAndGuest) {
  one_message();
  json r = dev_.report();
  json a = qp_row(r, "a"), b = qp_row(r, "b");
  EXPECT_EQ(a["counters"]["msgs_sent"], 1);
  EXPECT_EQ(a["counters"]["bytes_sent"], 100);
  EXPECT_EQ(b["counters"]["msgs_received"], 1);
  EXPECT_EQ(b["counters"]["bytes_received"], 100);
  EXPECT_TRUE(a["counters"]["wc_errors"].empty());
  // A bad lkey: one LOC_PROT_ERR, then the next WQE flushes.
  post_send(qa_, 3, ma_.addr, 16, ma_.mr.lkey ^ 0x5a5a0);
  post_send(qa_, 4, ma_.addr, 16, ma_.mr.lkey);
  dev_.poll(now_);
  dev_.poll(now_);
  r = dev_.report();
  a = qp_row(r, "a");
  EXPECT_EQ(a["counters"]["wc_errors"], json({{"LOC_PROT_ERR", 1}, {"WR_FLUSH_ERR", 1}}));
  // Per-guest sums survive the QP's destruction (Prometheus counters never go down).
  ASSERT_TRUE(dev_.destroy_qp(*a_.s, qa_.handle).is_ok());
  r = dev_.report();
  EXPECT_EQ(r["res"]["qp"].size(), 1u);
  json ga;
  for (const auto& g : r["guest_counters"])
    if (g["guest"] == "a") ga = g;
  ASSERT_TRUE(ga.is_object()) << r.dump();
  EXPECT_EQ(ga["qps"], 0);
  EXPECT_EQ(ga["counters"]["msgs_sent"], 1);
  EXPECT_EQ(ga["counters"]["wc_errors"]["LOC_PROT_ERR"], 1);
}

TEST_F(OpsTest, CountersOutliveTheGuest) {
  one_message();
  dev_.close_session(a_.s);  // guest a leaves (its process ended)
  a_.s = nullptr;
  json st = status();
  json ga;
  for (const auto& g : st["guest_counters"])
    if (g["guest"] == "a") ga = g;
  ASSERT_TRUE(ga.is_object()) << st["guest_counters"].dump();
  EXPECT_TRUE(ga.contains("left_unix"));
  EXPECT_EQ(ga["counters"]["msgs_sent"], 1);
  EXPECT_EQ(ga["counters"]["bytes_sent"], 100);
  // The backend's totals hold every guest, those that left too.
  EXPECT_EQ(st["backend_counters"]["msgs_sent"], 1);
  EXPECT_EQ(st["backend_counters"]["msgs_received"], 1);
  auto rows = cli::stat_rows(st, "guest", {});
  ASSERT_TRUE(rows.is_ok());
  const std::string text = cli::stat_text("guest", *rows);
  EXPECT_NE(text.find("a (left)"), std::string::npos) << text;
  // In metrics: the backend's totals, and no series for a guest that is gone.
  const std::string m = backend::prometheus_text(st, false);
  EXPECT_NE(m.find("vrdma_backend_sent_messages_total 1\n"), std::string::npos) << m;
  EXPECT_EQ(m.find("vrdma_guest_sent_messages_total{guest=\"-\"}"), std::string::npos) << m;
}

TEST_F(OpsTest, ResShowSelectsAndPrintsLikeIproute2) {
  connect_both();
  json st = status();
  // iproute2's key names select too (lqpn: qpn).
  auto f = cli::parse_filters({"guest", "a", "lqpn", fmt::format("{:#x}", qa_.qpn)});
  ASSERT_TRUE(f.is_ok());
  auto rows = cli::res_rows(st, "qp", *f);
  ASSERT_TRUE(rows.is_ok()) << rows.status().message();
  ASSERT_EQ(rows->size(), 1u);
  EXPECT_EQ((*rows)[0]["qpn"], qa_.qpn);
  const std::string line = cli::res_text("qp", *rows);
  // LIDs and QPNs in 0x hex in every text output; the JSON keeps numbers.
  EXPECT_EQ(line, fmt::format("vrdma0 guest a qpn {:#x} dest_qpn {:#x} type RC state RTS sq_psn 0 "
                              "rq_psn 0 pdn {} sq_cqn {} rq_cqn {} transport shm pid 4242\n",
                              qa_.qpn, qb_.qpn, a_.pd, acq_.handle, arcq_.handle));
  // -d adds why the transport was chosen (the one value with spaces).
  EXPECT_NE(cli::res_text("qp", *rows, true)
                .find(" transport shm (destination guest on this backend) pid 4242\n"),
            std::string::npos);
  // Words match in any case; MR access bits are named.
  EXPECT_EQ(cli::res_rows(st, "qp", {{"state", "rts"}, {"type", "rc"}})->size(), 2u);
  const std::string mr = cli::res_text("mr", *cli::res_rows(st, "mr", {{"guest", "a"}}));
  EXPECT_NE(mr.find(" access LOCAL_WRITE,REMOTE_WRITE "), std::string::npos) << mr;
  // Decimal matches too (QPNs are per guest: both guests' first QP has the same number); a
  // value that is not a number matches nothing.
  EXPECT_EQ(cli::res_rows(st, "qp", {{"qpn", std::to_string(qb_.qpn)}})->size(),
            qa_.qpn == qb_.qpn ? 2u : 1u);
  EXPECT_EQ(cli::res_rows(st, "qp", {{"guest", "b"}, {"qpn", std::to_string(qb_.qpn)}})->size(),
            1u);
  EXPECT_EQ(cli::res_rows(st, "qp", {{"qpn", "17x"}})->size(), 0u);
  EXPECT_EQ(cli::res_rows(st, "qp", {{"state", "RTS"}})->size(), 2u);
  EXPECT_EQ(cli::res_rows(st, "cq", {{"guest", "a"}})->size(), 2u);  // send and receive CQ
  // Mistakes are errors that say what is valid.
  auto bad = cli::res_rows(st, "qp", {{"lqnp", "1"}});
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("valid: guest, qpn, dest_qpn"), std::string::npos);
  EXPECT_FALSE(cli::res_rows(st, "qps", {}).is_ok());
  EXPECT_FALSE(cli::parse_filters({"guest"}).is_ok());
}

// Memory windows (type, rkey, the MR range while bound, type 2's QP) and XRC objects (the
// domain, the XRC SRQ's domain, number and CQ, the receive QP) are rows of `res show` too.
TEST_F(OpsTest, ResShowListsWindowsAndXrcObjects) {
  qp_access_ = kAccess | IBV_ACCESS_MW_BIND;
  connect_both();
  MemV m = mem(a_, kAccess | IBV_ACCESS_MW_BIND);
  auto free_mw = dev_.alloc_mw(*a_.s, AllocMwReq{a_.pd, IBV_MW_TYPE_1});
  ASSERT_TRUE(free_mw.is_ok());
  const auto [bound, rkey] = type2_window(a_, qa_, m, 512, 1024, IBV_ACCESS_REMOTE_WRITE);
  ASSERT_EQ(poll_one(acq_).status, IBV_WC_SUCCESS);
  auto x = dev_.open_xrcd(*a_.s, OpenXrcdReq{O_CREAT, 0}, UniqueFd());
  ASSERT_TRUE(x.is_ok());
  UniqueFd ring;
  auto srq = dev_.create_xrc_srq(
      *a_.s, CreateXrcSrqReq{a_.pd, x.value(), arcq_.handle, 0, {4, 1, 0, 0}}, ring);
  ASSERT_TRUE(srq.is_ok()) << srq.status().message();
  CreateQpReq rq{};
  rq.qp_type = IBV_QPT_XRC_RECV;
  rq.xrcd = x.value();
  UniqueFd none;
  auto tgt = dev_.create_qp(*a_.s, rq, none);
  ASSERT_TRUE(tgt.is_ok()) << tgt.status().message();
  const uint32_t xrcdn = a_.s->xrcds.at(x.value());  // the guest's domain, not the handle

  json st = status();
  auto mws = cli::res_rows(st, "mw", {{"guest", "a"}, {"state", "bound"}});
  ASSERT_TRUE(mws.is_ok()) << mws.status().message();
  ASSERT_EQ(mws->size(), 1u);
  EXPECT_EQ(cli::res_text("mw", *mws),
            fmt::format("vrdma0 guest a mwn {} pdn {} type 2 state bound rkey {:#x} mrn {} iova "
                        "{:#x} length 1KiB access REMOTE_WRITE qpn {:#x} pid 4242\n",
                        bound.handle, a_.pd, rkey, m.mr.handle, m.addr + 512, qa_.qpn));
  EXPECT_EQ(cli::res_text("mw", *cli::res_rows(st, "mw", {{"state", "free"}})),
            fmt::format("vrdma0 guest a mwn {} pdn {} type 1 state free rkey {:#x} pid 4242\n",
                        free_mw->handle, a_.pd, free_mw->rkey));
  EXPECT_EQ(cli::res_text("xrcd", *cli::res_rows(st, "xrcd", {})),
            fmt::format("vrdma0 guest a xrcdn {} opens 1 users 2\n", xrcdn));
  auto srqs = cli::res_rows(st, "srq", {{"srq_num", std::to_string(srq->srq_num)}});
  ASSERT_EQ(srqs->size(), 1u);
  EXPECT_EQ((*srqs)[0]["xrcdn"], xrcdn);
  EXPECT_EQ((*srqs)[0]["cqn"], arcq_.handle);
  auto recv = cli::res_rows(st, "qp", {{"type", "XRC_RECV"}});
  ASSERT_EQ(recv->size(), 1u);
  EXPECT_EQ((*recv)[0]["qpn"], tgt->qpn);
  EXPECT_EQ((*recv)[0]["xrcdn"], xrcdn);
  EXPECT_EQ((*recv)[0]["opens"], 1);
  EXPECT_EQ((*recv)[0]["pid"], 4242);
}

TEST_F(OpsTest, StatRowsCarryTheCounters) {
  one_message();
  json st = status();
  auto qps = cli::stat_rows(st, "qp", {{"guest", "b"}});
  ASSERT_TRUE(qps.is_ok());
  ASSERT_EQ(qps->size(), 1u);
  EXPECT_EQ((*qps)[0]["msgs_received"], 1);
  auto guests = cli::stat_rows(st, "guest", {});
  ASSERT_TRUE(guests.is_ok());
  EXPECT_EQ(guests->size(), 2u);
  const std::string text = cli::stat_text("qp", *qps);
  EXPECT_NE(text.find("MSGS_RX"), std::string::npos);
  // Sizes in binary units, as everywhere in the text (cli::size_text).
  EXPECT_TRUE(std::regex_search(text, std::regex("\nb +0x[0-9a-f]+ RC +shm +0 +0B +1 +100B ")))
      << text;
}

TEST_F(OpsTest, PrometheusTextIsWellFormed) {
  one_message();
  cfg_.metrics_guest_names = true;
  const std::string text = rep_.metrics(dev_, now_);
  ASSERT_FALSE(text.empty());
  EXPECT_EQ(text.back(), '\n');
  // Every line is a HELP, a TYPE or a sample of the family declared last; families do not repeat.
  std::istringstream in(text);
  std::string line, family;
  std::set<std::string> families;
  const std::regex sample(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\[\\"n])*",?)*\})? -?[0-9.e+]+$)");
  while (std::getline(in, line)) {
    std::smatch m;
    if (line.starts_with("# HELP ")) continue;
    if (line.starts_with("# TYPE ")) {
      std::istringstream t(line.substr(7));
      std::string type;
      t >> family >> type;
      EXPECT_TRUE(families.insert(family).second) << "second TYPE for " << family;
      EXPECT_TRUE(type == "counter" || type == "gauge") << line;
      if (type == "counter") {
        EXPECT_TRUE(family.ends_with("_total")) << line;
      }
      continue;
    }
    ASSERT_TRUE(std::regex_match(line, m, sample)) << line;
    EXPECT_EQ(m[1].str(), family) << line;
  }
  EXPECT_NE(
      text.find(fmt::format("vrdma_qp_sent_messages_total{{guest=\"a\",qpn=\"{:#x}\",type=\"RC\","
                            "transport=\"shm\"}} 1\n",
                            qa_.qpn)),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("vrdma_guest_received_bytes_total{guest=\"b\"} 100\n"), std::string::npos);
}

TEST(CliText, SizesInBinaryUnitsIdsInHex) {
  EXPECT_EQ(cli::size_text(json(0)), "0B");
  EXPECT_EQ(cli::size_text(json(1023)), "1023B");
  EXPECT_EQ(cli::size_text(json(1024)), "1KiB");
  EXPECT_EQ(cli::size_text(json(1536)), "1.5KiB");
  EXPECT_EQ(cli::size_text(json(uint64_t{64} << 30)), "64GiB");
  EXPECT_EQ(cli::size_text(json(uint64_t{32} << 40)), "32TiB");
  EXPECT_EQ(cli::size_text(json("x")), "x");
  EXPECT_EQ(cli::size_text(json()), "-");
  EXPECT_EQ(cli::id_text(json(17)), "0x11");
  EXPECT_EQ(cli::id_text(json()), "-");
}

// The status documents of a migration's two backends: guest c (LID 2) with one RC QP to LID
// `dlid`, s (LID 1) beside it; `tcp` on both or neither, the target knowing `known`.
json move_doc(const char* sock, const char* node, bool tcp, json guests, json qps,
              const std::string& known = "") {
  json t = {{"name", "tcp"}, {"state", tcp ? "up" : "off"}, {"peers", json::array()}};
  t["known"] = known.empty() ? json::array() : json::array({known});
  return {{"backend", {{"socket", sock}, {"node", node}, {"transports", {t}}}},
          {"guests", std::move(guests)},
          {"res", {{"qp", std::move(qps)}}}};
}

TEST(CliMigrate, AMoveThatStrandsAPeerIsNamed) {
  const json guests = {{{"guest", "s"}, {"lid", 1}}, {{"guest", "c"}, {"lid", 2}}};
  auto qp = [](uint64_t dlid, const char* state, const char* peer_node = "") {
    return json{{"guest", "c"},   {"qpn", 17},    {"type", "RC"},
                {"state", state}, {"dlid", dlid}, {"peer_node", peer_node}};
  };
  const json to_off = move_doc("b.sock", "nb", false, json::array(), json::array());
  // A peer that stays behind, no TCP: refused, naming both backends, the QP and the peer.
  EXPECT_EQ(
      cli::stranded_by_move(move_doc("a.sock", "na", false, guests, {qp(1, "RTS")}), to_off, "c"),
      "moving guest c from a.sock (node na) to b.sock (node nb) would strand its "
      "connections: QP 0x11 is connected to guest s, which stays on a.sock; a.sock has no "
      "TCP transport (no [transport] listen)");
  // Not connected yet, or a QP within the guest: nothing to strand.
  EXPECT_EQ(
      cli::stranded_by_move(move_doc("a.sock", "na", false, guests, {qp(1, "INIT")}), to_off, "c"),
      "");
  EXPECT_EQ(
      cli::stranded_by_move(move_doc("a.sock", "na", false, guests, {qp(2, "RTS")}), to_off, "c"),
      "");
  // The peer is on the target: it becomes a same-host pair.
  EXPECT_EQ(cli::stranded_by_move(move_doc("a.sock", "na", false, {guests[1]}, {qp(1, "RTS")}),
                                  move_doc("b.sock", "nb", false, {guests[0]}, json::array()), "c"),
            "");
  // TCP on both: fine when either knows the other, refused when neither does.
  const json from_tcp = move_doc("a.sock", "na", true, guests, {qp(1, "RTS")});
  EXPECT_EQ(cli::stranded_by_move(
                from_tcp, move_doc("b.sock", "nb", true, json::array(), json::array(), "na"), "c"),
            "");
  EXPECT_NE(cli::stranded_by_move(from_tcp,
                                  move_doc("b.sock", "nb", true, json::array(), json::array()), "c")
                .find("neither backend knows the other's node (na, nb)"),
            std::string::npos);
  // A peer on a third backend: the target must know its node.
  const json from_remote = move_doc("a.sock", "na", true, guests, {qp(9, "RTS", "nc")});
  EXPECT_NE(cli::stranded_by_move(from_remote, to_off, "c")
                .find("QP 0x11 is connected to a guest on node nc; b.sock has no TCP transport"),
            std::string::npos);
  EXPECT_EQ(
      cli::stranded_by_move(
          from_remote, move_doc("b.sock", "nb", true, json::array(), json::array(), "nc"), "c"),
      "");
}

TEST_F(OpsTest, StatusHeaderShowsTheBackend) {
  connect_both();
  cfg_.listen = "0.0.0.0:7471";
  cfg_.peers = {"10.0.0.2:7471"};
  cfg_.quotas.max_qps = 7;
  rep_.set_connected_peers([] { return std::vector<std::string>{"h2"}; });
  rep_.set_transport_details([] {
    return nlohmann::json{
        {"security", "tls"},
        {"peers",
         {{{"node", "h2"},
           {"address", "10.0.0.2:7471"},
           {"identity", "h2"},
           {"cipher", "TLS_AES_128_GCM_SHA256"},
           {"since_unix", 1},
           {"queued_bytes", 4096},
           {"unacked_bytes", 8192},
           {"rx_bytes", 100},
           {"dropped_bytes", 65536}}}},
        {"refused", {{"handshake", 2}, {"name", 0}, {"frames", 5}}},
        {"known", {"h2", "h3"}},
        {"connections", {{"dials", 3}, {"idle_closes", 2}, {"idle_close_s", 60}}}};
  });
  const std::string h = cli::status_header(status());
  EXPECT_NE(h.find("  peer h2 at 10.0.0.2:7471: certificate h2, TLS_AES_128_GCM_SHA256, for "),
            std::string::npos)
      << h;
  EXPECT_NE(h.find("  security: tls; refused: frames 5, handshake 2\n"), std::string::npos) << h;
  const std::string m = backend::prometheus_text(status(), false);
  EXPECT_NE(m.find("vrdma_transport_refused_total{reason=\"frames\"} 5\n"), std::string::npos) << m;
  EXPECT_NE(m.find("vrdma_transport_peers{security=\"tls\"} 1\n"), std::string::npos) << m;
  EXPECT_NE(m.find("vrdma_transport_known_peers 2\n"), std::string::npos) << m;
  EXPECT_NE(m.find("vrdma_transport_dials_total 3\n"), std::string::npos) << m;
  EXPECT_NE(m.find("vrdma_transport_idle_closes_total 2\n"), std::string::npos) << m;
  EXPECT_NE(m.find("vrdma_transport_peer_queued_bytes{node=\"h2\"} 4096\n"), std::string::npos)
      << m;
  EXPECT_NE(m.find("vrdma_transport_peer_unacked_bytes{node=\"h2\"} 8192\n"), std::string::npos);
  EXPECT_NE(m.find("vrdma_transport_peer_dropped_bytes_total{node=\"h2\"} 65536\n"),
            std::string::npos);
  EXPECT_TRUE(std::regex_search(h, std::regex("^backend: .*\\(vrdmad [0-9.]+, pid [0-9]+, node .*, "
                                              "up [0-9]+s\\)\n")))
      << h;
  EXPECT_NE(h.find("transports: shm up (same-host pairs); tcp up (cross-host pairs, connected: "
                   "h2 of 2 known (dials 3, idle closes 2))\n"),
            std::string::npos)
      << h;
  EXPECT_NE(h.find("peers: 10.0.0.2:7471 (connected to h2 for "), std::string::npos) << h;
  EXPECT_NE(h.find("\nconfig: no file (defaults and flags); log "), std::string::npos) << h;
  EXPECT_NE(h.find("\nkeep_state: off\n"), std::string::npos) << h;
  // The defaults since issue 25: both on.
  EXPECT_NE(h.find("\ndirect paths: same host on, across backends on\n"), std::string::npos) << h;
  EXPECT_NE(h.find("datapath: 1 thread, busy "), std::string::npos) << h;
  EXPECT_NE(h.find("metrics: off\n"), std::string::npos) << h;
  EXPECT_NE(h.find("qp 1/7"), std::string::npos) << h;  // the most any guest holds, and the quota
}

// Each configured peer's state and why it last failed, from the transport's dials, in the JSON
// and the text; a peer with the transport off says that.
TEST_F(OpsTest, StatusShowsEachPeersStateAndLastError) {
  cfg_.listen = "0.0.0.0:7471";
  cfg_.peers = {"10.0.0.2:7471", "h3@10.0.0.3:7471"};
  const uint64_t now = static_cast<uint64_t>(::time(nullptr));
  rep_.set_connected_peers([] { return std::vector<std::string>{}; });
  rep_.set_peer_dials([now] {
    return json::array({{{"address", "10.0.0.2:7471"},
                         {"node", ""},
                         {"state", "connecting"},
                         {"last_error", "connect timed out"},
                         {"last_error_unix", now - 5},
                         {"failures", 3}},
                        {{"address", "10.0.0.3:7471"},
                         {"node", "h3"},
                         {"state", "not connected"},
                         {"last_error", "TLS handshake failed: certificate verify failed"},
                         {"last_error_unix", now - 65},
                         {"failures", 1}}});
  });
  const json st = status();
  const json& ps = st["backend"]["peer_states"];
  ASSERT_EQ(ps.size(), 2u) << ps.dump();
  EXPECT_EQ(ps[0]["state"], "connecting");
  EXPECT_EQ(ps[0]["last_error"], "connect timed out");
  EXPECT_EQ(ps[0]["failures"], 3);
  EXPECT_EQ(ps[1]["peer"], "h3@10.0.0.3:7471");
  EXPECT_EQ(ps[1]["last_error_unix"], now - 65);
  const std::string h = cli::status_header(st);
  EXPECT_NE(h.find("peers: 10.0.0.2:7471 (connecting, 3 failed attempt(s); last error 5s ago: "
                   "connect timed out), h3@10.0.0.3:7471 (not connected, 1 failed attempt(s); "
                   "last error 1m5s ago: TLS handshake failed: certificate verify failed)\n"),
            std::string::npos)
      << h;
  // Peers configured without a listen address: no transport dials them, and status says so.
  backend::Config off;
  off.peers = {"10.0.0.2:7471"};
  backend::Reporter plain(off);
  const json p = plain.status(dev_)["backend"]["peer_states"];
  EXPECT_EQ(p[0]["state"], "not connected");
  EXPECT_EQ(p[0]["last_error"], "the TCP transport is off (no [transport] listen)");
}

// The segment quotas (count and bytes per guest, mapped bytes for all guests) are in the status
// document, its text header and the metrics, each beside what the guests use.
TEST_F(OpsTest, SegmentQuotasAndUseAreShown) {
  connect_both();
  cfg_.quotas.max_segments = 9;
  cfg_.quotas.max_segment_bytes = 1ull << 20;
  cfg_.quotas.max_mapped_bytes = 3ull << 20;
  const json st = status();
  const json& q = st["backend"]["quotas"];
  EXPECT_EQ(q["segment"], 9);
  EXPECT_EQ(q["segment_bytes"], 1ull << 20);
  EXPECT_EQ(q["mapped_bytes"], 3ull << 20);
  // Each guest registered one segment of kMemBytes and one MR over it.
  for (const auto& g : st["guests"]) {
    EXPECT_EQ(g["resources"]["segment"], 1) << g.dump();
    EXPECT_EQ(g["resources"]["segment_bytes"], kMemBytes) << g.dump();
    EXPECT_EQ(g["resources"]["mr_bytes"], kMemBytes) << g.dump();
  }
  EXPECT_EQ(st["totals"]["segment_bytes"], 2 * kMemBytes);
  const std::string h = cli::status_header(st);
  // Sizes in binary units in the text (kMemBytes: 8 KiB), bytes in the JSON.
  static_assert(kMemBytes == 8192);
  EXPECT_NE(h.find(fmt::format("mr bytes 8KiB/{}GiB", cfg_.quotas.max_mr_bytes >> 30)),
            std::string::npos)
      << h;
  EXPECT_NE(h.find("segment 1/9"), std::string::npos) << h;
  EXPECT_NE(h.find("segment bytes 8KiB/1MiB"), std::string::npos) << h;
  EXPECT_NE(h.find("mapped bytes (guests shown/limit for all guests): 16KiB/3MiB\n"),
            std::string::npos)
      << h;
  const std::string m = backend::prometheus_text(st, true);
  for (const std::string& want : std::vector<std::string>{
           "vrdma_quota{resource=\"segment\"} 9\n",
           "vrdma_quota_bytes{resource=\"segment\"} 1048576\n",
           "vrdma_quota_bytes{resource=\"mapped\"} 3145728\n",
           fmt::format("vrdma_mapped_bytes {}\n", 2 * kMemBytes),
           fmt::format("vrdma_resource_bytes{{guest=\"a\",kind=\"segment\"}} {}\n", kMemBytes),
           "vrdma_resources{guest=\"b\",kind=\"segment\"} 1\n"})
    EXPECT_NE(m.find(want), std::string::npos) << want << " not in:\n" << m;
  // A segment released gives its bytes back, in the status as in the quota.
  ASSERT_TRUE(dev_.dereg_mr(*a_.s, ma_.mr.handle).is_ok());
  ASSERT_EQ(a_.s->segments.size(), 1u);
  ASSERT_TRUE(dev_.dereg_segment(*a_.s, a_.s->segments.begin()->first).is_ok());
  const json after = status();
  EXPECT_EQ(after["totals"]["segment_bytes"], kMemBytes);
  EXPECT_EQ(after["totals"]["segment"], 1);
}

TEST(PrometheusText, EscapesLabelValues) {
  // Guest names come from the guest (VRDMA_GUEST): quotes, backslashes, newlines are escaped.
  json st = {{"backend",
              {{"version", "1"},
               {"node", "n"},
               {"started_unix", 1700000000},
               {"datapath", {{"cpu_s", 0.5}}},
               {"quotas", json::object()}}},
             {"totals", {{"guests", 1}, {"sessions", 1}}},
             {"guests", json::array({{{"guest", "a\"b\\c\nd"}, {"resources", {{"qp", 1}}}}})},
             {"guest_counters", json::array()},
             {"res", {{"qp", json::array()}}}};
  const std::string text = backend::prometheus_text(st, true);
  EXPECT_NE(text.find("vrdma_resources{guest=\"a\\\"b\\\\c\\nd\",kind=\"qp\"} 1\n"),
            std::string::npos)
      << text;
}

TEST(PrometheusText, DirectoryOnEtcd) {
  // The tcp transport's directory (EtcdDirectory::status_json): operations, watch lag, lease
  // age, nodes known, and each node's QPs and guests.
  json dir = {
      {"kind", "etcd"},
      {"reachable", true},
      {"registered", true},
      {"lease_age_s", 42},
      {"watch_lag_ms", 3},
      {"counters", {{"requests", 17}, {"failures", 2}}},
      {"nodes",
       json::array({{{"node", "h1"}, {"qps", 5}, {"guests", json::array()}},
                    {{"node", "h2"}, {"qps", 0}, {"guests", json::array({{{"name", "g"}}})}}})}};
  json st = {{"backend",
              {{"version", "1"},
               {"node", "h1"},
               {"started_unix", 1700000000},
               {"datapath", {{"cpu_s", 0.5}}},
               {"transports", json::array({{{"name", "tcp"},
                                            {"security", "tls"},
                                            {"refused", {{"name", 0}}},
                                            {"peers", json::array()},
                                            {"directory", dir}}})},
               {"quotas", json::object()}}},
             {"totals", {{"guests", 0}, {"sessions", 0}}},
             {"guests", json::array()},
             {"guest_counters", json::array()},
             {"res", {{"qp", json::array()}}}};
  const std::string text = backend::prometheus_text(st, false);
  for (const char* want :
       {"vrdma_directory_requests_total 17\n", "vrdma_directory_failures_total 2\n",
        "vrdma_directory_moves_here_total 0\n", "vrdma_directory_reachable 1\n",
        "vrdma_directory_registered 1\n", "vrdma_directory_lease_age_seconds 42\n",
        "vrdma_directory_watch_lag_seconds 0.003\n", "vrdma_directory_nodes 2\n",
        "vrdma_directory_node_qps{node=\"h1\"} 5\n", "vrdma_directory_node_qps{node=\"h2\"} 0\n",
        "vrdma_directory_node_guests{node=\"h2\"} 1\n"})
    EXPECT_NE(text.find(want), std::string::npos) << want << "\n" << text;
  // Without the directory on etcd: none of it.
  st["backend"]["transports"][0].erase("directory");
  EXPECT_EQ(backend::prometheus_text(st, false).find("vrdma_directory_"), std::string::npos);
}

TEST_F(OpsTest, MetricsLabelGuestsByLidUnlessNamesAreConfigured) {
  one_message();
  ASSERT_FALSE(cfg_.metrics_guest_names);  // the default
  const std::string text = rep_.metrics(dev_, now_);
  EXPECT_EQ(text.find("guest=\"a\""), std::string::npos) << text;
  EXPECT_EQ(text.find("guest=\"b\""), std::string::npos) << text;
  EXPECT_NE(text.find(fmt::format("vrdma_guest_received_bytes_total{{guest=\"lid-{:#x}\"}} 100\n",
                                  b_.hello.lid)),
            std::string::npos)
      << text;
  EXPECT_NE(
      text.find(fmt::format("vrdma_qp_sent_messages_total{{guest=\"lid-{:#x}\",qpn=\"{:#x}\",",
                            a_.hello.lid, qa_.qpn)),
      std::string::npos)
      << text;
  EXPECT_NE(text.find(fmt::format("vrdma_resources{{guest=\"lid-{:#x}\",kind=\"qp\"}} 1\n",
                                  a_.hello.lid)),
            std::string::npos)
      << text;
}

// [metrics] per_qp = false: no series per QP (their number grows with the QPs), the per-guest
// and backend-wide ones stay.
TEST_F(OpsTest, StatusAboveAThousandQpsCountsTheRowsInsteadOfListingThem) {
  rlimit r{};  // the backend keeps a ring descriptor per QP
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &r), 0);
  r.rlim_cur = r.rlim_max;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &r), 0);
  std::vector<QpV> many;
  while (dev_.qp_total() <= 1000) many.push_back(qp(a_, acq_, arcq_));
  const backend::Viewer admin{0, true};
  const json doc = json::parse(rep_.status_for(dev_, admin, now_).json);
  EXPECT_TRUE(doc["res"]["qp"].empty());
  // Counted per guest: a holds them all but b's one.
  ASSERT_EQ(doc["res_omitted"].size(), 2u) << doc["res_omitted"];
  EXPECT_EQ(doc["res_omitted"][0]["guest"], "a");
  EXPECT_EQ(doc["res_omitted"][0]["qp"], dev_.qp_total() - 1);
  EXPECT_EQ(doc["res_omitted"][1],
            json({{"guest", "b"}, {"qp", 1}, {"pd", 1}, {"cq", 1}, {"mr", 1}}));
  EXPECT_EQ(doc["totals"]["qp"], dev_.qp_total());
  size_t seen = 0;
  for (const auto& g : doc["guests"]) {
    EXPECT_TRUE(g["qps"].empty());
    seen += g["qps_omitted"].get<size_t>();
  }
  EXPECT_EQ(seen, dev_.qp_total());
  // The sums are still there: a's counters count its QPs' messages.
  EXPECT_TRUE(doc["guest_counters"].is_array() && !doc["guest_counters"].empty());
  // Back to 1000: the rows are back.
  ASSERT_TRUE(dev_.destroy_qp(*a_.s, many.back().handle).is_ok());
  const json full = json::parse(rep_.status_for(dev_, admin, now_).json);
  EXPECT_EQ(full["res"]["qp"].size(), dev_.qp_total());
  EXPECT_FALSE(full.contains("res_omitted"));
}

TEST_F(OpsTest, MetricsPerQpSeriesCanBeTurnedOff) {
  one_message();
  cfg_.metrics_per_qp = false;
  const std::string text = rep_.metrics(dev_, now_);
  EXPECT_EQ(text.find("vrdma_qp_"), std::string::npos) << text;
  EXPECT_EQ(text.find("qpn="), std::string::npos) << text;
  EXPECT_NE(text.find(fmt::format("vrdma_guest_received_bytes_total{{guest=\"lid-{:#x}\"}} 100\n",
                                  b_.hello.lid)),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("\nprocess_resident_memory_bytes "), std::string::npos) << text;
}

TEST_F(OpsTest, MetricsRenderAtMostOncePerInterval) {
  cfg_.metrics_min_interval_ms = 1000;
  const std::string first = rep_.metrics(dev_, now_);
  EXPECT_EQ(rep_.metrics_renders(), 1u);
  // Within the interval: the snapshot, even though the device moved on.
  one_message();
  EXPECT_EQ(rep_.metrics(dev_, now_ + 999'999'999), first);
  EXPECT_EQ(rep_.metrics_renders(), 1u);
  // After it: a new rendering with the new counters.
  const std::string later = rep_.metrics(dev_, now_ + 1'000'000'000);
  EXPECT_EQ(rep_.metrics_renders(), 2u);
  EXPECT_NE(later.find(fmt::format("vrdma_guest_received_bytes_total{{guest=\"lid-{:#x}\"}} 100\n",
                                   b_.hello.lid)),
            std::string::npos)
      << later;
  // 0: every scrape renders.
  cfg_.metrics_min_interval_ms = 0;
  rep_.metrics(dev_, now_ + 1'000'000'000);
  EXPECT_EQ(rep_.metrics_renders(), 3u);
}

/// Guests of two users (a: kOwner, b: kOther) on a backend run by kBackendUid.
class VisibilityTest : public OpsTest {
 protected:
  static constexpr uint32_t kBackendUid = 60000, kOwner = 60001, kOther = 60002;
  void SetUp() override {
    dev_.set_backend_uid(kBackendUid);
    make_pair(kOwner, kOther);
    one_message();
  }
  json as(uint32_t uid) {
    return backend::visible_status(status(), backend::Viewer{uid, is_admin_uid(uid, kBackendUid)});
  }
  /// Every key of every object in `j`, recursively.
  static void keys_of(const json& j, std::set<std::string>& out) {
    if (j.is_object()) {
      for (const auto& [k, v] : j.items()) {
        out.insert(k);
        keys_of(v, out);
      }
    } else if (j.is_array()) {
      for (const auto& v : j) keys_of(v, out);
    }
  }
  /// Every guest name anywhere in the document (guests, res rows, counters).
  static std::set<std::string> guests_in(const json& st) {
    std::set<std::string> out;
    for (const auto& g : st["guests"]) out.insert(g["guest"].get<std::string>());
    for (const auto& [type, rows] : st["res"].items())
      for (const auto& r : rows) out.insert(r["guest"].get<std::string>());
    for (const auto& g : st["guest_counters"]) out.insert(g["guest"].get<std::string>());
    return out;
  }
};

// Without lists (above 1000 QPs) the rows left out are counted per guest, and a user sees the
// counts of its own guests only, as it sees their rows.
TEST_F(VisibilityTest, LeftOutRowsAreCountedForTheViewersOwnGuestsOnly) {
  const json whole = rep_.status(dev_, /*lists=*/false);
  ASSERT_EQ(whole["res_omitted"].size(), 2u) << whole["res_omitted"];
  const json mine = backend::visible_status(whole, backend::Viewer{kOwner, false});
  ASSERT_EQ(mine["res_omitted"].size(), 1u) << mine["res_omitted"];
  EXPECT_EQ(mine["res_omitted"][0]["guest"], "a");
  EXPECT_EQ(mine["res_omitted"][0]["qp"], 1);
  EXPECT_TRUE(backend::visible_status(whole, backend::Viewer{60003, false})["res_omitted"].empty());
  EXPECT_FALSE(as(kBackendUid).contains("res_omitted")) << "with lists: nothing left out";
}

TEST_F(VisibilityTest, AGuestThatLeftIsSeenByItsOwnerOnly) {
  dev_.close_session(a_.s);
  a_.s = nullptr;
  EXPECT_EQ(guests_in(as(kOwner)), (std::set<std::string>{"a"}));  // its counters stay
  EXPECT_EQ(guests_in(as(kOther)), (std::set<std::string>{"b"}));
  EXPECT_FALSE(as(kOther).contains("backend_counters"));  // all users' together: admins'
  EXPECT_EQ(guests_in(as(0)), (std::set<std::string>{"a", "b"}));
}

TEST_F(VisibilityTest, AdminsSeeEveryGuestWithKeys) {
  for (uint32_t uid : {0u, kBackendUid}) {
    const json st = as(uid);
    EXPECT_EQ(guests_in(st), (std::set<std::string>{"a", "b"})) << uid;
    EXPECT_EQ(st["view"]["admin"], true);
    std::set<std::string> keys;
    keys_of(st, keys);
    EXPECT_TRUE(keys.count("rkey") && keys.count("lkey") && keys.count("iova")) << uid;
    EXPECT_EQ(st["totals"]["guests"], 2);
    EXPECT_EQ(st["res"]["mr"].size(), 2u);
  }
}

TEST_F(VisibilityTest, AUserSeesOnlyItsOwnGuestsAndNoKeys) {
  const json st = as(kOwner);
  EXPECT_EQ(guests_in(st), std::set<std::string>{"a"}) << st.dump();
  EXPECT_EQ(st["view"]["admin"], false);
  EXPECT_EQ(st["view"]["uid"], kOwner);
  std::set<std::string> keys;
  keys_of(st, keys);
  for (const char* k : {"lkey", "rkey", "iova"}) EXPECT_EQ(keys.count(k), 0u) << k;
  // Its own resources are all there, and the totals are its own.
  EXPECT_EQ(st["res"]["qp"].size(), 1u);
  EXPECT_EQ(st["res"]["qp"][0]["qpn"], qa_.qpn);
  EXPECT_EQ(st["res"]["mr"].size(), 1u);
  EXPECT_EQ(st["res"]["mr"][0]["mrlen"], kMemBytes);
  EXPECT_EQ(st["res"]["cq"].size(), 2u);
  EXPECT_EQ(st["guest_counters"].size(), 1u);
  EXPECT_EQ(st["guest_counters"][0]["counters"]["msgs_sent"], 1);
  EXPECT_EQ(st["totals"]["guests"], 1);
  EXPECT_EQ(st["totals"]["sessions"], 1);
  EXPECT_EQ(st["totals"]["qp"], 1);
  EXPECT_EQ(st["totals"]["cq"], 2);
  EXPECT_EQ(st["totals"]["mr"], 1);
  EXPECT_EQ(st["totals"]["segment_bytes"], kMemBytes);  // its own guest's, not a's too
  // The other user sees only b; the CLI's views work on what is left.
  const json other = as(kOther);
  EXPECT_EQ(guests_in(other), std::set<std::string>{"b"});
  auto mrs = cli::res_rows(other, "mr", {});
  ASSERT_TRUE(mrs.is_ok());
  ASSERT_EQ(mrs->size(), 1u);
  const std::string line = cli::res_text("mr", *mrs);
  EXPECT_EQ(line.find("key"), std::string::npos) << line;
  EXPECT_EQ(line.find("iova"), std::string::npos) << line;
  EXPECT_NE(line.find("mrlen 8KiB"), std::string::npos) << line;
  // The size as printed selects, in any case, as the bytes do.
  EXPECT_EQ(cli::res_rows(other, "mr", {{"mrlen", "8kib"}})->size(), 1u);
  EXPECT_EQ(cli::res_rows(other, "mr", {{"mrlen", "8192"}})->size(), 1u);
  EXPECT_EQ(cli::res_rows(other, "mr", {{"mrlen", "8MiB"}})->size(), 0u);
  EXPECT_NE(cli::status_header(other).find("view: uid 60002: its own guests only"),
            std::string::npos);
  EXPECT_EQ(cli::status_header(as(0)).find("view:"), std::string::npos);
  EXPECT_EQ(cli::stat_rows(other, "guest", {})->size(), 1u);
  EXPECT_EQ(cli::stat_rows(other, "qp", {})->size(), 1u);
}

// Metrics scraped over a unix socket, where the kernel says who scrapes: a user who is not an
// admin gets its own guests only, cut from the same snapshot (one rendering of the device for
// everyone within min_interval_ms); admins and TCP scrapes get every guest.
TEST_F(VisibilityTest, MetricsOverAUnixSocketShowAUserItsOwnGuestsOnly) {
  const std::string a_rows = fmt::format("{{guest=\"lid-{:#x}\"", a_.hello.lid),
                    b_rows = fmt::format("{{guest=\"lid-{:#x}\"", b_.hello.lid);
  const backend::Viewer owner{kOwner, false}, other{kOther, false};
  const std::string all = rep_.metrics(dev_, now_);
  EXPECT_NE(all.find(a_rows), std::string::npos) << all;
  EXPECT_NE(all.find(b_rows), std::string::npos) << all;
  EXPECT_EQ(rep_.metrics(dev_, now_, backend::Viewer{0, true}), all);
  const std::string mine = rep_.metrics(dev_, now_, owner);
  EXPECT_NE(mine.find(a_rows), std::string::npos) << mine;
  EXPECT_EQ(mine.find(b_rows), std::string::npos) << mine;
  EXPECT_NE(mine.find("vrdma_guests 1\n"), std::string::npos) << mine;
  EXPECT_NE(all.find("vrdma_guests 2\n"), std::string::npos) << all;
  EXPECT_NE(mine.find(fmt::format("vrdma_mapped_bytes {}\n", kMemBytes)), std::string::npos)
      << mine;
  const std::string theirs = rep_.metrics(dev_, now_ + 1, other);
  EXPECT_EQ(theirs.find(a_rows), std::string::npos) << theirs;
  EXPECT_NE(theirs.find(b_rows), std::string::npos) << theirs;
  // A uid with no guest: the backend's own numbers, no guest at all.
  const std::string none = rep_.metrics(dev_, now_ + 2, backend::Viewer{60003, false});
  EXPECT_EQ(none.find("{guest="), std::string::npos) << none;
  EXPECT_NE(none.find("vrdma_start_time_seconds"), std::string::npos) << none;
  EXPECT_NE(none.find("\nprocess_open_fds "), std::string::npos) << none;
  EXPECT_EQ(rep_.metrics_renders(), 1u);
  EXPECT_EQ(rep_.metrics(dev_, now_ + 3, owner), mine);
}

// Status for callers who are not admins comes from a snapshot at most status_min_interval_ms old
// (the clock is the test's): a caller asking in a loop does not render the device each time, but
// sees its own changes at once. Admins get a fresh document every time.
TEST_F(VisibilityTest, StatusForNonAdminsComesFromARateLimitedSnapshot) {
  ASSERT_EQ(cfg_.status_min_interval_ms, 100);
  const backend::Viewer owner{kOwner, false}, other{kOther, false}, admin{0, true};
  auto qps = [](const backend::Reporter::View& v) {
    return json::parse(v.json)["totals"]["qp"].get<uint64_t>();
  };
  const uint64_t t0 = now_;
  const std::string first = rep_.status_for(dev_, owner, t0).json;
  EXPECT_EQ(rep_.status_renders(), 1u);
  EXPECT_EQ(rep_.status_for(dev_, owner, t0 + 1'000'000).guests, 1u);
  for (int i = 0; i < 1000; ++i) rep_.status_for(dev_, owner, t0 + 2'000'000);
  EXPECT_EQ(rep_.status_for(dev_, other, t0 + 3'000'000).guests, 1u);  // its own guest only
  EXPECT_EQ(rep_.status_renders(), 1u);
  EXPECT_EQ(rep_.status_for(dev_, owner, t0 + 4'000'000).json, first);
  // b's QP goes without its user's session saying so (another user's change): the snapshot is
  // stale until the interval is over.
  ASSERT_TRUE(dev_.destroy_qp(*b_.s, qb_.handle).is_ok());
  EXPECT_EQ(qps(rep_.status_for(dev_, other, t0 + 5'000'000)), 1u);
  EXPECT_EQ(rep_.status_renders(), 1u);
  // The caller's own change (the server notes every command that succeeds): seen at once.
  rep_.note_change(kOther);
  EXPECT_EQ(qps(rep_.status_for(dev_, owner, t0 + 6'000'000)), 1u);  // a's own QP
  EXPECT_EQ(rep_.status_renders(), 1u);                              // not a's change
  EXPECT_EQ(qps(rep_.status_for(dev_, other, t0 + 6'000'000)), 0u);
  EXPECT_EQ(rep_.status_renders(), 2u);
  // Once the interval is over, the next request renders again.
  rep_.status_for(dev_, owner, t0 + 6'000'000 + 99'999'999);
  EXPECT_EQ(rep_.status_renders(), 2u);
  rep_.status_for(dev_, owner, t0 + 6'000'000 + 100'000'000);
  EXPECT_EQ(rep_.status_renders(), 3u);
  // Admins: fresh every time, with what only they see.
  const backend::Reporter::View& a = rep_.status_for(dev_, admin, t0 + 106'000'000);
  EXPECT_EQ(a.guests, 2u);
  EXPECT_NE(a.json.find("\"rkey\""), std::string::npos);
  rep_.status_for(dev_, admin, t0 + 106'000'000);
  EXPECT_EQ(rep_.status_renders(), 5u);
  // 0: every request renders.
  cfg_.status_min_interval_ms = 0;
  rep_.status_for(dev_, owner, t0 + 106'000'000);
  rep_.status_for(dev_, owner, t0 + 106'000'000);
  EXPECT_EQ(rep_.status_renders(), 7u);
}

TEST_F(VisibilityTest, AStrangerOrAnUnknownCallerSeesNoGuest) {
  for (uint32_t uid : {60003u, kNoUid}) {
    const json st = as(uid);
    EXPECT_TRUE(guests_in(st).empty()) << st.dump();
    EXPECT_EQ(st["totals"]["guests"], 0);
    EXPECT_EQ(st["totals"]["qp"], 0);
    EXPECT_TRUE(st.contains("backend"));
    EXPECT_EQ(cli::res_summary(st), "");
  }
  // Even a document that is not what the server builds is cut down, never thrown at.
  const json odd = backend::visible_status(json{{"guests", 3}, {"res", {{"qp", "x"}}}},
                                           backend::Viewer{kOwner, false});
  EXPECT_TRUE(odd["guests"].empty());
  EXPECT_TRUE(odd["res"]["qp"].empty());
}

}  // namespace
}  // namespace vrdma::engine::devtest
