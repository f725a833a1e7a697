// The rows a status document leaves out (above 1000 QPs, Device::report without lists; or a
// rendered document still over the response limit, backend/report.cc `summarised`): how many of
// each kind, per guest, as the document's `res_omitted` rows, so that each viewer is shown the
// counts of its own guests only (visible_status cuts them as it cuts `res`).
#pragma once

#include <cstddef>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace vrdma::engine {

class OmittedRows {
 public:
  /// `n` more rows of kind `type` (`qp`, `mr`, ...) of guest `guest` left out.
  void add(const std::string& guest, const std::string& type, size_t n) {
    if (n) by_guest_[guest][type] += n;
  }
  /// `res_omitted`: one row per guest with any, `{"guest": NAME, TYPE: N, ...}` (possibly none:
  /// its presence says that the lists were left out).
  nlohmann::json rows() const {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& [guest, counts] : by_guest_) {
      nlohmann::json row{{"guest", guest}};
      for (const auto& [type, n] : counts) row[type] = n;
      out.push_back(std::move(row));
    }
    return out;
  }

 private:
  std::map<std::string, std::map<std::string, size_t>> by_guest_;
};

}  // namespace vrdma::engine
