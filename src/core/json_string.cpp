#include "core/json_string.h"

#include <fmt/format.h>

namespace kiln {

void append_json_escaped(std::string& out, unsigned char c) {
  switch (c) {
    case '"': out += "\\\""; break;
    case '\\': out += "\\\\"; break;
    case '\n': out += "\\n"; break;
    case '\r': out += "\\r"; break;
    case '\t': out += "\\t"; break;
    default:
      if (c < 0x20) out += fmt::format("\\u{:04x}", c);
      else out += static_cast<char>(c);
  }
}

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) append_json_escaped(out, c);
  return out + "\"";
}

}  // namespace kiln
