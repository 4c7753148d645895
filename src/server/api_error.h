// An HTTP API failure with its status, rendered in OpenAI's error form
//   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
// or, for the Anthropic Messages routes, in Anthropic's
//   {"type": "error", "error": {"type": ..., "message": ...}}.
#pragma once
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace kiln::server {

struct ApiError : std::runtime_error {
  int status;
  std::string type;
  std::string param;  // "" -> null
  std::string code;   // "" -> null

  ApiError(int status, std::string message, std::string param = "", std::string code = "",
           std::string type = "");
};

// 400 invalid_request_error naming the parameter.
ApiError bad_param(const std::string& param, const std::string& message);

// The JSON body for an error.
std::string error_body(int status, const std::string& message, const std::string& type = "",
                       const std::string& param = "", const std::string& code = "");
std::string error_body(const ApiError& e);

enum class ErrorStyle { openai, anthropic };

// Anthropic's error type for a status: invalid_request_error, authentication_error, not_found_error,
// request_too_large, rate_limit_error, overloaded_error (503), api_error (other 5xx).
std::string anthropic_error_type(int status);
nlohmann::json anthropic_error_json(int status, const std::string& message);
// The body for an error in the given style.
std::string error_body(const ApiError& e, ErrorStyle style);

}  // namespace kiln::server
