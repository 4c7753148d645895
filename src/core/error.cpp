#include "core/error.h"

#include <cstring>

namespace kiln {

[[noreturn]] void throw_internal(const char* file, int line, const char* cond, const std::string& msg) {
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  std::string text = fmt::format("internal error at {}:{}: check `{}` failed", base, line, cond);
  if (!msg.empty()) text += ": " + msg;
  throw InternalError(text);
}

}  // namespace kiln
