// `vrdma cluster status`: the cluster view taken from a status document, as JSON and as text.
#include "cli/cluster_status.h"

#include <gtest/gtest.h>

namespace vrdma::cli {
namespace {

using nlohmann::json;

json status_with(json tcp) {
  return {{"backend",
           {{"node", "h1"},
            {"transports", json::array({{{"name", "shm"}, {"state", "up"}}, std::move(tcp)})}}}};
}

TEST(ClusterStatusTest, EtcdNodesGuestsAndConnections) {
  json dir = {{"kind", "etcd"},      {"endpoint", "http://e:2379"},
              {"reachable", true},   {"registered", true},
              {"prefix", "/vrdma/"}, {"lease_s", 2},
              {"revision", 9},       {"node", "h1"},
              {"watch_lag_ms", 3},   {"lease_age_s", 130}};
  dir["nodes"] = json::array(
      {{{"node", "h1"},
        {"address", "10.0.0.1:7471"},
        {"self", true},
        {"age_s", 5},
        {"lease_ttl_s", 2},
        {"guests", json::array({{{"name", "g"}, {"lid", 0x12}, {"generation", 1}}})}},
       {{"node", "h2"},
        {"address", "[fd00::2]:7471"},
        {"age_s", 4},
        {"qps", 12},
        {"guests", json::array()}},
       {{"node", "h3"}, {"address", "10.0.0.3:7471"}, {"age_s", 3}, {"guests", json::array()}}});
  const json v = cluster_view(status_with({{"name", "tcp"},
                                           {"state", "up"},
                                           {"connected", {"h2"}},
                                           {"known", {"h2", "h3"}},
                                           {"connections", {{"dials", 4}, {"idle_closes", 3}}},
                                           {"directory", dir}}));
  EXPECT_EQ(v["directory"], "etcd");
  ASSERT_EQ(v["nodes"].size(), 3u);
  EXPECT_EQ(v["nodes"][1]["connected"], true);
  EXPECT_EQ(v["nodes"][2]["connected"], false);
  EXPECT_FALSE(v["etcd"].contains("nodes"));
  const std::string t = cluster_text(v);
  EXPECT_NE(t.find("directory: etcd http://e:2379 (reachable, registered"), std::string::npos) << t;
  EXPECT_NE(t.find("h1*"), std::string::npos) << t;
  EXPECT_NE(t.find("(this backend)"), std::string::npos) << t;
  EXPECT_NE(t.find("watch lag 3 ms, lease kept 2 min"), std::string::npos) << t;
  // h2 reports its QPs; h3 (an older backend) does not say.
  EXPECT_NE(t.find("h2               [fd00::2]:7471              -      4 s      0     12  yes"),
            std::string::npos)
      << t;
  EXPECT_NE(t.find("      0      -  no"), std::string::npos) << t;
  EXPECT_NE(t.find("g                        lid 0x0012  on h1  generation 1"), std::string::npos)
      << t;
  // Connections on demand: connected to one of the two it knows.
  EXPECT_NE(t.find("connections: 1 of 2 known peers (on demand; dials 4, idle closes 3"),
            std::string::npos)
      << t;
}

TEST(ClusterStatusTest, EmbeddedAndOff) {
  json v = cluster_view(status_with({{"name", "tcp"}, {"state", "up"}, {"connected", {"h2"}}}));
  EXPECT_EQ(v["directory"], "embedded");
  EXPECT_NE(cluster_text(v).find("connected to: h2"), std::string::npos);
  v = cluster_view(status_with({{"name", "tcp"}, {"state", "off"}}));
  EXPECT_EQ(v["directory"], "off");
  EXPECT_NE(cluster_text(v).find("TCP transport is off"), std::string::npos);
}

}  // namespace
}  // namespace vrdma::cli
