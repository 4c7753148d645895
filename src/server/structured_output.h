// Grammars for structured output: any JSON object, a JSON Schema, Qwen3.5 XML tool calls.
//
// JSON Schema subset (draft 2020-12 keywords; anything else is a kiln::Error naming the keyword and where
// it is, so the server can answer 400):
//   type (one or a list): object, array, string, number, integer, boolean, null
//   object: properties, required, additionalProperties (false, true or a schema)
//   array: items, minItems, maxItems
//   string: minLength, maxLength (counted in code points, as JSON Schema does)
//   enum, const (any JSON values), anyOf, $ref to "#", "#/$defs/NAME" or "#/definitions/NAME", $defs,
//   definitions; annotations are ignored: title, description, default, examples, $schema, $id, $comment,
//   deprecated, readOnly, writeOnly.
// The generated text is compact-or-lightly-spaced JSON: at most kMaxWhitespace whitespace bytes between
// tokens. Object members come in the order of "properties"; extra members (additionalProperties true or a
// schema) are only generated for objects that declare no properties (a free-form map), so that an
// extra key can never repeat a declared one. Numbers have at most 15 integer and 15 fraction digits.
//
// The grammars are built here (server layer: JSON in, engine/grammar automata out); the engine only runs them.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/grammar/grammar.h"
#include "engine/grammar/token_mask.h"
#include "server/protocol.h"

namespace kiln::tok {
class Tokenizer;
}

namespace kiln::server {

using grammar::Grammar;

inline constexpr int kMaxWhitespace = 16;

// Any JSON object (OpenAI's response_format json_object).
std::shared_ptr<const Grammar> json_object_grammar();

// A JSON value valid against the schema (JSON text). Throws kiln::Error on a bad or unsupported schema.
std::shared_ptr<const Grammar> json_schema_grammar(std::string_view schema_json);

// One function a tool call may name: its parameters' JSON schema as JSON text ("" = no parameters).
struct ToolSpec {
  std::string name;
  std::string parameters_json;
};

// Qwen3.5 / Qwen3-Coder XML tool calls (the format of server/tool_parser.h) of the given functions, with
// arguments valid against each function's parameters schema:
//   <tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>
// String arguments are raw text (they may not contain "</" or "<p"; with minLength / maxLength or no '<' at all);
// other types are JSON. Parameters come in the order of "properties"; required ones always, others optional.
// Leading whitespace is allowed; with parallel, one or more calls separated by a newline, else exactly one.
// text_first (tool_choice auto with strict tools): free text first (without "<t" or "</" ), then optionally the calls.
std::shared_ptr<const Grammar> tool_call_grammar(const std::vector<ToolSpec>& tools, bool parallel,
                                                 bool text_first = false);

// The grammar a request's answer (after the reasoning) must follow, or null when it is free:
//   response_format json_object / json_schema {schema}; tool_choice "required" (a call of any tool) or
//   {"type": "function", "function": {"name"}} (a call of that one); tool_choice "auto" with a tool marked
//   "strict": true (text, then calls whose arguments fit). An invalid or unsupported request is an ApiError 400
//   naming the parameter (and, for a schema, the keyword).
std::shared_ptr<const Grammar> chat_grammar(const ChatRequest& r, bool tool_parser_on);
std::shared_ptr<const Grammar> completion_grammar(const CompletionRequest& r);

// Every token's byte string from a byte-level BPE tokenizer (special tokens and ids past the tokenizer,
// up to vocab_size, get none: no grammar allows them). Built once per server.
std::shared_ptr<const grammar::TokenTable> token_table(const tok::Tokenizer& tokenizer, int64_t vocab_size);

// Computes, once per table, the context-independent mask of a JSON string's content (the tokens that stay inside
// the string; shared by every JSON grammar over the table, bounded strings included: engine/grammar/token_mask.h),
// so that the first string value of the first constrained request does not walk the whole vocabulary on the engine
// thread. Tens of milliseconds at a 248k vocabulary.
void warm_token_table(const std::shared_ptr<const grammar::TokenTable>& table);

}  // namespace kiln::server
