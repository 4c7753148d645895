// An HTTP API failure in OpenAI's error form:
//   {"error": {"message": ..., "type": ..., "param": ..., "code": ...}} with an HTTP status.
#pragma once
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

}  // namespace kiln::server
