#include "clients/display.h"

#include <fmt/format.h>

#include "core/json_string.h"

namespace kiln::clients {

std::string quote_for_display(std::string_view text, size_t max_chars) {
  std::string out = "\"";
  size_t shown = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (shown >= max_chars) {
      // Do not cut a UTF-8 character in half.
      while (i < text.size() && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) out += text[i++];
      if (i == text.size()) break;
      return out + fmt::format("\"...({} bytes)", text.size());
    }
    unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == 0x7F) out += "\\u007f";  // DEL: shown escaped, though JSON keeps it as it is
    else append_json_escaped(out, c);
    if ((c & 0xC0) != 0x80) ++shown;
  }
  return out + "\"";
}

std::string_view trim(std::string_view text) {
  const char* space = " \t\r\n\f\v";
  size_t begin = text.find_first_not_of(space);
  if (begin == std::string_view::npos) return {};
  size_t end = text.find_last_not_of(space);
  return text.substr(begin, end - begin + 1);
}

}  // namespace kiln::clients
