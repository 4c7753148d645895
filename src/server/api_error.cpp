#include "server/api_error.h"

#include <nlohmann/json.hpp>

namespace kiln::server {

namespace {
std::string default_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 413: return "invalid_request_error";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}
}  // namespace

ApiError::ApiError(int status_, std::string message, std::string param_, std::string code_, std::string type_)
    : std::runtime_error(std::move(message)),
      status(status_),
      type(type_.empty() ? default_type(status_) : std::move(type_)),
      param(std::move(param_)),
      code(std::move(code_)) {}

ApiError bad_param(const std::string& param, const std::string& message) {
  return ApiError(400, message, param, "invalid_value");
}

std::string error_body(int status, const std::string& message, const std::string& type, const std::string& param,
                       const std::string& code) {
  nlohmann::json err = {{"message", message},
                        {"type", type.empty() ? default_type(status) : type},
                        {"param", param.empty() ? nlohmann::json(nullptr) : nlohmann::json(param)},
                        {"code", code.empty() ? nlohmann::json(nullptr) : nlohmann::json(code)}};
  return nlohmann::json{{"error", err}}.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string error_body(const ApiError& e) { return error_body(e.status, e.what(), e.type, e.param, e.code); }

std::string anthropic_error_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503: return "overloaded_error";
    default: return status >= 500 ? "api_error" : "invalid_request_error";
  }
}

nlohmann::json anthropic_error_json(int status, const std::string& message) {
  return {{"type", "error"}, {"error", {{"type", anthropic_error_type(status)}, {"message", message}}}};
}

std::string error_body(const ApiError& e, ErrorStyle style) {
  if (style == ErrorStyle::openai) return error_body(e);
  return anthropic_error_json(e.status, e.what()).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace kiln::server
