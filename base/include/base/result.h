// Result<T>: a value or a std::error_code. Public functions of the project return it instead of
// throwing; exceptions stop at the edges (main, JSON parsing). g++ 12 has no std::expected, so
// this is the small subset we use.
#pragma once

#include <cassert>
#include <cerrno>
#include <system_error>
#include <type_traits>
#include <utility>
#include <variant>

namespace base {

// Builds an error_code in the generic (errno) category; the project speaks errno like the kernel.
inline std::error_code errc(int e) { return {e, std::generic_category()}; }
inline std::error_code errc(std::errc e) { return std::make_error_code(e); }

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::in_place_index<0>, std::move(value)) {}  // NOLINT: implicit by design
  Result(std::error_code ec) : v_(std::in_place_index<1>, ec) { assert(ec); }  // NOLINT

  bool ok() const { return v_.index() == 0; }
  explicit operator bool() const { return ok(); }

  std::error_code error() const { return ok() ? std::error_code{} : std::get<1>(v_); }

  T& value() & { assert(ok()); return std::get<0>(v_); }
  const T& value() const& { assert(ok()); return std::get<0>(v_); }
  T&& value() && { assert(ok()); return std::get<0>(std::move(v_)); }

  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T&& operator*() && { return std::move(*this).value(); }

 private:
  std::variant<T, std::error_code> v_;
};

template <>
class [[nodiscard]] Result<void> {
 public:
  Result() = default;
  Result(std::error_code ec) : ec_(ec) {}  // NOLINT: implicit by design

  bool ok() const { return !ec_; }
  explicit operator bool() const { return ok(); }
  std::error_code error() const { return ec_; }

 private:
  std::error_code ec_;
};

using Status = Result<void>;

}  // namespace base

// Propagates an error from an expression returning Result<...>.
#define BASE_TRY(expr)                                   \
  do {                                                    \
    auto base_try_r_ = (expr);                           \
    if (!base_try_r_.ok()) return base_try_r_.error();  \
  } while (0)

#define BASE_CONCAT_INNER_(a, b) a##b
#define BASE_CONCAT_(a, b) BASE_CONCAT_INNER_(a, b)
// Declares `lhs` from the value of a Result, or returns its error.
#define BASE_ASSIGN_OR_RETURN(lhs, expr)                                 \
  auto BASE_CONCAT_(base_r_, __LINE__) = (expr);                        \
  if (!BASE_CONCAT_(base_r_, __LINE__).ok())                            \
    return BASE_CONCAT_(base_r_, __LINE__).error();                     \
  lhs = std::move(BASE_CONCAT_(base_r_, __LINE__)).value()
