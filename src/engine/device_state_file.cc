// A snapshot file against the guest's device now (backend/migrate.cc's restore): the layout of
// descriptors both must have, and the file's state with the guest's own completion rings of the
// direct path, which a grant made after the snapshot adds. Split from device_state_import.cc.
#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "engine/objects.h"

namespace vrdma::engine {

using json = nlohmann::json;

Result<std::string> state_fd_layout(std::span<const uint8_t> blob) {
  json doc = json::from_cbor(blob.begin(), blob.end(), true, false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("fdkeys") ||
      !doc.contains("name") || !doc["name"].is_string())
    return error(EINVAL, "not a vrdma device state");
  // The QPs' own rings (version 7) come last and are not compared: a grant made after a
  // snapshot adds them, and a restore keeps the guest's (with_own_rings_of).
  json keys = json::array();
  for (const json& k : doc["fdkeys"]) {
    if (!k.is_string() || k.get_ref<const std::string&>().find(".own_") == std::string::npos)
      keys.push_back(k);
  }
  return doc["name"].get<std::string>() + "\n" + keys.dump();
}

namespace {

Result<std::vector<uint8_t>> with_own_rings_impl(std::span<const uint8_t> file,
                                                 std::span<const uint8_t> now) {
  json f = json::from_cbor(file.begin(), file.end(), true, false);
  const json n = json::from_cbor(now.begin(), now.end(), true, false);
  if (f.is_discarded() || n.is_discarded() || !f.is_object() || !n.is_object())
    return error(EINVAL, "not a vrdma device state");
  const auto own = [](const json& jq) {
    return jq.contains("own_send") || jq.contains("own_recv");
  };
  const auto version = f.value("version", 0u);
  bool any = false;
  for (const json& js : n.value("sessions", json::array()))
    for (const json& jq : js.value("qps", json::array())) any = any || own(jq);
  if (!any) return std::vector<uint8_t>(file.begin(), file.end());
  if (version < 7)
    return error(EINVAL,
                 "the snapshot is of an older version, without the QPs' own completion "
                 "rings, which this guest has now (it used the direct path since)");
  json& fs = f["sessions"];
  const json& ns = n["sessions"];
  if (!fs.is_array() || !ns.is_array() || fs.size() != ns.size())
    return error(EINVAL, "the snapshot's sessions are not the guest's");
  for (size_t i = 0; i < fs.size(); ++i) {
    json& fq = fs[i]["qps"];
    const json& nq = ns[i]["qps"];
    if (!fq.is_array() || !nq.is_array() || fq.size() != nq.size())
      return error(EINVAL, "the snapshot's QPs are not the guest's");
    for (size_t k = 0; k < fq.size(); ++k) {
      if (fq[k].value("h", 0u) != nq[k].value("h", 1u))
        return error(EINVAL, "the snapshot's QPs are not the guest's");
      for (const char* key : {"own_send", "own_recv"}) {
        fq[k].erase(key);
        if (nq[k].contains(key)) fq[k][key] = nq[k][key];
      }
    }
  }
  // The descriptors: the file's up to its own rings, which are the guest's now (the same
  // layout before them: state_fd_layout), then the guest's own rings, where they are now.
  json keys = json::array();
  for (const json& k : f["fdkeys"])
    if (k.is_string() && k.get_ref<const std::string&>().find(".own_") == std::string::npos)
      keys.push_back(k);
  for (const json& k : n["fdkeys"])
    if (k.is_string() && k.get_ref<const std::string&>().find(".own_") != std::string::npos)
      keys.push_back(k);
  f["fdkeys"] = std::move(keys);
  return json::to_cbor(f);
}

}  // namespace

Result<std::vector<uint8_t>> with_own_rings_of(std::span<const uint8_t> file,
                                               std::span<const uint8_t> now) {
  // A snapshot file is the operator's, not ours: a field of an unexpected type is an error.
  try {
    return with_own_rings_impl(file, now);
  } catch (const json::exception& e) {
    return error(EINVAL, fmt::format("state: {}", e.what()));
  }
}

}  // namespace vrdma::engine
