// kiln smoke: does an OpenAI-compatible server answer correctly? (see clients/smoke.h)
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "cli/client_command.h"
#include "cli/command.h"
#include "cli/environment.h"
#include "clients/smoke.h"
#include "core/error.h"

namespace {

struct SmokeArgs {
  kiln::cli::ClientFlags client{.timeout_s = 300};
  std::string tests;
  double baseline = 0;
};

kiln::cli::Registrar reg{"smoke", "Check that an OpenAI-compatible server answers correctly (any server)", [](CLI::App& app) {
  auto args = std::make_shared<SmokeArgs>();
  std::string checks;
  for (const auto& name : kiln::clients::smoke_check_names()) checks += (checks.empty() ? "" : ",") + name;
  kiln::cli::add_client_flags(app, args->client, "Also write a machine-readable report to FILE");
  app.add_option("--tests", args->tests, "Comma list of checks to run (default all: " + checks + ")");
  app.add_option("--baseline", args->baseline, "Reference tok/s: the throughput check prints the ratio to it");
  return [args]() -> int {
    using namespace kiln::clients;
    SmokeOptions options;
    options.server = kiln::cli::client_server_address(args->client);
    options.model = args->client.model;
    if (!args->tests.empty()) options.checks = parse_check_list(args->tests);
    if (args->baseline < 0) kiln::fail("--baseline must be a positive tok/s figure (got {})", args->baseline);
    if (args->baseline > 0) options.baseline_tok_s = args->baseline;
    kiln::cli::JsonOutputFile json_file(args->client.json_path, "report");
    SmokeReport report = run_smoke(options, stdout);
    json_file.write(report.to_json());
    return report.passed() ? 0 : 1;
  };
}};

}  // namespace
