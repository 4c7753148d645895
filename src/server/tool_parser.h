// Qwen3-Coder / Qwen3.5 XML tool calls -> OpenAI tool_calls, incrementally (--tool-call-parser
// qwen3_coder). The model writes
//
//   <tool_call>
//   <function=get_weather>
//   <parameter=city>
//   Paris
//   </parameter>
//   </function>
//   </tool_call>
//
// and the client gets {name: "get_weather", arguments: "{\"city\": \"Paris\"}"}. Parameter values
// are converted by the tool's JSON schema type when tools are given (strings stay strings; integer,
// number, boolean, object, array and "null" are parsed; anything that does not parse stays a string).
// Arguments stream one whole parameter at a time ("{" + "\"k\": v", ", \"k2\": v2", ..., "}"), so
// the concatenated fragments are always the final JSON text.
//
// Text outside <tool_call> blocks is content; whitespace touching a block is dropped. The result is
// the same whether the text arrives at once or cut anywhere, even inside tags.
//
// A call of a function that is not in `tools` is dropped (as SGLang does), and so is every call after the
// first max_calls; dropped() names them. A call cut off by the end of the text is closed, without the
// fragment of a closing tag the text may end on.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "server/text_util.h"

namespace kiln::server {

struct ToolCallPiece {
  int index = 0;          // which call (0, 1, ...)
  std::string name;       // set on the call's first piece only
  std::string arguments;  // JSON text fragment to append
};

class ToolCallParser {
 public:
  // tools: the request's "tools" array (OpenAI form), or null / empty.
  explicit ToolCallParser(const nlohmann::json& tools, int max_calls = -1);  // -1: no limit

  struct Delta {
    std::string content;
    std::vector<ToolCallPiece> calls;
  };
  Delta push(std::string_view text);
  Delta finish();
  int num_calls() const { return num_calls_; }
  // Names of the calls dropped (unknown function, or over max_calls), in order.
  const std::vector<std::string>& dropped() const { return dropped_; }

  // Converts one raw parameter value by its schema (the property's JSON schema, or null if unknown).
  static nlohmann::json convert_value(std::string_view raw, const nlohmann::json& schema);

 private:
  enum class State { outside, in_block, in_function };
  void run(Delta& out, bool at_end);
  bool step_outside(Delta& out, bool at_end);
  bool step_in_block(Delta& out, bool at_end);
  bool step_in_function(Delta& out, bool at_end);
  bool step_parameter(Delta& out, bool at_end);
  void emit_parameter(Delta& out, std::string_view name, std::string_view raw);
  void close_function(Delta& out);
  const nlohmann::json* property_schema(std::string_view name) const;
  bool is_known_function(const std::string& name) const;

  nlohmann::json tools_;
  State state_ = State::outside;
  std::string buf_;
  WhitespaceTrimmer content_trim_;
  int num_calls_ = 0;
  int num_params_ = 0;  // in the current function
  std::string function_name_;
  int max_calls_ = -1;
  bool skipping_ = false;  // inside a dropped call: its parameters produce nothing
  std::vector<std::string> dropped_;
};

}  // namespace kiln::server
