// What the backend tells operators about itself and its device: the status document that
// `vrdma status`, `vrdma res show` and `vrdma stat` read (the Status command), and the same
// numbers as Prometheus text for the metrics endpoint. Owned by the engine (server) thread.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "backend/config.h"
#include "engine/device.h"

namespace vrdma::backend {

class Reporter {
 public:
  explicit Reporter(const Config& cfg);
  /// The whole status document: `backend` (version, uptime, quotas, transports, peers, the
  /// data-path thread), the device's guests and totals, `res` and `guest_counters`.
  nlohmann::json status(const engine::Device& dev);
  /// Prometheus text exposition format 0.0.4 of the same document.
  std::string metrics(const engine::Device& dev);

 private:
  nlohmann::json backend_info();

  const Config& cfg_;
  uint64_t start_wall_s_;
  uint64_t start_mono_ns_;
  uint64_t last_mono_ns_;  ///< previous sample, for the recent busy fraction
  uint64_t last_cpu_ns_;
};

/// Renders a status document (as Reporter::status builds it) as Prometheus text.
std::string prometheus_text(const nlohmann::json& status);

}  // namespace vrdma::backend
