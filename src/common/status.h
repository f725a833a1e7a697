// Status and Result<T>: how errors travel inside vrdma. An error is an errno value plus a
// message; errno is what crosses the verbs boundary, the message is what the first place that
// sees the error logs. No exceptions on the data path.
#pragma once

#include <cerrno>
#include <string>
#include <utility>
#include <variant>

namespace vrdma {

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(int err, std::string msg) : err_(err), msg_(std::move(msg)) {}
  static Status ok() { return {}; }

  bool is_ok() const { return err_ == 0; }
  explicit operator bool() const { return is_ok(); }
  int err() const { return err_; }  ///< positive errno; 0 when ok
  const std::string& message() const { return msg_; }
  /// A guest quota's refusal (quota_error): the backend's error answer flags it, so the
  /// library tells the program which quota instead of only the errno.
  bool quota() const { return quota_; }

 private:
  friend Status quota_error(int err, std::string msg);
  int err_ = 0;
  bool quota_ = false;
  std::string msg_;
};

inline Status error(int err, std::string msg) { return {err, std::move(msg)}; }
/// An error because a guest reached one of the backend's quotas.
inline Status quota_error(int err, std::string msg) {
  Status s(err, std::move(msg));
  s.quota_ = true;
  return s;
}

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status s) : v_(std::move(s)) {}     // NOLINT
  bool is_ok() const { return v_.index() == 0; }
  explicit operator bool() const { return is_ok(); }
  T& value() & { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  const T& value() const& { return std::get<0>(v_); }
  T* operator->() { return &std::get<0>(v_); }
  T& operator*() { return std::get<0>(v_); }
  Status status() const { return is_ok() ? Status{} : std::get<1>(v_); }
  int err() const { return is_ok() ? 0 : std::get<1>(v_).err(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace vrdma

#define VRDMA_CONCAT_INNER(a, b) a##b
#define VRDMA_CONCAT(a, b) VRDMA_CONCAT_INNER(a, b)

/// Returns the Status from the enclosing function when `expr` is not ok.
#define RETURN_IF_ERROR(expr)                  \
  do {                                         \
    ::vrdma::Status _st = (expr);              \
    if (!_st.is_ok()) return _st;              \
  } while (0)

/// `ASSIGN_OR_RETURN(auto x, f())`: binds the value or returns the error.
#define ASSIGN_OR_RETURN(lhs, expr)                                   \
  auto VRDMA_CONCAT(_res_, __LINE__) = (expr);                        \
  if (!VRDMA_CONCAT(_res_, __LINE__).is_ok())                         \
    return VRDMA_CONCAT(_res_, __LINE__).status();                    \
  lhs = std::move(VRDMA_CONCAT(_res_, __LINE__)).value()
