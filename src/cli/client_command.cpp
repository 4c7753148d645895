#include "cli/client_command.h"

#include "core/error.h"

namespace kiln::cli {

clients::ServerAddress client_server_address(const std::string& url, const std::string& api_key_flag, double timeout_s,
                                             const EnvLookup& env) {
  return clients::parse_server_url(url, resolve_api_key(api_key_flag, env), timeout_s);
}

void add_client_flags(CLI::App& app, ClientFlags& flags, const std::string& json_help) {
  app.add_option("--url", flags.url, "Server base URL")->capture_default_str();
  app.add_option("--api-key", flags.api_key, "Bearer token (default: $OPENAI_API_KEY)");
  app.add_option("--model", flags.model, "Model name to send (default: the first of GET /v1/models)");
  app.add_option("--json", flags.json_path, json_help);
  app.add_option("--timeout", flags.timeout_s, "Seconds to wait for the next byte of any response")
      ->capture_default_str();
}

clients::ServerAddress client_server_address(const ClientFlags& flags) {
  return client_server_address(flags.url, flags.api_key, flags.timeout_s, process_env());
}

JsonOutputFile::JsonOutputFile(const std::string& path, std::string what) : path_(path), what_(std::move(what)) {
  if (path_.empty()) return;
  file_.open(path_);
  if (!file_) fail("cannot write the --json {} to '{}'", what_, path_);
}

void JsonOutputFile::write(const nlohmann::json& j) {
  if (!file_.is_open()) return;
  file_ << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  file_.flush();
  if (!file_) fail("writing the --json {} to '{}' failed", what_, path_);
}

}  // namespace kiln::cli
