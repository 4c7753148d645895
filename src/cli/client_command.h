// What the client subcommands (kiln smoke, kiln bench) share: their --url / --api-key / --model / --timeout / --json
// flags, the server address from them, and the --json FILE they write their results to (opened before the run, so
// that a typo in its path does not cost a whole run).
#pragma once
#include <CLI/CLI.hpp>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/environment.h"
#include "clients/http.h"

namespace kiln::cli {

// parse_server_url(url) with the key of resolve_api_key(api_key_flag, env); kiln::Error for a bad URL.
clients::ServerAddress client_server_address(const std::string& url, const std::string& api_key_flag, double timeout_s,
                                             const EnvLookup& env);

// The flags every client subcommand takes; timeout_s starts at the subcommand's default.
struct ClientFlags {
  std::string url = "http://127.0.0.1:30000";
  std::string api_key;
  std::string model;
  std::string json_path;
  double timeout_s = 300;
};
// Adds --url, --api-key, --model, --json (json_help: what it writes, e.g. "Also write the results to FILE") and
// --timeout to `app`, read into `flags`.
void add_client_flags(CLI::App& app, ClientFlags& flags, const std::string& json_help);
// client_server_address of the flags and the process environment.
clients::ServerAddress client_server_address(const ClientFlags& flags);

// The --json FILE of a client subcommand; `what` names its content in errors ("results", "report"). An empty path
// writes nothing.
class JsonOutputFile {
 public:
  // Opens (truncates) `path`; kiln::Error when it cannot be written.
  JsonOutputFile(const std::string& path, std::string what);
  // Writes `j` (indented, invalid UTF-8 replaced) and a newline; kiln::Error when the write fails.
  void write(const nlohmann::json& j);

 private:
  std::string path_, what_;
  std::ofstream file_;
};

}  // namespace kiln::cli
