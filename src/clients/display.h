// Text as smoke/bench print it: one line, quoted, escaped, cut to a length.
#pragma once
#include <string>
#include <string_view>

namespace kiln::clients {

// "text" with \n, \t, \", control characters and NUL escaped; longer than max_chars: cut and marked
// with the full length ("...(1234 bytes)").
std::string quote_for_display(std::string_view text, size_t max_chars = 100);
// Leading and trailing whitespace removed.
std::string_view trim(std::string_view text);

}  // namespace kiln::clients
