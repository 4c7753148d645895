// server/body_fields: the checked reads that the Messages and Responses translations share, with the paths and
// messages of their errors.
#include "server/body_fields.h"

#include <gtest/gtest.h>

#include <string_view>

#include "server/api_error.h"

namespace kiln::server {
namespace {

// The message of the ApiError that f throws (its param must be `param`).
template <class F>
std::string error_of(F f, const std::string& param) {
  try {
    f();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, param);
    return e.what();
  }
  ADD_FAILURE() << "no ApiError";
  return "";
}

TEST(BodyFields, ItemPath) { EXPECT_EQ(item_path("messages", 3), "messages[3]"); }

TEST(BodyFields, TypedAndStringFields) {
  const ojson obj = {{"name", "f"}, {"schema", {{"type", "object"}}}, {"n", 1}};
  EXPECT_EQ(string_field(obj, "name", "tools[0]"), "f");
  EXPECT_EQ(typed_field(obj, "schema", "tools[0]", &ojson::is_object, "an object")["type"], "object");
  EXPECT_EQ(error_of([&] { string_field(obj, "n", "tools[0]"); }, "tools[0].n"), "'tools[0].n' must be a string");
  EXPECT_EQ(error_of([&] { typed_field(obj, "missing", "x", &ojson::is_object, "an object"); }, "x.missing"),
            "'x.missing' must be an object");
}

TEST(BodyFields, JoinedTextOfAStringOrAList) {
  auto text = [](const ojson& item, const std::string& path) {
    if (!item.is_string()) throw bad_param(path, "'" + path + "' is no string");
    return item.get<std::string>();
  };
  EXPECT_EQ(joined_text("one", "system", "a list", text), "one");
  EXPECT_EQ(joined_text(ojson::array({"a", "b", "c"}), "system", "a list", text), "a\nb\nc");
  EXPECT_EQ(joined_text(ojson::array({"", "b"}), "system", "a list", text), "b");  // no newline before the first text
  EXPECT_EQ(joined_text(ojson::array(), "system", "a list", text), "");
  EXPECT_EQ(error_of([&] { joined_text(7, "system", "a list of blocks", text); }, "system"),
            "'system' must be a string or a list of blocks");
  EXPECT_EQ(error_of([&] { joined_text(ojson::array({"a", 2}), "system", "a list", text); }, "system[1]"),
            "'system[1]' is no string");
}

TEST(BodyFields, ChatFunctionToolsWrapsEachFunction) {
  const ojson tools = ojson::array({{{"name", "a"}}, {{"name", "b"}}});
  std::vector<std::string> paths;
  const ojson out = chat_function_tools(tools, [&](const ojson& t, const std::string& path) {
    paths.push_back(path);
    return ojson{{"name", t["name"]}};
  });
  EXPECT_EQ(out, ojson::parse(R"([{"type": "function", "function": {"name": "a"}},
                                  {"type": "function", "function": {"name": "b"}}])"));
  EXPECT_EQ(paths, (std::vector<std::string>{"tools[0]", "tools[1]"}));
  auto none = [](const ojson&, const std::string&) { return ojson(); };
  EXPECT_EQ(error_of([&] { chat_function_tools(ojson::object(), none); }, "tools"), "'tools' must be a list");
}

TEST(BodyFields, CheckKnownFields) {
  constexpr std::string_view known[] = {"model", "input"};
  check_known_fields(ojson{{"model", "m"}, {"input", "hi"}, {"user", nullptr}}, known, "/v1/x");  // null: ignored
  try {
    check_known_fields(ojson{{"model", "m"}, {"user", "u"}}, known, "/v1/x");
    ADD_FAILURE() << "no ApiError";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "user");
    EXPECT_EQ(e.code, "unsupported_parameter");
    EXPECT_STREQ(e.what(), "'user' is not supported by kiln's /v1/x (it would have no effect); remove it");
  }
}

}  // namespace
}  // namespace kiln::server
