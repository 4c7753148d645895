// JSON string escaping of UTF-8 text: the log's JSON lines (core/log.cpp) and the clients' display of model output
// (clients/display.h) escape the same way.
#pragma once
#include <string>
#include <string_view>

namespace kiln {

// Appends byte c as it stands inside a JSON string literal: '"', '\\', '\n', '\r' and '\t' as two-character escapes,
// other control characters (< 0x20) as \u00xx, every other byte (0x7F and bytes >= 0x80 included) as it is.
void append_json_escaped(std::string& out, unsigned char c);

// s as a JSON string literal, quotes included (bytes >= 0x80 kept as they are: UTF-8 text stays UTF-8).
std::string json_string(std::string_view s);

}  // namespace kiln
