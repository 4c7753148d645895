#include "cli/client_command.h"

#include "core/error.h"

namespace kiln::cli {

clients::ServerAddress client_server_address(const std::string& url, const std::string& api_key_flag, double timeout_s,
                                             const EnvLookup& env) {
  return clients::parse_server_url(url, resolve_api_key(api_key_flag, env), timeout_s);
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
