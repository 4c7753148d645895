// Errors. Two kinds:
//  - kiln::Error: a user-facing failure (bad file, bad flag, bad request). what() is one clear line
//    that says what is wrong and, where possible, what to do.
//  - kiln::InternalError: a broken invariant (a bug), raised by KILN_CHECK with file:line.
// Both derive from std::runtime_error; nothing else is thrown across layers.
#pragma once
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace kiln {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

class InternalError : public Error {
 public:
  explicit InternalError(const std::string& msg) : Error(msg) {}
};

[[noreturn]] void throw_internal(const char* file, int line, const char* cond, const std::string& msg);

// Throws kiln::Error with a formatted message: kiln::fail("{}: header too large", path).
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace kiln

// KILN_CHECK(cond) or KILN_CHECK(cond, "fmt {}", args...): throws kiln::InternalError with file:line.
#define KILN_CHECK(cond, ...)                                                                 \
  do {                                                                                        \
    if (!(cond)) [[unlikely]]                                                                 \
      ::kiln::throw_internal(__FILE__, __LINE__, #cond, ::kiln::detail::check_msg(__VA_ARGS__)); \
  } while (0)

namespace kiln::detail {
inline std::string check_msg() { return {}; }
template <typename... Args>
std::string check_msg(fmt::format_string<Args...> f, Args&&... args) {
  return fmt::format(f, std::forward<Args>(args)...);
}
}  // namespace kiln::detail
