#include "server/body_fields.h"

#include <algorithm>

#include "server/api_error.h"

namespace kiln::server {

void check_known_fields(const ojson& body, std::span<const std::string_view> known, const char* route) {
  for (const auto& [key, value] : body.items()) {
    if (value.is_null() || std::find(known.begin(), known.end(), key) != known.end()) continue;
    throw ApiError(400, "'" + key + "' is not supported by kiln's " + route + " (it would have no effect); remove it",
                   key, "unsupported_parameter");
  }
}

std::string item_path(const std::string& where, size_t i) { return where + "[" + std::to_string(i) + "]"; }

const ojson& typed_field(const ojson& obj, const char* name, const std::string& where, bool (ojson::*is)() const,
                         const char* what) {
  auto it = obj.find(name);
  if (it == obj.end() || !((*it).*is)())
    throw bad_param(where + "." + name, "'" + where + "." + name + "' must be " + what);
  return *it;
}

std::string string_field(const ojson& obj, const char* name, const std::string& where) {
  return typed_field(obj, name, where, &ojson::is_string, "a string").get<std::string>();
}

std::string joined_text(const ojson& v, const std::string& where, const char* list_what,
                        const std::function<std::string(const ojson& item, const std::string& path)>& item_text) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) throw bad_param(where, "'" + where + "' must be a string or " + list_what);
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    std::string text = item_text(v[i], item_path(where, i));
    if (!out.empty()) out += "\n";
    out += text;
  }
  return out;
}

ojson chat_function_tools(const ojson& tools,
                          const std::function<ojson(const ojson& tool, const std::string& path)>& function_of) {
  if (!tools.is_array()) throw bad_param("tools", "'tools' must be a list");
  ojson out = ojson::array();
  for (size_t i = 0; i < tools.size(); ++i)
    out.push_back({{"type", "function"}, {"function", function_of(tools[i], item_path("tools", i))}});
  return out;
}

}  // namespace kiln::server
