// kiln: one binary, many subcommands (see command.h for how they register).
#include <algorithm>
#include <cstdio>
#include <map>

#include "cli/command.h"
#include "cli/environment.h"
#include "core/error.h"
#include "core/log.h"
#include "core/thread_pool.h"

namespace kiln::cli {
std::vector<CommandSpec>& registry() {
  static std::vector<CommandSpec> r;
  return r;
}
}  // namespace kiln::cli

int main(int argc, char** argv) {
  using namespace kiln;
  CLI::App app{"kiln: an inference server for Mixture-of-Experts language models (NVFP4, Qwen3.5 family)"};
  app.set_version_flag("--version", "kiln 0.1.0");
  app.require_subcommand(1);
  // Options of the top level (--log-level) may also follow the subcommand: kiln serve --log-level debug.
  app.fallthrough();
  std::string log_level;
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error or off (default info; env KILN_LOG)");

  auto& specs = cli::registry();
  std::sort(specs.begin(), specs.end(), [](auto& a, auto& b) { return a.name < b.name; });
  std::map<CLI::App*, cli::RunFn> runs;
  for (auto& spec : specs) {
    CLI::App* sub = app.add_subcommand(spec.name, spec.help);
    runs[sub] = spec.setup(*sub);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  // The environment is read here only (cli/environment.h): KILN_LOG under --log-level, KILN_THREADS under a
  // command's --threads (which sets the pool again before it starts).
  const cli::EnvLookup env = cli::process_env();
  const std::optional<LogLevel> level = cli::resolve_log_level(log_level, env);
  if (!level) {
    std::fprintf(stderr, "error: unknown --log-level '%s' (use trace, debug, info, warn, error or off)\n", log_level.c_str());
    return 2;
  }
  set_log_level(*level);
  if (const int threads = cli::threads_from_env(env); threads > 0) ThreadPool::set_global_threads(threads);
  try {
    for (auto& [sub, run] : runs)
      if (sub->parsed()) return run();
  } catch (const InternalError& e) {
    std::fprintf(stderr, "error: %s\n(this is a bug in kiln; please report it with the command you ran)\n", e.what());
    return 70;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "error: out of host memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
