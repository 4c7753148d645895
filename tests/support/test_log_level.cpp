// Every test binary's log level: KILN_LOG (ctest sets warn) as `kiln` itself reads it. The library reads no
// environment (src/cli/environment does that for the binary), so the test binaries read it here, before main.
#include <cstdlib>

#include "core/log.h"

namespace {
const bool kLogLevelSet = [] {
  kiln::LogLevel level;
  if (const char* v = std::getenv("KILN_LOG"); v && kiln::parse_log_level(v, &level)) kiln::set_log_level(level);
  return true;
}();
}  // namespace
