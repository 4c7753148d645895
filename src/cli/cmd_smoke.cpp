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
  std::string url = "http://127.0.0.1:30000";
  std::string api_key;
  std::string model;
  std::string json_path;
  std::string tests;
  double baseline = 0;
  double timeout_s = 300;
};

kiln::cli::Registrar reg{"smoke", "Check that an OpenAI-compatible server answers correctly (any server)", [](CLI::App& app) {
  auto args = std::make_shared<SmokeArgs>();
  std::string checks;
  for (const auto& name : kiln::clients::smoke_check_names()) checks += (checks.empty() ? "" : ",") + name;
  app.add_option("--url", args->url, "Server base URL")->capture_default_str();
  app.add_option("--api-key", args->api_key, "Bearer token (default: $OPENAI_API_KEY)");
  app.add_option("--model", args->model, "Model name to send (default: the first of GET /v1/models)");
  app.add_option("--json", args->json_path, "Also write a machine-readable report to FILE");
  app.add_option("--tests", args->tests, "Comma list of checks to run (default all: " + checks + ")");
  app.add_option("--baseline", args->baseline, "Reference tok/s: the throughput check prints the ratio to it");
  app.add_option("--timeout", args->timeout_s, "Seconds to wait for the next byte of any response")
      ->capture_default_str();
  return [args]() -> int {
    using namespace kiln::clients;
    SmokeOptions options;
    options.server = kiln::cli::client_server_address(args->url, args->api_key, args->timeout_s,
                                                      kiln::cli::process_env());
    options.model = args->model;
    if (!args->tests.empty()) options.checks = parse_check_list(args->tests);
    if (args->baseline < 0) kiln::fail("--baseline must be a positive tok/s figure (got {})", args->baseline);
    if (args->baseline > 0) options.baseline_tok_s = args->baseline;
    kiln::cli::JsonOutputFile json_file(args->json_path, "report");
    SmokeReport report = run_smoke(options, stdout);
    json_file.write(report.to_json());
    return report.passed() ? 0 : 1;
  };
}};

}  // namespace
