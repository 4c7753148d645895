// Checked reading of the request bodies that the Anthropic Messages and OpenAI Responses routes translate into chat
// bodies (anthropic_api.cpp, responses_api.cpp). Every failure is a bad_param (api_error.h) naming the path of the
// value at fault, in the form "messages[2].content[0].text".
#pragma once
#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>

#include "server/protocol.h"

namespace kiln::server {

// A 400 unsupported_parameter error for the first field of `body` that is not null and not one of `known`:
// "'<key>' is not supported by kiln's <route> (it would have no effect); remove it".
void check_known_fields(const ojson& body, std::span<const std::string_view> known, const char* route);

// "where[i]": the path of item i of the list at `where`.
std::string item_path(const std::string& where, size_t i);

// obj[name] when it is there and (obj[name].*is)(); otherwise bad_param "'where.name' must be <what>".
const ojson& typed_field(const ojson& obj, const char* name, const std::string& where, bool (ojson::*is)() const,
                         const char* what);
// typed_field(obj, name, where, is_string, "a string") as a std::string.
std::string string_field(const ojson& obj, const char* name, const std::string& where);

// The text of `v`: v itself when it is a string; when it is a list, item_text(item, its path) of each item, joined
// with newlines (none before the first non-empty text); anything else is bad_param "'where' must be a string or
// <list_what>".
std::string joined_text(const ojson& v, const std::string& where, const char* list_what,
                        const std::function<std::string(const ojson& item, const std::string& path)>& item_text);

// The chat body's tools from the list `tools` (else bad_param "'tools' must be a list"): for each item,
// {type: function, function: function_of(item, its path)}.
ojson chat_function_tools(const ojson& tools,
                          const std::function<ojson(const ojson& tool, const std::string& path)>& function_of);

}  // namespace kiln::server
