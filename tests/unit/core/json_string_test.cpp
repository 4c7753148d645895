// core/json_string: the escapes of RFC 8259 section 7 that the log and the clients' display write (the expected
// literals are written out by hand from that section), and nlohmann::json parsing each literal back to the input.
#include "core/json_string.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace kiln {
namespace {

TEST(JsonString, EscapesQuotesBackslashesAndControlCharacters) {
  EXPECT_EQ(json_string(""), "\"\"");
  EXPECT_EQ(json_string("plain text"), "\"plain text\"");
  EXPECT_EQ(json_string("say \"hi\""), "\"say \\\"hi\\\"\"");
  EXPECT_EQ(json_string("a\\b"), "\"a\\\\b\"");
  EXPECT_EQ(json_string("1\n2\r3\t4"), "\"1\\n2\\r3\\t4\"");
  EXPECT_EQ(json_string(std::string_view("\x00\x01\x1f", 3)), "\"\\u0000\\u0001\\u001f\"");
}

TEST(JsonString, KeepsDelAndUtf8AsTheyAre) {
  EXPECT_EQ(json_string("\x7f"), "\"\x7f\"");
  EXPECT_EQ(json_string("h\xc3\xa9 \xe2\x82\xac"), "\"h\xc3\xa9 \xe2\x82\xac\"");  // "hé €"
}

TEST(JsonString, ParsesBackToTheInput) {
  const std::string input = std::string("quote \" backslash \\ nl \n bell \x07 nul ") + '\0' + " utf8 \xc3\xa9";
  EXPECT_EQ(nlohmann::json::parse(json_string(input)).get<std::string>(), input);
}

TEST(AppendJsonEscaped, AppendsOneByte) {
  std::string out = "x";
  append_json_escaped(out, '"');
  append_json_escaped(out, '\b');
  append_json_escaped(out, 'y');
  EXPECT_EQ(out, "x\\\"\\u0008y");
}

}  // namespace
}  // namespace kiln
