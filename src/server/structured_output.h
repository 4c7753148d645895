// Grammars for structured output: any JSON object, a JSON Schema, Qwen3.5 XML tool calls.
//
// JSON Schema (draft 2020-12 keywords; anything else is a kiln::Error naming the keyword and where it is, so the
// server answers 400; nothing is silently ignored):
//   type (one or a list): object, array, string, number, integer, boolean, null
//   object: properties, required, additionalProperties (false, true or a schema), minProperties, maxProperties
//   array: items, prefixItems, minItems, maxItems, uniqueItems (over an enum / const / boolean of <= 8 values)
//   string: minLength, maxLength (code points, as JSON Schema counts), pattern (a regular expression through an
//     automaton: engine/grammar/regex.h), format (date-time, time, date, duration, email, hostname, ipv4, ipv6, uuid)
//   integer: minimum, maximum, exclusiveMinimum, exclusiveMaximum (exact digit automata), multipleOf (an integer up
//     to 1000; with both bounds, up to 256 allowed values)
//   number: integer bounds (exact), multipleOf an integer or 10^-d (at most d fraction digits); fractional bounds
//     are a 400 (not enforceable exactly); numbers with bounds have no exponent
//   enum, const (beside 'type' only), anyOf, oneOf (when its branches provably cannot overlap: different types,
//   const / enum values, or a required property with different const values; else a 400), allOf (merged: properties,
//   required, type, items and bounds combine; other keywords must agree), $ref to "#", "#/$defs/NAME" or
//   "#/definitions/NAME" (with sibling keywords: as allOf), recursion, $defs, definitions.
//   Annotations are ignored: title, description, default, examples, $schema, $id, $anchor, $comment, deprecated,
//   readOnly, writeOnly, discriminator, contentMediaType, contentEncoding.
// Every sub-schema is compiled once into a rule and called where it is used, so a grammar grows with the schema's
// size; nesting deeper than kMaxSchemaDepth, more than kMaxGrammarNodes nodes or more than kMaxGrammarCompileMs of
// compilation are a 400 that names the limit.
// Whitespace between JSON tokens: none, one space, or one newline and up to kMaxIndent spaces / tabs (compact, as
// llama.cpp bounds it); any JSON whitespace with JsonGrammarOptions::any_whitespace (response_format's
// "any_whitespace": true). Object members come in the order of "properties"; extra members (additionalProperties
// true or a schema) are only generated for objects that declare no properties (a free-form map), so that an extra
// key can never repeat a declared one. Numbers have at most 15 integer and 15 fraction digits.
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

inline constexpr int kMaxIndent = 20;                 // spaces / tabs after a newline between JSON tokens
inline constexpr int kMaxSchemaDepth = 32;            // nested sub-schemas (objects, arrays, anyOf, $ref chains)
inline constexpr size_t kMaxSchemaJsonDepth = 128;    // JSON nesting of the schema document itself
inline constexpr size_t kMaxGrammarNodes = 1u << 19;  // per grammar, ~30 MB (engine/grammar/grammar.h CompileLimits)
inline constexpr int kMaxGrammarCompileMs = 1000;     // per grammar

struct JsonGrammarOptions {
  bool any_whitespace = false;  // any JSON whitespace between tokens, unbounded (default: compact, bounded)
};

// Any JSON object (OpenAI's response_format json_object).
std::shared_ptr<const Grammar> json_object_grammar(const JsonGrammarOptions& options = {});

// A JSON value valid against the schema (JSON text). Throws kiln::Error on a bad or unsupported schema, or one
// past the limits above.
std::shared_ptr<const Grammar> json_schema_grammar(std::string_view schema_json, const JsonGrammarOptions& options = {});

// Text matching a regular expression as a whole (SGLang's "regex" parameter; syntax: engine/grammar/regex.h).
// Throws kiln::Error on a bad or unsupported pattern.
std::shared_ptr<const Grammar> regex_grammar(std::string_view pattern);

// Text of an EBNF grammar (SGLang's "ebnf" parameter; syntax: engine/grammar/ebnf.h), under the same limits.
std::shared_ptr<const Grammar> ebnf_grammar(std::string_view ebnf);

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
//   response_format json_object / json_schema {schema} (with "any_whitespace": true, any JSON whitespace), or
//   SGLang's "regex" / "ebnf" (at most one of the three); tool_choice "required" (a call of any tool) or
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
