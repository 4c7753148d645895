#include "cli/command.h"
#include <cstdio>

namespace {
kiln::cli::Registrar reg{"version", "Print the kiln version and build options", [](CLI::App&) {
  return []() -> int {
    std::printf("kiln 0.1.0\n");
#ifdef KILN_HAVE_CUDA
    std::printf("cuda backend: built\n");
#else
    std::printf("cuda backend: not built\n");
#endif
    return 0;
  };
}};
}  // namespace
