// The device-state importer's reader (internal to engine/device_state_import*.cc and
// device_state_direct.cc, which has the exporter's part too): the blob's
// fields, each checked as it is read (EINVAL naming it), and the descriptors sent beside the blob,
// each taken at most once. One import uses one Importer, whatever file reads a kind of resource.
#pragma once

#include <fmt/format.h>

#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "common/memfd.h"
#include "common/status.h"
#include "engine/device.h"

namespace vrdma::engine::state {

using json = nlohmann::json;

/// A field of the blob, or EINVAL naming it.
struct Reader {
  Status st = Status::ok();

  template <typename T>
  T num(const json& j, const char* key) {
    if (!st.is_ok()) return T{};
    auto it = j.find(key);
    if (it == j.end() || !it->is_number_integer()) {
      st = error(EINVAL, fmt::format("state: field '{}' missing or not an integer", key));
      return T{};
    }
    if constexpr (std::is_signed_v<T>) {
      return it->template get<T>();
    } else {
      if (it->is_number_integer() && it->template get<int64_t>() < 0 && !it->is_number_unsigned()) {
        st = error(EINVAL, fmt::format("state: field '{}' is negative", key));
        return T{};
      }
      const uint64_t v = it->template get<uint64_t>();
      if (v > std::numeric_limits<T>::max()) {
        st = error(EINVAL, fmt::format("state: field '{}' out of range", key));
        return T{};
      }
      return static_cast<T>(v);
    }
  }

  /// `older`: the size an older version wrote, a prefix of T (the rest stays zero).
  template <typename T>
  T pod(const json& j, const char* key, size_t older = sizeof(T)) {
    T out{};
    if (!st.is_ok()) return out;
    auto it = j.find(key);
    const size_t n = it == j.end() || !it->is_binary() ? 0 : it->get_binary().size();
    if (n == 0 || (n != sizeof(T) && n != older)) {
      st = error(EINVAL, fmt::format("state: field '{}' missing or of the wrong size", key));
      return out;
    }
    std::memcpy(&out, it->get_binary().data(), n);
    return out;
  }

  const json& arr(const json& j, const char* key) {
    static const json empty = json::array();
    if (!st.is_ok()) return empty;
    auto it = j.find(key);
    if (it == j.end() || !it->is_array()) {
      st = error(EINVAL, fmt::format("state: list '{}' missing", key));
      return empty;
    }
    return *it;
  }

  std::string str(const json& j, const char* key) {
    if (!st.is_ok()) return {};
    auto it = j.find(key);
    if (it == j.end() || !it->is_string()) {
      st = error(EINVAL, fmt::format("state: field '{}' missing or not a string", key));
      return {};
    }
    return it->get<std::string>();
  }

  void fail(std::string why) {
    if (st.is_ok()) st = error(EINVAL, "state: " + why);
  }
};

/// One import's state while it reads a blob: the reader of its fields, and the descriptors sent
/// beside it, each taken at most once.
struct Importer {
  Reader rd;
  std::vector<UniqueFd>& fds;
  std::vector<bool> taken;
  size_t counters_size = sizeof(QpCounters);  ///< as the blob's version wrote QpCounters

  explicit Importer(std::vector<UniqueFd>& given) : fds(given), taken(given.size(), false) {}

  /// Takes descriptor `key` of `j` (each index at most once); -1 allowed when `optional`.
  UniqueFd take(const json& j, const char* key, bool optional = false) {
    const int64_t i = rd.num<int64_t>(j, key);
    if (!rd.st.is_ok()) return {};
    if (i < 0 && optional) return {};
    if (i < 0 || static_cast<size_t>(i) >= fds.size() || taken[i] || !fds[i].valid()) {
      rd.fail(fmt::format("descriptor '{}' = {} not given (or given twice)", key, i));
      return {};
    }
    taken[i] = true;
    return std::move(fds[i]);
  }

  MappedRegion map_memfd(UniqueFd& f, size_t bytes, const char* what) {
    if (!rd.st.is_ok()) return {};
    if (Status st = check_sealed_memfd(f.get(), bytes); !st.is_ok()) {
      rd.fail(fmt::format("{}: {}", what, st.message()));
      return {};
    }
    MappedRegion m = MappedRegion::map_shared(f.get(), bytes);
    if (!m.valid()) rd.fail(fmt::format("mapping {}: {}", what, std::strerror(errno)));
    return m;
  }

  /// A handle of session `s`: from 1 up to (not including) its next_handle.
  void handle_ok(const Session& s, uint32_t h, const char* what) {
    if (h == 0 || h >= s.next_handle) rd.fail(fmt::format("{} handle {} out of range", what, h));
  }
};

/// What a QP's entry says besides the QP's own fields: read with them, checked, then linked.
struct QpRefs {
  uint32_t type = 0, state = 0, wait = 0;
  uint32_t scq = 0, rcq = 0, srq = proto::kNone;
};

/// A QP's fields as the blob has them, and what it names (`refs`): device_state_import.cc.
std::unique_ptr<Qp> read_qp(Importer& im, const json& jq, QpRefs& refs);

// XRC (version 8; device_state_import_xrc.cc). Nothing is read from an older blob.
/// The guest's XRC domains, before its sessions (whose SRQs name them).
void import_xrcds(Importer& im, const json& doc, Guest& g, uint32_t version);
/// An SRQ entry's XRC fields (domain, number, CQ of session `s`), when it has them.
void import_xrc_srq(Importer& im, const json& jq, Srq& q, Session& s, Guest& g);
/// After the sessions: the guest's receive QPs, the sessions' handles on them and on the
/// domains, and the use counts recounted from those references.
void import_xrc_holds(Importer& im, const json& doc,
                      const std::vector<std::unique_ptr<Session>>& sessions, Guest& g,
                      uint32_t version);

// The direct path (device_state_direct.cc).
/// A session entry's `rx_tags` (an older blob has none): the rx_lock tags its library may still
/// hold from the backends it comes from (Session::kept_rx_tags), newest first.
void import_rx_tags(Reader& rd, const json& js, Session& s);

// The direct path across backends (version 9, keep_state only; device_state_direct.cc).
/// Writes what the backend knows of the guest's QPs on the direct path across backends and the
/// peers' offers it holds (`direct_qps`, `direct_offers`): a keeper's blob only.
void export_direct(const Guest& g, json& doc);
/// After the sessions: the same back onto the guest's QPs (their own rings read already). Only
/// when `recover`: a guest that moves left the direct path first.
void import_direct(Importer& im, const json& doc, Guest& g, uint32_t version, bool recover);

}  // namespace vrdma::engine::state
