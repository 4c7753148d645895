// UTF-8 helpers for Python-compatible string semantics (code point indexing, str.isspace, case).
#pragma once
#include <string>
#include <string_view>
#include <vector>

namespace kiln::tmpl::jinja::unicode {

// Decodes UTF-8 into code points. Invalid bytes map to U+DC80+byte (Python's surrogateescape), so
// encode(decode(s)) == s for any input.
std::u32string decode(std::string_view s);
void append_utf8(std::string& out, char32_t cp);
std::string encode(std::u32string_view cps);

size_t length(std::string_view s);  // number of code points
bool is_ascii(std::string_view s);
// Byte offset of each code point, plus s.size() at the end.
std::vector<size_t> code_point_offsets(std::string_view s);

bool is_space(char32_t c);      // Python's str.isspace
bool is_printable(char32_t c);  // approximation of Python's str.isprintable, for repr()
char32_t to_lower(char32_t c);
char32_t to_upper(char32_t c);
bool is_alpha(char32_t c);
bool is_digit(char32_t c);
bool is_alnum(char32_t c);

std::string lower(std::string_view s);
std::string upper(std::string_view s);

}  // namespace kiln::tmpl::jinja::unicode
