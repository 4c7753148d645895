#include "server/structured_output.h"

#include <bit>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <unordered_map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "engine/grammar/ebnf.h"
#include "engine/grammar/number_range.h"
#include "engine/grammar/regex.h"
#include "server/api_error.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

using grammar::CodepointSet;
using grammar::Frag;

namespace {

using json = ojson;  // ordered: keeps "properties" in declaration order

std::array<bool, 256> no_bytes() {
  std::array<bool, 256> a{};
  a.fill(false);
  return a;
}

// The limits every JSON grammar is built under (engine/grammar/grammar.h): a schema that would need more is a 400.
grammar::CompileLimits compile_limits() {
  grammar::CompileLimits l;
  l.max_nodes = kMaxGrammarNodes;
  l.max_time = std::chrono::milliseconds(kMaxGrammarCompileMs);
  return l;
}

// Nesting depth of a JSON document, without recursion (a hostile document may nest 100k levels).
size_t json_depth(const json& root) {
  size_t deepest = 0;
  std::vector<std::pair<const json*, size_t>> todo{{&root, 1}};
  while (!todo.empty()) {
    auto [j, d] = todo.back();
    todo.pop_back();
    deepest = std::max(deepest, d);
    if (d > kMaxSchemaJsonDepth) return d;
    if (j->is_structured())
      for (const json& c : *j) todo.push_back({&c, d + 1});
  }
  return deepest;
}

void check_json_depth(const json& j, const char* what) {
  if (json_depth(j) > kMaxSchemaJsonDepth)
    fail("{} nests deeper than {} JSON levels (kiln's limit)", what, kMaxSchemaJsonDepth);
}

// Builds JSON pieces into one grammar; shared rules (whitespace, strings, numbers, any value) are made once.
class JsonBuilder {
 public:
  JsonBuilder(Grammar& g, const JsonGrammarOptions& options = {}) : g_(g), options_(options) {}

  // Between JSON tokens. Default: nothing, one space, or one newline and up to kMaxIndent spaces / tabs (as
  // llama.cpp bounds it: a weak model cannot spend tokens on blank space). any_whitespace: any JSON whitespace.
  Frag ws() {
    if (ws_rule_ < 0) {
      ws_rule_ = g_.new_rule("ws");
      if (options_.any_whitespace) {
        auto set = no_bytes();
        for (char c : std::string_view(" \t\n\r")) set[static_cast<uint8_t>(c)] = true;
        g_.define_rule(ws_rule_, g_.star(g_.byte_set(set)));
      } else {
        auto indent = no_bytes();
        indent[' '] = indent['\t'] = true;
        g_.define_rule(ws_rule_, g_.opt(g_.alt({g_.literal(" "),
                                                 g_.seq({g_.literal("\n"), g_.repeat([&] { return g_.byte_set(indent); },
                                                                                     0, kMaxIndent)})})));
      }
    }
    return g_.call(ws_rule_);
  }

  // One well-formed UTF-8 character; ASCII bytes limited to `ascii` (multi-byte characters always allowed).
  Frag utf8_char(const std::array<bool, 128>& ascii) {
    auto set = no_bytes();
    for (int i = 0; i < 128; ++i) set[static_cast<size_t>(i)] = ascii[static_cast<size_t>(i)];
    auto cont = [&] { return g_.bytes(0x80, 0xBF); };
    return g_.alt({
        g_.byte_set(set),
        g_.seq({g_.bytes(0xC2, 0xDF), cont()}),
        g_.seq({g_.bytes(0xE0, 0xE0), g_.bytes(0xA0, 0xBF), cont()}),
        g_.seq({g_.bytes(0xE1, 0xEC), cont(), cont()}),
        g_.seq({g_.bytes(0xED, 0xED), g_.bytes(0x80, 0x9F), cont()}),
        g_.seq({g_.bytes(0xEE, 0xEF), cont(), cont()}),
        g_.seq({g_.bytes(0xF0, 0xF0), g_.bytes(0x90, 0xBF), cont(), cont()}),
        g_.seq({g_.bytes(0xF1, 0xF3), cont(), cont(), cont()}),
        g_.seq({g_.bytes(0xF4, 0xF4), g_.bytes(0x80, 0x8F), cont(), cont()}),
    });
  }

  Frag hex() {
    auto set = no_bytes();
    for (char c : std::string_view("0123456789abcdefABCDEF")) set[static_cast<uint8_t>(c)] = true;
    return g_.byte_set(set);
  }

  // One character of a JSON string: unescaped (not '"', '\\' or a control byte) or an escape. \u escapes
  // of UTF-16 surrogates are not generated (a lone one is not valid text for many parsers). Inlined (fresh nodes
  // each time), not a rule of its own: inside a string the innermost call frame is then the string, and only a
  // closing quote leaves it, so the token masks' context-independent part (engine/grammar/token_mask.h) covers
  // almost every token.
  Frag string_char() {
    std::array<bool, 128> ascii{};
    for (int i = 0x20; i < 128; ++i) ascii[static_cast<size_t>(i)] = i != '"' && i != '\\';
    auto simple = no_bytes();
    for (char c : std::string_view("\"\\/bfnrt")) simple[static_cast<uint8_t>(c)] = true;
    auto first_hex = no_bytes();  // not d / D: the rest of the BMP
    for (char c : std::string_view("0123456789abcefABCEF")) first_hex[static_cast<uint8_t>(c)] = true;
    Frag esc = g_.seq({g_.literal("\\"),
                       g_.alt({g_.byte_set(simple),
                               g_.seq({g_.literal("u"), g_.alt({g_.seq({g_.byte_set(first_hex), hex()}),
                                                                g_.seq({g_.alt({g_.literal("d"), g_.literal("D")}),
                                                                        g_.bytes('0', '7')})}),
                                       hex(), hex()})})});
    // Each character is one counted unit (its first byte a counting edge): a bounded string is a counted call of
    // the one string rule, so minLength / maxLength count characters (code points, as JSON Schema does; an escape is
    // one) without a copy of the rule per position.
    return g_.count_units(g_.alt({utf8_char(ascii), esc}));
  }

  // One character from a code point set, written as JSON string content: '"', '\\' and control characters escaped
  // (\n \t ... or \u00XX), everything else as raw UTF-8. One counted unit (see string_char).
  Frag json_char(const CodepointSet& set) {
    static const CodepointSet special = grammar::normalize({{0, 0x1F}, {'"', '"'}, {'\\', '\\'}});
    std::vector<Frag> opts;
    const CodepointSet raw = grammar::intersect(set, grammar::complement(special));
    if (!raw.empty()) opts.push_back(grammar::utf8_class(g_, raw));
    for (grammar::CodepointRange r : grammar::intersect(set, special))
      for (uint32_t c = r.lo; c <= r.hi; ++c) opts.push_back(g_.literal(json_escape(c)));
    return g_.count_units(opts.size() == 1 ? opts[0] : g_.alt(std::move(opts)));
  }

  static std::string json_escape(uint32_t c) {
    switch (c) {
      case '"': return "\\\"";
      case '\\': return "\\\\";
      case '\b': return "\\b";
      case '\f': return "\\f";
      case '\n': return "\\n";
      case '\r': return "\\r";
      case '\t': return "\\t";
      default: {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        return buf;
      }
    }
  }

  Frag string(int64_t min_len = 0, int64_t max_len = -1) {
    if (string_rule_ < 0) {
      string_rule_ = g_.new_rule("string");
      g_.define_rule(string_rule_, g_.seq({g_.literal("\""), g_.star(string_char()), g_.literal("\"")}));
    }
    if (min_len == 0 && max_len < 0) return g_.call(string_rule_);
    return g_.counted_call(string_rule_, min_len, max_len);
  }

  Frag digits(int64_t min, int64_t max) {
    return g_.repeat([&] { return g_.bytes('0', '9'); }, min, max);
  }

  Frag integer() {
    if (integer_rule_ < 0) {
      integer_rule_ = g_.new_rule("integer");
      g_.define_rule(integer_rule_, g_.seq({g_.opt(g_.literal("-")),
                                            g_.alt({g_.literal("0"), g_.seq({g_.bytes('1', '9'), digits(0, 14)})})}));
    }
    return g_.call(integer_rule_);
  }

  Frag number() {
    if (number_rule_ < 0) {
      number_rule_ = g_.new_rule("number");
      auto e = no_bytes();
      e['e'] = e['E'] = true;
      auto sign = no_bytes();
      sign['+'] = sign['-'] = true;
      g_.define_rule(number_rule_,
                     g_.seq({integer(), g_.opt(g_.seq({g_.literal("."), digits(1, 15)})),
                             g_.opt(g_.seq({g_.byte_set(e), g_.opt(g_.byte_set(sign)), digits(1, 2)}))}));
    }
    return g_.call(number_rule_);
  }

  Frag boolean() { return g_.alt({g_.literal("true"), g_.literal("false")}); }

  // Any JSON value (recursive through the "value" rule).
  Frag any_value() {
    if (value_rule_ < 0) {
      value_rule_ = g_.new_rule("value");
      g_.define_rule(value_rule_, g_.alt({any_object(), any_array(), string(), number(), boolean(), g_.literal("null")}));
    }
    return g_.call(value_rule_);
  }

  // {"k": v, ...} with any keys; values from make_value; between min and max members (max < 0: unbounded).
  Frag map_object(const std::function<Frag()>& make_value, int64_t min = 0, int64_t max = -1) {
    if (max == 0) return g_.seq({g_.literal("{"), ws(), g_.literal("}")});
    auto member = [&] { return g_.seq({string(), ws(), g_.literal(":"), ws(), make_value()}); };
    auto more = [&] { return g_.seq({ws(), g_.literal(","), ws(), member()}); };
    Frag members = g_.seq({member(), g_.repeat(more, std::max<int64_t>(0, min - 1), max < 0 ? -1 : max - 1), ws()});
    if (min == 0) members = g_.opt(members);
    return g_.seq({g_.literal("{"), ws(), members, g_.literal("}")});
  }

  Frag any_object() { return map_object([&] { return any_value(); }); }

  Frag array_of(const std::function<Frag()>& make_item, int64_t min_items, int64_t max_items) {
    if (max_items == 0) return g_.seq({g_.literal("["), ws(), g_.literal("]")});
    auto more = [&] { return g_.seq({ws(), g_.literal(","), ws(), make_item()}); };
    Frag items = g_.seq({make_item(), g_.repeat(more, std::max<int64_t>(0, min_items - 1),
                                                max_items < 0 ? -1 : max_items - 1)});
    items = g_.seq({items, ws()});
    if (min_items == 0) items = g_.opt(items);
    return g_.seq({g_.literal("["), ws(), items, g_.literal("]")});
  }

  Frag any_array() { return array_of([&] { return any_value(); }, 0, -1); }

  Grammar& g() { return g_; }

 private:
  Grammar& g_;
  JsonGrammarOptions options_;
  int32_t ws_rule_ = -1, string_rule_ = -1, integer_rule_ = -1, number_rule_ = -1,
          value_rule_ = -1;
};

const std::set<std::string>& annotation_keywords() {
  static const std::set<std::string> k = {"title",      "description", "default",  "examples",  "$schema",
                                          "$id",        "$comment",    "deprecated", "readOnly", "writeOnly",
                                          "$anchor",    "discriminator", "contentMediaType", "contentEncoding"};
  return k;
}

const std::set<std::string>& supported_keywords() {
  static const std::set<std::string> k = {
      "type",     "enum",       "const",     "anyOf",         "oneOf",            "allOf",
      "$ref",     "$defs",      "definitions",
      "properties", "required", "additionalProperties", "minProperties", "maxProperties",
      "items",    "prefixItems", "minItems", "maxItems",      "uniqueItems",
      "minLength", "maxLength", "pattern",   "format",
      "minimum",  "maximum",    "exclusiveMinimum", "exclusiveMaximum", "multipleOf"};
  return k;
}

// Keywords that constrain (not annotations, not $defs containers).
bool constrains(const std::string& key) {
  return !annotation_keywords().count(key) && key != "$defs" && key != "definitions";
}

std::string pointer_child(const std::string& path, const std::string& key) {
  std::string k;
  for (char c : key) {
    if (c == '~') k += "~0";
    else if (c == '/') k += "~1";
    else k += c;
  }
  return path + "/" + k;
}

std::string where(const std::string& path) { return path.empty() ? "the schema root" : "'" + path + "'"; }

// JSON Schema "format" values as whole-string regular expressions (engine/grammar/regex.h syntax), RFC 3339 / 5321 /
// 1123 / 4291 / 4122 shapes. Calendar validity (February 30) and the IPv4-embedded IPv6 forms are not checked.
const std::map<std::string, std::string>& format_patterns() {
  static const std::map<std::string, std::string> m = [] {
    const std::string date = R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01]))";
    const std::string time = R"(([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d{1,9})?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d))";
    const std::string label = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?";
    const std::string hostname = label + R"((\.)" + label + ")*";
    const std::string h = "[0-9a-fA-F]{1,4}";
    const std::string ipv6 = "((" + h + ":){7}" + h + "|(" + h + ":){1,7}:|(" + h + ":){1,6}:" + h + "|(" + h +
                             ":){1,5}(:" + h + "){1,2}|(" + h + ":){1,4}(:" + h + "){1,3}|(" + h + ":){1,3}(:" + h +
                             "){1,4}|(" + h + ":){1,2}(:" + h + "){1,5}|" + h + ":(:" + h + "){1,6}|:((:" + h +
                             "){1,7}|:))";
    const std::string octet = R"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d))";
    const std::string dur_time = R"(T(\d+H(\d+M)?(\d+S)?|\d+M(\d+S)?|\d+S))";
    return std::map<std::string, std::string>{
        {"date", date},
        {"time", time},
        {"date-time", date + "[Tt]" + time},
        {"duration", R"(P((\d+Y(\d+M)?(\d+D)?|\d+M(\d+D)?|\d+D)()" + dur_time + ")?|" + dur_time + R"(|\d+W))"},
        {"email", R"([A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@)" + hostname},
        {"hostname", hostname},
        {"ipv4", octet + R"((\.)" + octet + "){3}"},
        {"ipv6", ipv6},
        {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
    };
  }();
  return m;
}

// The JSON types a schema's values can have: null, boolean, object, array, string, integer, and non-integer numbers.
enum TypeBit : unsigned {
  kNull = 1, kBool = 2, kObject = 4, kArray = 8, kString = 16, kInteger = 32, kFraction = 64, kAnyType = 127
};

unsigned type_bits_of_name(const std::string& t) {
  if (t == "null") return kNull;
  if (t == "boolean") return kBool;
  if (t == "object") return kObject;
  if (t == "array") return kArray;
  if (t == "string") return kString;
  if (t == "integer") return kInteger;
  if (t == "number") return kInteger | kFraction;
  return 0;
}

unsigned type_bits_of_value(const json& v) {
  if (v.is_null()) return kNull;
  if (v.is_boolean()) return kBool;
  if (v.is_object()) return kObject;
  if (v.is_array()) return kArray;
  if (v.is_string()) return kString;
  if (v.is_number_integer()) return kInteger;
  const double d = v.get<double>();
  return std::floor(d) == d ? kInteger : kFraction;
}

std::string type_name(unsigned bit) {
  switch (bit) {
    case kNull: return "null";
    case kBool: return "boolean";
    case kObject: return "object";
    case kArray: return "array";
    case kString: return "string";
    case kInteger: return "integer";
    default: return "number";
  }
}

// A number keyword's value as an exact integer when it is one (json integers, or doubles with no fraction).
std::optional<int64_t> integral(const json& v) {
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)) return std::nullopt;
    return v.get<int64_t>();
  }
  const double d = v.get<double>();
  if (std::floor(d) != d || std::fabs(d) > 9.2e18) return std::nullopt;
  return static_cast<int64_t>(d);
}

constexpr int64_t kBoundLimit = 1'000'000'000'000'000'000 - 1;  // number_range.h: magnitudes below 10^18

// JSON Schema -> grammar fragments. Every sub-schema (by its JSON pointer) is compiled once into a rule of its own
// and called wherever it is used (a list's first and later items, an object member with or without a comma before
// it): the grammar grows linearly with the schema, never with the number of paths through it.
class SchemaCompiler {
 public:
  SchemaCompiler(JsonBuilder& b, const json& root) : b_(b), g_(b.g()), root_(root) {}

  Frag value(const json& s, const std::string& path) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return b_.any_value();
      fail("the JSON schema at {} is false: no value can match it", where(path));
    }
    if (auto it = rules_.find(path); it != rules_.end()) return g_.call(it->second);
    if (depth_ >= kMaxSchemaDepth)
      fail("the JSON schema nests deeper than {} levels at {} (kiln's limit; flatten it, or name repeated parts in "
           "$defs and refer to them with $ref)",
           kMaxSchemaDepth, where(path));
    const int32_t rule = g_.new_rule(path.empty() ? "schema" : path);
    rules_[path] = rule;  // before the body: a recursive $ref calls it
    ++depth_;
    g_.define_rule(rule, compile(s, path));
    --depth_;
    return g_.call(rule);
  }

  // One argument value of a Qwen3.5 XML tool call: strings are raw text (server/tool_parser.cpp keeps them
  // as they are), other types JSON text that the parser converts by the parameter's type.
  Frag tool_value(const json& s, const std::string& path) {
    if (!s.is_object()) fail("the schema of tool parameter {} must be an object", where(path));
    check_keywords(s, path);
    std::string type;
    bool nullable = false;
    if (auto t = s.find("type"); t != s.end()) {
      if (t->is_string()) type = t->get<std::string>();
      else if (t->is_array())
        for (const json& x : *t) {
          if (!x.is_string()) continue;
          if (x.get<std::string>() == "null") nullable = true;
          else if (type.empty()) type = x.get<std::string>();
        }
    }
    std::vector<Frag> opts;
    auto raw_literals = [&](const json& values) {
      for (const json& v : values) {
        if (!v.is_string()) fail("tool parameter {}: a value of 'enum' / 'const' is not a string (give a 'type')", where(path));
        opts.push_back(g_.literal(v.get<std::string>()));
      }
    };
    if (type.empty() || type == "string") {
      if (auto c = s.find("const"); c != s.end()) raw_literals(json::array({*c}));
      else if (auto e = s.find("enum"); e != s.end() && e->is_array() && !e->empty()) raw_literals(*e);
      else if (type.empty())
        fail("tool parameter {} has no 'type' (constrained tool calls need one, or an 'enum' of strings)", where(path));
      else {
        auto [lo, hi] = length_bounds(s, path);
        std::array<bool, 128> no_lt{};
        for (int i = 1; i < 128; ++i) no_lt[static_cast<size_t>(i)] = i != '<';
        if (s.contains("pattern") || s.contains("format")) {
          // Raw text from the pattern, never '<' (the parser's tags), each character one counted unit.
          static const CodepointSet no_lt_set = grammar::complement({{'<', '<'}, {0, 0}});
          grammar::CharEmitter raw = [](Grammar& g, const CodepointSet& set) {
            CodepointSet allowed = grammar::intersect(set, no_lt_set);
            if (allowed.empty()) fail("a pattern character of a tool argument can only be '<', which raw tool arguments cannot contain");
            return g.count_units(grammar::utf8_class(g, allowed));
          };
          opts.push_back(text_rule(s, path, lo, hi, raw, ""));
        } else if (lo > 0 || hi >= 0) {
          opts.push_back(g_.repeat([&] { return b_.utf8_char(no_lt); }, lo, hi));
        } else {
          std::array<bool, 128> after_lt = no_lt;  // "<" may not start "</" or "<p" (the parser's tags)
          after_lt['/'] = after_lt['p'] = false;
          opts.push_back(g_.star(g_.alt({b_.utf8_char(no_lt), g_.seq({g_.literal("<"), b_.utf8_char(after_lt)})})));
        }
      }
    } else {
      json one = s;
      one["type"] = type;
      opts.push_back(value(one, path));
    }
    if (nullable) opts.push_back(g_.literal("null"));
    return g_.alt(std::move(opts));
  }

 private:
  void check_keywords(const json& s, const std::string& path) {
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (supported_keywords().count(it.key()) || annotation_keywords().count(it.key())) continue;
      fail("unsupported JSON schema keyword '{}' at {} (supported: type, enum, const, anyOf, oneOf, allOf, $ref, "
           "$defs, properties, required, additionalProperties, minProperties, maxProperties, items, prefixItems, "
           "minItems, maxItems, uniqueItems, minLength, maxLength, pattern, format, minimum, maximum, "
           "exclusiveMinimum, exclusiveMaximum, multipleOf)",
           it.key(), where(path));
    }
  }

  Frag compile(const json& s, const std::string& path) {
    if (s.is_boolean()) return value(s, path);
    if (!s.is_object()) fail("the JSON schema at {} must be an object or a boolean", where(path));
    check_keywords(s, path);
    bool ref_with_siblings = false;
    if (s.contains("$ref"))
      for (auto it = s.begin(); it != s.end(); ++it)
        if (it.key() != "$ref" && constrains(it.key())) ref_with_siblings = true;
    if (s.contains("allOf") || ref_with_siblings) {
      json merged = merge_all_of(s, path);
      return compile(merged, path);
    }
    if (auto r = s.find("$ref"); r != s.end()) return ref(*r, pointer_child(path, "$ref"));
    if (s.contains("anyOf") && s.contains("oneOf"))
      fail("'anyOf' and 'oneOf' together at {} are not supported (combine them into one)", where(path));
    for (const char* key : {"anyOf", "oneOf"}) {
      auto a = s.find(key);
      if (a == s.end()) continue;
      if (!a->is_array() || a->empty()) fail("'{}' at {} must be a non-empty array", key, where(path));
      json siblings = json::object();
      for (auto it = s.begin(); it != s.end(); ++it)
        if (it.key() != key && constrains(it.key())) siblings[it.key()] = it.value();
      std::vector<json> branches;
      for (const json& b : *a) branches.push_back(siblings.empty() ? b : json{{"allOf", json::array({b, siblings})}});
      if (std::string(key) == "oneOf") check_disjoint(branches, pointer_child(path, key));
      std::vector<Frag> opts;
      for (size_t i = 0; i < branches.size(); ++i)
        opts.push_back(value(branches[i], pointer_child(path, key) + "/" + std::to_string(i)));
      return g_.alt(std::move(opts));
    }
    if (s.contains("const") || s.contains("enum")) return enumeration(s, path);
    auto t = s.find("type");
    if (t == s.end()) {
      auto has = [&](std::initializer_list<const char*> keys) {
        for (const char* k : keys)
          if (s.contains(k)) return true;
        return false;
      };
      if (has({"properties", "additionalProperties", "required", "minProperties", "maxProperties"}))
        return typed(s, "object", path);
      if (has({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"})) return typed(s, "array", path);
      if (has({"minLength", "maxLength", "pattern", "format"})) return typed(s, "string", path);
      if (has({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}))
        return typed(s, "number", path);
      return b_.any_value();
    }
    if (t->is_string()) return typed(s, t->get<std::string>(), path);
    if (t->is_array() && !t->empty()) {
      std::vector<Frag> opts;
      for (const json& x : *t) {
        if (!x.is_string()) fail("'type' at {} must be a string or a list of strings", where(path));
        opts.push_back(typed(s, x.get<std::string>(), path));
      }
      return g_.alt(std::move(opts));
    }
    fail("'type' at {} must be a string or a non-empty list of strings", where(path));
  }

  // enum / const: the values themselves (those of an allowed type when 'type' is given). Other constraints beside
  // them would need each value checked against them: refused rather than ignored.
  Frag enumeration(const json& s, const std::string& path) {
    std::vector<json> values;
    if (auto c = s.find("const"); c != s.end()) values.push_back(*c);
    if (auto e = s.find("enum"); e != s.end()) {
      if (!e->is_array() || e->empty()) fail("'enum' at {} must be a non-empty array", where(path));
      if (s.contains("const")) {
        bool found = false;
        for (const json& v : *e) found = found || v == values[0];
        if (!found) fail("'const' at {} is not one of its 'enum' values: no value can match", where(path));
      } else {
        values.assign(e->begin(), e->end());
      }
    }
    unsigned types = kAnyType;
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (it.key() == "const" || it.key() == "enum" || !constrains(it.key())) continue;
      if (it.key() == "type") {
        types = 0;
        if (it->is_string()) types = type_bits_of_name(it->get<std::string>());
        else if (it->is_array())
          for (const json& x : *it)
            if (x.is_string()) types |= type_bits_of_name(x.get<std::string>());
        continue;
      }
      fail("'{}' beside 'enum' / 'const' at {} is not supported (list only the allowed values)", it.key(), where(path));
    }
    std::vector<Frag> opts;
    for (const json& v : values)
      if (type_bits_of_value(v) & types) opts.push_back(g_.literal(v.dump()));
    if (opts.empty()) fail("no value of 'enum' / 'const' at {} has the schema's 'type'", where(path));
    return opts.size() == 1 ? opts[0] : g_.alt(std::move(opts));
  }

  static int64_t count(const json& s, const char* key, int64_t dflt, const std::string& path) {
    auto it = s.find(key);
    if (it == s.end()) return dflt;
    if (!it->is_number_integer() || it->get<int64_t>() < 0)
      fail("'{}' at {} must be a non-negative integer", key, where(path));
    return it->get<int64_t>();
  }

  static std::pair<int64_t, int64_t> length_bounds(const json& s, const std::string& path) {
    int64_t lo = count(s, "minLength", 0, path), hi = count(s, "maxLength", -1, path);
    if (hi >= 0 && hi < lo) fail("'maxLength' at {} is below 'minLength'", where(path));
    if (hi > 4096 || lo > 4096) fail("'minLength' / 'maxLength' at {} above 4096 is not supported", where(path));
    return {lo, hi};
  }

  // A string whose characters follow 'pattern' (a match anywhere, as JSON Schema says) or 'format' (the whole
  // string), length-bounded by counting its characters. quote: "\"" for a JSON string, "" for raw text.
  Frag text_rule(const json& s, const std::string& path, int64_t lo, int64_t hi, const grammar::CharEmitter& emit,
                 const std::string& quote) {
    auto p = s.find("pattern");
    auto f = s.find("format");
    if (p != s.end() && f != s.end())
      fail("'pattern' together with 'format' at {} is not supported (fold the format into the pattern)", where(path));
    std::string regex;
    grammar::RegexOptions ro;
    ro.emit = emit;
    if (p != s.end()) {
      if (!p->is_string()) fail("'pattern' at {} must be a string", where(path));
      regex = p->get<std::string>();
      ro.search = true;
    } else {
      if (!f->is_string()) fail("'format' at {} must be a string", where(path));
      auto it = format_patterns().find(f->get<std::string>());
      if (it == format_patterns().end())
        fail("'format' '{}' at {} is not supported (supported: date-time, time, date, duration, email, hostname, "
             "ipv4, ipv6, uuid)",
             f->get<std::string>(), where(path));
      regex = it->second;
      const int64_t implied = it->first == "hostname" ? 253 : it->first == "email" ? 254 : -1;  // RFC 1123 / 5321
      if (implied >= 0) hi = hi < 0 ? implied : std::min(hi, implied);
      if (hi >= 0 && hi < lo) fail("'minLength' at {} is above what format '{}' allows", where(path), it->first);
    }
    const int32_t rule = g_.new_rule("text " + path);
    Frag body;
    try {
      body = grammar::compile_regex(g_, regex, ro);
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      fail("'{}' at {}: {}", p != s.end() ? "pattern" : "format", where(path), e.what());
    }
    g_.define_rule(rule, g_.seq({g_.literal(quote), body, g_.literal(quote)}));
    if (lo == 0 && hi < 0) return g_.call(rule);
    return g_.counted_call(rule, lo, hi);
  }

  Frag typed(const json& s, const std::string& type, const std::string& path) {
    if (type == "string") {
      auto [lo, hi] = length_bounds(s, path);
      if (s.contains("pattern") || s.contains("format"))
        return text_rule(s, path, lo, hi, [this](Grammar&, const CodepointSet& set) { return b_.json_char(set); }, "\"");
      return b_.string(lo, hi);
    }
    if (type == "integer" || type == "number") return number(s, type == "integer", path);
    if (type == "boolean") return b_.boolean();
    if (type == "null") return g_.literal("null");
    if (type == "array") return array(s, path);
    if (type == "object") return object(s, path);
    fail("unsupported JSON schema type '{}' at {} (supported: object, array, string, number, integer, boolean, null)",
         type, where(path));
  }

  // Integers exactly within minimum / maximum / exclusive* and multiples of an integer multipleOf; numbers within
  // integer bounds, or with multipleOf 10^-d (at most d fraction digits). What cannot be enforced exactly is a 400.
  Frag number(const json& s, bool is_integer, const std::string& path) {
    struct Limit {
      const char* key;
      bool lower, exclusive;
    };
    std::optional<grammar::DecimalBound> lo, hi;
    for (Limit l : {Limit{"minimum", true, false}, Limit{"exclusiveMinimum", true, true}, Limit{"maximum", false, false},
                    Limit{"exclusiveMaximum", false, true}}) {
      auto it = s.find(l.key);
      if (it == s.end()) continue;
      if (!it->is_number()) fail("'{}' at {} must be a number", l.key, where(path));
      const double d = it->get<double>();
      std::optional<int64_t> v = integral(*it);
      grammar::DecimalBound b;
      if (v) {
        b = {*v, l.exclusive};
      } else if (is_integer && std::fabs(d) < 1e18) {
        // An integer above a fractional minimum: above its floor (exclusive); below a fractional maximum likewise.
        b = {static_cast<int64_t>(l.lower ? std::floor(d) : std::ceil(d)), true};
      } else if (std::fabs(d) >= 1e18) {
        if (l.lower == (d < 0)) continue;  // a lower bound far below, or an upper bound far above: no limit
        fail("'{}' {} at {} leaves no number kiln can generate (|bounds| must stay below 10^18)", l.key, d, where(path));
      } else {
        fail("'{}' {} at {}: a non-integer bound on a number is not supported (kiln enforces bounds exactly; use an "
             "integer bound or type integer)",
             l.key, d, where(path));
      }
      if (std::llabs(b.value) > kBoundLimit) {
        if (l.lower == (b.value < 0)) continue;
        fail("'{}' at {} leaves no number kiln can generate (|bounds| must stay below 10^18)", l.key, where(path));
      }
      auto& slot = l.lower ? lo : hi;
      // The tighter of two bounds on one side (an exclusive one wins a tie).
      auto tighter = [&](grammar::DecimalBound a, grammar::DecimalBound c) {
        if (a.value != c.value) return (l.lower ? a.value > c.value : a.value < c.value) ? a : c;
        return a.exclusive ? a : c;
      };
      slot = slot ? tighter(*slot, b) : b;
    }
    int fraction_digits = is_integer ? 0 : 15;
    std::optional<int64_t> multiple;
    if (auto m = s.find("multipleOf"); m != s.end()) {
      if (!m->is_number() || m->get<double>() <= 0) fail("'multipleOf' at {} must be a number above 0", where(path));
      const double k = m->get<double>();
      std::optional<int64_t> ki = integral(*m);
      int decimals = -1;  // k = 10^-decimals
      for (int d = 1; d <= 15; ++d)
        if (std::fabs(k * std::pow(10.0, d) - 1.0) < 1e-9) decimals = d;
      if (is_integer && !ki && std::fabs(1.0 / k - std::round(1.0 / k)) < 1e-9) {
        // every integer is a multiple of 1/n
      } else if (ki) {
        if (*ki > 1) multiple = *ki;
        fraction_digits = 0;
      } else if (decimals > 0) {
        if (!is_integer) fraction_digits = decimals;  // an integer is a multiple of 10^-d already
      } else {
        fail("'multipleOf' {} at {} is not supported (kiln enforces an integer, or 0.1, 0.01, ...)", k, where(path));
      }
    }
    if (multiple) {
      if (!lo && !hi) {
        if (*multiple > 1000) fail("'multipleOf' above 1000 at {} is not supported", where(path));
        return grammar::multiple_of(g_, *multiple);
      }
      if (!lo || !hi)
        fail("'multipleOf' with only one of minimum / maximum at {} is not supported (give both, or neither)",
             where(path));
      const int64_t first_v = lo->value + (lo->exclusive ? 1 : 0), last_v = hi->value - (hi->exclusive ? 1 : 0);
      const int64_t k = *multiple;
      const int64_t first = first_v >= 0 ? (first_v + k - 1) / k * k : -((-first_v) / k * k);
      if (first > last_v) fail("no multiple of {} lies within the bounds at {}", k, where(path));
      if ((last_v - first) / k >= 256)
        fail("'multipleOf' with minimum / maximum at {} allows more than 256 values (not supported)", where(path));
      std::vector<Frag> opts;
      for (int64_t v = first; v <= last_v; v += k) opts.push_back(g_.literal(std::to_string(v)));
      return opts.size() == 1 ? opts[0] : g_.alt(std::move(opts));
    }
    if (!lo && !hi) {
      if (fraction_digits == 15) return is_integer ? b_.integer() : b_.number();
      if (fraction_digits == 0) return b_.integer();
    }
    auto r = grammar::decimal_range(g_, lo, hi, fraction_digits);
    if (!r) fail("no {} satisfies the bounds at {}", is_integer ? "integer" : "number", where(path));
    return *r;
  }

  Frag array(const json& s, const std::string& path) {
    int64_t lo = count(s, "minItems", 0, path), hi = count(s, "maxItems", -1, path);
    if (hi >= 0 && hi < lo) fail("'maxItems' at {} is below 'minItems'", where(path));
    if (hi > 1024 || lo > 1024) fail("'minItems' / 'maxItems' at {} above 1024 is not supported", where(path));
    auto items = s.find("items");
    const std::string ipath = pointer_child(path, "items");
    if (items != s.end() && items->is_array())
      fail("'items' at {} as a list (the old tuple form) is not supported; use 'prefixItems'", where(path));
    if (items != s.end() && !items->is_boolean() && !items->is_object())
      fail("'items' at {} must be a schema", where(path));
    std::vector<const json*> prefix;
    if (auto p = s.find("prefixItems"); p != s.end()) {
      if (!p->is_array()) fail("'prefixItems' at {} must be a list of schemas", where(path));
      for (const json& x : *p) prefix.push_back(&x);
    }
    const int64_t n = static_cast<int64_t>(prefix.size());
    const bool rest_allowed = !(items != s.end() && items->is_boolean() && !items->get<bool>());
    if (!rest_allowed) hi = hi < 0 ? n : std::min(hi, n);
    if (hi >= 0 && hi < lo)
      fail("the array at {} must have at least {} items but its schema allows at most {}", where(path), lo, hi);
    const json* item_schema = items != s.end() && items->is_object() ? &*items : nullptr;
    auto element = [&](int64_t i) -> Frag {
      if (i < n) return value(*prefix[static_cast<size_t>(i)], pointer_child(path, "prefixItems") + "/" + std::to_string(i));
      return item_schema ? value(*item_schema, ipath) : b_.any_value();
    };
    if (auto u = s.find("uniqueItems"); u != s.end()) {
      if (!u->is_boolean()) fail("'uniqueItems' at {} must be a boolean", where(path));
      if (u->get<bool>() && (hi < 0 || hi > 1)) return unique_array(item_schema, n, lo, hi, path);
    }
    if (n == 0) return b_.array_of([&] { return element(0); }, lo, hi);
    // Prefix items one by one (a node after each count), then the rest as a bounded repeat.
    const int64_t chain = hi < 0 ? n : std::min(hi, n);
    Frag head = g_.seq({g_.literal("["), b_.ws()});
    std::vector<int32_t> after(static_cast<size_t>(chain) + 1);
    for (auto& a : after) a = g_.empty().start;
    g_.link(head.end, after[0]);
    const int32_t done = g_.empty().start;
    Frag close_empty = g_.literal("]");
    Frag close = g_.seq({b_.ws(), g_.literal("]")});
    g_.link(close_empty.end, done);
    g_.link(close.end, done);
    for (int64_t k = 0; k < chain; ++k) {
      Frag item = k == 0 ? element(0) : g_.seq({b_.ws(), g_.literal(","), b_.ws(), element(k)});
      g_.link(after[static_cast<size_t>(k)], item.start);
      g_.link(item.end, after[static_cast<size_t>(k + 1)]);
    }
    for (int64_t k = 0; k < chain; ++k)
      if (k >= lo) g_.link(after[static_cast<size_t>(k)], k == 0 ? close_empty.start : close.start);
    if (chain == n && rest_allowed && (hi < 0 || hi > n)) {
      Frag tail = g_.repeat([&] { return g_.seq({b_.ws(), g_.literal(","), b_.ws(), element(n)}); },
                            std::max<int64_t>(0, lo - n), hi < 0 ? -1 : hi - n);
      g_.link(after[static_cast<size_t>(n)], tail.start);
      g_.link(tail.end, close.start);
    } else if (chain >= lo) {
      g_.link(after[static_cast<size_t>(chain)], chain == 0 ? close_empty.start : close.start);
    }
    return {head.start, done};
  }

  // uniqueItems over items from a small enumeration: a node per set of values used so far.
  Frag unique_array(const json* item_schema, int64_t prefix_count, int64_t lo, int64_t hi, const std::string& path) {
    std::vector<json> values;
    const json* it = item_schema ? &resolve(*item_schema, path) : nullptr;
    if (prefix_count == 0 && it && it->is_object()) {
      if (auto c = it->find("const"); c != it->end()) values.push_back(*c);
      else if (auto e = it->find("enum"); e != it->end() && e->is_array()) values.assign(e->begin(), e->end());
      else if (auto t = it->find("type"); t != it->end() && *t == "boolean") values = {json(false), json(true)};
      for (auto k = it->begin(); k != it->end(); ++k)
        if (constrains(k.key()) && k.key() != "const" && k.key() != "enum" && k.key() != "type") values.clear();
      for (size_t i = 0; i < values.size(); ++i)
        for (size_t j = 0; j < i; ++j)
          if (values[i] == values[j]) values.clear();
    }
    if (values.empty() || values.size() > 8)
      fail("'uniqueItems' at {} is only supported over items from an 'enum' / 'const' / boolean of at most 8 values "
           "(or with maxItems <= 1)",
           where(path));
    const size_t m = values.size();
    const int64_t max_count = hi < 0 ? static_cast<int64_t>(m) : std::min<int64_t>(hi, static_cast<int64_t>(m));
    if (lo > max_count) fail("the array at {} needs {} unique items but only {} values exist", where(path), lo, m);
    Frag head = g_.seq({g_.literal("["), b_.ws()});
    std::vector<int32_t> used(size_t(1) << m);
    for (auto& u : used) u = g_.empty().start;
    g_.link(head.end, used[0]);
    const int32_t done = g_.empty().start;
    for (size_t set = 0; set < used.size(); ++set) {
      const int64_t size = std::popcount(set);
      if (size > max_count) continue;
      if (size >= lo) {
        Frag close = set == 0 ? g_.literal("]") : g_.seq({b_.ws(), g_.literal("]")});
        g_.link(used[set], close.start);
        g_.link(close.end, done);
      }
      if (size == max_count) continue;
      for (size_t v = 0; v < m; ++v) {
        if (set & (size_t(1) << v)) continue;
        Frag item = set == 0 ? g_.literal(values[v].dump())
                             : g_.seq({b_.ws(), g_.literal(","), b_.ws(), g_.literal(values[v].dump())});
        g_.link(used[set], item.start);
        g_.link(item.end, used[set | (size_t(1) << v)]);
      }
    }
    return {head.start, done};
  }

  Frag object(const json& s, const std::string& path) {
    auto props = s.find("properties");
    auto req = s.find("required");
    auto extra = s.find("additionalProperties");
    const int64_t min_p = count(s, "minProperties", 0, path), max_p = count(s, "maxProperties", -1, path);
    if (max_p >= 0 && max_p < min_p) fail("'maxProperties' at {} is below 'minProperties'", where(path));
    std::set<std::string> required;
    if (req != s.end()) {
      if (!req->is_array()) fail("'required' at {} must be a list of names", where(path));
      for (const json& r : *req) {
        if (!r.is_string()) fail("'required' at {} must be a list of names", where(path));
        required.insert(r.get<std::string>());
      }
    }
    if (props != s.end() && !props->is_object()) fail("'properties' at {} must be an object", where(path));
    if (extra != s.end() && !extra->is_boolean() && !extra->is_object())
      fail("'additionalProperties' at {} must be a boolean or a schema", where(path));
    const bool has_props = props != s.end() && !props->empty();
    if (!has_props) {
      for (const std::string& r : required)
        fail("required property '{}' at {} is not in 'properties' (declare it there)", r, where(path));
      if (extra != s.end() && extra->is_boolean() && !extra->get<bool>()) {
        if (min_p > 0) fail("the object at {} allows no properties but 'minProperties' is {}", where(path), min_p);
        return g_.seq({g_.literal("{"), b_.ws(), g_.literal("}")});
      }
      if (min_p > 1024 || max_p > 1024) fail("'minProperties' / 'maxProperties' at {} above 1024 is not supported", where(path));
      if (extra != s.end() && extra->is_object()) {
        std::string epath = pointer_child(path, "additionalProperties");
        const json& es = *extra;
        return b_.map_object([&] { return value(es, epath); }, min_p, max_p);
      }
      return b_.map_object([&] { return b_.any_value(); }, min_p, max_p);
    }
    for (const std::string& r : required)
      if (!props->contains(r)) fail("required property '{}' at {} is not in 'properties' (declare it there)", r, where(path));
    const int64_t n = static_cast<int64_t>(props->size());
    if (max_p >= 0 && max_p < static_cast<int64_t>(required.size()))
      fail("'maxProperties' at {} is below the number of required properties", where(path));
    if (min_p > n)
      fail("'minProperties' at {} is above the number of declared properties (kiln generates declared properties "
           "only)",
           where(path));
    // Members in declaration order over lanes by how many were written: lane 0 has no comma before the next member.
    // Without min/maxProperties only "none" and "some" matter (lanes 0 and 1, 1 meaning one or more).
    const bool counted = min_p > 0 || max_p >= 0;
    const int64_t lanes = counted ? n + 1 : 2;
    auto lane_after = [&](int64_t c) { return counted ? c + 1 : 1; };
    Frag head = g_.seq({g_.literal("{"), b_.ws()});
    std::vector<int32_t> at(static_cast<size_t>(lanes));
    for (auto& a : at) a = g_.empty().start;
    g_.link(head.end, at[0]);
    for (auto it = props->begin(); it != props->end(); ++it) {
      std::string ppath = pointer_child(pointer_child(path, "properties"), it.key());
      std::vector<int32_t> next(static_cast<size_t>(lanes));
      for (auto& a : next) a = g_.empty().start;
      const bool optional = !required.count(it.key());
      for (int64_t c = 0; c < lanes; ++c) {
        if (optional) g_.link(at[static_cast<size_t>(c)], next[static_cast<size_t>(c)]);
        const int64_t to = lane_after(c);
        if (to >= lanes || (max_p >= 0 && counted && c + 1 > max_p)) continue;
        Frag member = g_.seq({g_.literal(json(it.key()).dump()), b_.ws(), g_.literal(":"), b_.ws(), value(it.value(), ppath)});
        if (c > 0) member = g_.seq({b_.ws(), g_.literal(","), b_.ws(), member});
        g_.link(at[static_cast<size_t>(c)], member.start);
        g_.link(member.end, next[static_cast<size_t>(to)]);
      }
      at = std::move(next);
    }
    const int32_t done = g_.empty().start;
    for (int64_t c = 0; c < lanes; ++c) {
      if (counted && c < min_p) continue;
      Frag close = c == 0 ? g_.literal("}") : g_.seq({b_.ws(), g_.literal("}")});
      g_.link(at[static_cast<size_t>(c)], close.start);
      g_.link(close.end, done);
    }
    return {head.start, done};
  }

  // The schema a $ref names ("#", "#/$defs/NAME", "#/definitions/NAME"), and its path.
  const json& lookup(const std::string& target, const std::string& path, std::string* target_path = nullptr) {
    const json* node = nullptr;
    if (target == "#") {
      node = &root_;
    } else {
      for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
        std::string p(prefix);
        if (target.rfind(p, 0) != 0) continue;
        std::string name = target.substr(p.size());
        std::string defs_key = p.substr(2, p.size() - 3);
        auto defs = root_.find(defs_key);
        if (defs != root_.end() && defs->is_object() && defs->contains(name)) node = &(*defs)[name];
      }
      if (!node)
        fail("'$ref' '{}' at {} is not supported or not found (supported: \"#\", \"#/$defs/NAME\", "
             "\"#/definitions/NAME\")",
             target, where(path));
    }
    if (target_path) *target_path = target == "#" ? "" : target.substr(1);
    return *node;
  }

  Frag ref(const json& r, const std::string& path) {
    if (!r.is_string()) fail("'$ref' at {} must be a string", where(path));
    std::string tpath;
    const json& node = lookup(r.get<std::string>(), path, &tpath);
    return value(node, tpath);
  }

  // s with its top-level $ref followed (a chain of at most 32).
  const json& resolve(const json& s, const std::string& path) {
    const json* cur = &s;
    for (int hops = 0; cur->is_object() && cur->contains("$ref"); ++hops) {
      if (hops >= 32) fail("'$ref' at {} goes round in a loop", where(path));
      bool siblings = false;
      for (auto it = cur->begin(); it != cur->end(); ++it)
        if (it.key() != "$ref" && constrains(it.key())) siblings = true;
      if (siblings) break;
      const json& r = (*cur)["$ref"];
      if (!r.is_string()) fail("'$ref' at {} must be a string", where(path));
      cur = &lookup(r.get<std::string>(), path);
    }
    return *cur;
  }

  // allOf (and $ref with sibling keywords) as one schema: properties merged (a property in two branches gets the
  // allOf of both), required joined, bounds tightened, equal keywords kept; anything else that differs is a 400.
  json merge_all_of(const json& s, const std::string& path) {
    std::vector<json> parts;
    std::function<void(const json&, int)> flatten = [&](const json& x, int depth) {
      if (depth > 16) fail("'allOf' / '$ref' at {} nest too deeply (or go round in a loop)", where(path));
      const json& r = x.is_object() && x.contains("$ref") ? resolve_ref_only(x, path) : x;
      if (r.is_boolean()) {
        if (!r.get<bool>()) fail("'allOf' at {} has a false branch: no value can match", where(path));
        return;
      }
      if (!r.is_object()) fail("the JSON schema in 'allOf' at {} must be an object or a boolean", where(path));
      json rest = json::object();
      for (auto it = r.begin(); it != r.end(); ++it) {
        if (it.key() == "allOf") {
          if (!it->is_array() || it->empty()) fail("'allOf' at {} must be a non-empty array", where(path));
          for (const json& b : *it) flatten(b, depth + 1);
        } else if (it.key() == "$ref") {
          flatten(json{{"$ref", *it}}, depth + 1);
        } else if (constrains(it.key())) {
          rest[it.key()] = it.value();
        }
      }
      parts.push_back(std::move(rest));
    };
    flatten(s, 0);
    json out = json::object();
    std::vector<std::set<std::string>> closed;  // property sets of branches with additionalProperties false
    for (const json& p : parts) {
      for (auto it = p.begin(); it != p.end(); ++it) check_keywords(json{{it.key(), it.value()}}, path);
      if (auto a = p.find("additionalProperties"); a != p.end() && a->is_boolean() && !a->get<bool>()) {
        std::set<std::string> names;
        if (auto pr = p.find("properties"); pr != p.end() && pr->is_object())
          for (auto k = pr->begin(); k != pr->end(); ++k) names.insert(k.key());
        closed.push_back(std::move(names));
      }
      for (auto it = p.begin(); it != p.end(); ++it) {
        const std::string& k = it.key();
        const json& v = it.value();
        if (!out.contains(k)) {
          out[k] = v;
          continue;
        }
        json& cur = out[k];
        if (cur == v) continue;
        if (k == "properties" && cur.is_object() && v.is_object()) {
          for (auto q = v.begin(); q != v.end(); ++q) {
            if (!cur.contains(q.key())) cur[q.key()] = q.value();
            else if (cur[q.key()] != q.value()) cur[q.key()] = json{{"allOf", json::array({cur[q.key()], q.value()})}};
          }
        } else if (k == "required" && cur.is_array() && v.is_array()) {
          for (const json& r : v)
            if (std::find(cur.begin(), cur.end(), r) == cur.end()) cur.push_back(r);
        } else if (k == "items" || k == "additionalProperties") {
          if (k == "additionalProperties" && ((cur.is_boolean() && !cur.get<bool>()) || (v.is_boolean() && !v.get<bool>())))
            cur = false;
          else if (cur.is_boolean() && cur.get<bool>()) cur = v;
          else if (!(v.is_boolean() && v.get<bool>())) cur = json{{"allOf", json::array({cur, v})}};
        } else if (k == "type") {
          auto bits = [](const json& t) {
            unsigned b = 0;
            if (t.is_string()) b = type_bits_of_name(t.get<std::string>());
            else if (t.is_array())
              for (const json& x : t)
                if (x.is_string()) b |= type_bits_of_name(x.get<std::string>());
            return b;
          };
          const unsigned both = bits(cur) & bits(v);
          if (both == 0) fail("'allOf' at {} asks for types that no value has", where(path));
          json names = json::array();
          for (unsigned bit : {kNull, kBool, kObject, kArray, kString})
            if (both & bit) names.push_back(type_name(bit));
          if ((both & (kInteger | kFraction)) == (kInteger | kFraction)) names.push_back("number");
          else if (both & kInteger) names.push_back("integer");
          cur = names.size() == 1 ? names[0] : names;
        } else if (cur.is_number() && v.is_number() &&
                   (k == "minimum" || k == "exclusiveMinimum" || k == "minLength" || k == "minItems" ||
                    k == "minProperties")) {
          if (v.get<double>() > cur.get<double>()) cur = v;
        } else if (cur.is_number() && v.is_number() &&
                   (k == "maximum" || k == "exclusiveMaximum" || k == "maxLength" || k == "maxItems" ||
                    k == "maxProperties")) {
          if (v.get<double>() < cur.get<double>()) cur = v;
        } else {
          fail("'allOf' at {}: two branches set '{}' differently (kiln merges allOf only where the branches agree, "
               "or for properties, required, type, items and bounds)",
               where(path), k);
        }
      }
    }
    // A branch that forbids extra properties forbids the properties only other branches declare.
    if (!closed.empty() && out.contains("properties") && out["properties"].is_object()) {
      json kept = json::object();
      for (auto q = out["properties"].begin(); q != out["properties"].end(); ++q) {
        bool everywhere = true;
        for (const auto& names : closed) everywhere = everywhere && names.count(q.key());
        if (everywhere) kept[q.key()] = q.value();
      }
      if (auto r = out.find("required"); r != out.end() && r->is_array())
        for (const json& name : *r)
          if (name.is_string() && !kept.contains(name.get<std::string>()))
            fail("'allOf' at {}: property '{}' is required but a branch forbids it (additionalProperties false)",
                 where(path), name.get<std::string>());
      out["properties"] = kept;
    }
    return out;
  }

  // A {"$ref": ...} (siblings go to the caller) followed to its target.
  const json& resolve_ref_only(const json& x, const std::string& path) {
    const json& r = x["$ref"];
    if (!r.is_string()) fail("'$ref' at {} must be a string", where(path));
    bool siblings = false;
    for (auto it = x.begin(); it != x.end(); ++it)
      if (it.key() != "$ref" && constrains(it.key())) siblings = true;
    if (siblings) return x;  // flatten() splits it
    return lookup(r.get<std::string>(), path);
  }

  // oneOf is enforced as anyOf when no value can match two branches: their types differ, their const / enum values
  // differ, or both are objects that require one property with different const / enum values (a discriminator).
  struct Shape {
    unsigned types = kAnyType;
    std::optional<std::vector<json>> values;  // const / enum
    std::map<std::string, std::vector<json>> required_values;  // required property -> its const / enum values
  };
  Shape shape(const json& b, const std::string& path) {
    Shape sh;
    const json& s = resolve(b, path);
    if (!s.is_object()) return sh;
    auto values_of = [&](const json& x) -> std::optional<std::vector<json>> {
      const json& r = resolve(x, path);
      if (!r.is_object()) return std::nullopt;
      if (auto c = r.find("const"); c != r.end()) return std::vector<json>{*c};
      if (auto e = r.find("enum"); e != r.end() && e->is_array()) return std::vector<json>(e->begin(), e->end());
      return std::nullopt;
    };
    if (auto t = s.find("type"); t != s.end()) {
      sh.types = 0;
      if (t->is_string()) sh.types = type_bits_of_name(t->get<std::string>());
      else if (t->is_array())
        for (const json& x : *t)
          if (x.is_string()) sh.types |= type_bits_of_name(x.get<std::string>());
    }
    sh.values = values_of(s);
    if (sh.values) {
      unsigned vt = 0;
      for (const json& v : *sh.values) vt |= type_bits_of_value(v);
      sh.types &= vt;
    }
    auto props = s.find("properties");
    auto req = s.find("required");
    if (props != s.end() && props->is_object() && req != s.end() && req->is_array())
      for (const json& r : *req)
        if (r.is_string() && props->contains(r.get<std::string>()))
          if (auto v = values_of((*props)[r.get<std::string>()])) sh.required_values[r.get<std::string>()] = *v;
    return sh;
  }

  static bool disjoint_values(const std::vector<json>& a, const std::vector<json>& b) {
    for (const json& x : a)
      for (const json& y : b)
        if (x == y) return false;
    return true;
  }

  void check_disjoint(const std::vector<json>& branches, const std::string& path) {
    std::vector<Shape> shapes;
    for (const json& b : branches) shapes.push_back(shape(b, path));
    for (size_t i = 0; i < shapes.size(); ++i)
      for (size_t j = 0; j < i; ++j) {
        const Shape &a = shapes[i], &b = shapes[j];
        if ((a.types & b.types) == 0) continue;
        if (a.values && b.values && disjoint_values(*a.values, *b.values)) continue;
        bool split = false;
        if (((a.types | b.types) & ~unsigned(kObject)) == 0)
          for (const auto& [name, va] : a.required_values)
            if (auto vb = b.required_values.find(name); vb != b.required_values.end() && disjoint_values(va, vb->second))
              split = true;
        if (split) continue;
        fail("'oneOf' at {}: branches {} and {} may both match one value; kiln enforces oneOf only when its branches "
             "cannot overlap (different types, different const / enum values, or a required property with different "
             "const values); use anyOf",
             where(path), j, i);
      }
  }

  JsonBuilder& b_;
  Grammar& g_;
  const json& root_;
  std::map<std::string, int32_t> rules_;  // schema path -> its rule
  int depth_ = 0;
};

json parse_schema(std::string_view text, const char* what) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("{} is not valid JSON", what);
  check_json_depth(j, what);
  return j;
}

}  // namespace

std::shared_ptr<const Grammar> json_object_grammar(const JsonGrammarOptions& options) {
  auto g = std::make_shared<Grammar>();
  JsonBuilder b(*g, options);
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->seq({b.ws(), b.any_object()}));
  g->set_root(root);
  g->validate();
  return g;
}

std::shared_ptr<const Grammar> json_schema_grammar(std::string_view schema_json, const JsonGrammarOptions& options) {
  json schema = parse_schema(schema_json, "the JSON schema");
  auto g = std::make_shared<Grammar>();
  g->set_limits(compile_limits());
  JsonBuilder b(*g, options);
  SchemaCompiler c(b, schema);
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->seq({b.ws(), c.value(schema, "")}));
  g->set_root(root);
  g->prune_unproductive();
  return g;
}

std::shared_ptr<const Grammar> regex_grammar(std::string_view pattern) {
  auto g = std::make_shared<Grammar>();
  g->set_limits(compile_limits());
  int32_t root = g->new_rule("root");
  g->define_rule(root, grammar::compile_regex(*g, pattern));
  g->set_root(root);
  g->prune_unproductive();
  return g;
}
std::shared_ptr<const Grammar> ebnf_grammar(std::string_view ebnf) { return grammar::parse_ebnf(ebnf, compile_limits()); }

namespace {

void check_tag_name(const std::string& name, const char* what) {
  if (name.empty()) fail("a tool's {} is empty", what);
  for (char c : name)
    if (c == '<' || c == '>' || c == '\n' || c == '\r')
      fail("tool {} '{}' contains '{}', which the XML tool-call format cannot carry", what, name, c == '\n' ? "\\n" : std::string(1, c));
}

}  // namespace

std::shared_ptr<const Grammar> tool_call_grammar(const std::vector<ToolSpec>& tools, bool parallel, bool text_first) {
  if (tools.empty()) fail("no tools to call (give 'tools')");
  auto g = std::make_shared<Grammar>();
  g->set_limits(compile_limits());
  JsonBuilder b(*g);
  std::vector<json> schemas;
  for (const ToolSpec& t : tools) schemas.push_back(t.parameters_json.empty() ? json::object()
                                                                               : parse_schema(t.parameters_json, "a tool's parameters schema"));
  int32_t call_rule = g->new_rule("tool-call");
  std::vector<Frag> calls;
  for (size_t i = 0; i < tools.size(); ++i) {
    const ToolSpec& t = tools[i];
    const json& ps = schemas[i];
    check_tag_name(t.name, "function name");
    std::string base = "/tools/" + t.name + "/parameters";
    if (!ps.is_object()) fail("the parameters of tool '{}' must be a JSON schema object", t.name);
    if (auto ty = ps.find("type"); ty != ps.end() && *ty != "object")
      fail("the parameters of tool '{}' must have type \"object\"", t.name);
    for (auto it = ps.begin(); it != ps.end(); ++it)
      if (it.key() != "type" && it.key() != "properties" && it.key() != "required" && it.key() != "additionalProperties" &&
          it.key() != "$defs" && it.key() != "definitions" && !annotation_keywords().count(it.key()))
        fail("unsupported JSON schema keyword '{}' in the parameters of tool '{}'", it.key(), t.name);
    std::set<std::string> required;
    if (auto r = ps.find("required"); r != ps.end() && r->is_array())
      for (const json& x : *r)
        if (x.is_string()) required.insert(x.get<std::string>());
    SchemaCompiler c(b, ps);
    std::vector<Frag> parts{g->literal("<tool_call>\n<function=" + t.name + ">\n")};
    auto props = ps.find("properties");
    if (props != ps.end() && props->is_object()) {
      for (auto it = props->begin(); it != props->end(); ++it) {
        check_tag_name(it.key(), "parameter name");
        Frag p = g->seq({g->literal("<parameter=" + it.key() + ">\n"), c.tool_value(it.value(), base + "/properties/" + it.key()),
                         g->literal("\n</parameter>\n")});
        parts.push_back(required.count(it.key()) ? p : g->opt(p));
      }
    }
    for (const std::string& r : required)
      if (props == ps.end() || !props->contains(r))
        fail("required parameter '{}' of tool '{}' is not in its 'properties'", r, t.name);
    parts.push_back(g->literal("</function>\n</tool_call>"));
    calls.push_back(g->seq(std::move(parts)));
  }
  g->define_rule(call_rule, g->alt(std::move(calls)));
  int32_t root = g->new_rule("root");
  auto lead = no_bytes();
  lead[' '] = lead['\n'] = true;
  Frag head = g->repeat([&] { return g->byte_set(lead); }, 0, 4);
  Frag body = parallel ? g->seq({g->call(call_rule), g->star(g->seq({g->literal("\n"), g->call(call_rule)}))})
                       : g->call(call_rule);
  if (text_first) {
    std::array<bool, 128> no_lt{};
    for (int i = 1; i < 128; ++i) no_lt[static_cast<size_t>(i)] = i != '<';
    std::array<bool, 128> after_lt = no_lt;  // "<t" could start <tool_call>, "</" a closing tag
    after_lt['t'] = after_lt['/'] = false;
    Frag text = g->star(g->alt({b.utf8_char(no_lt), g->seq({g->literal("<"), b.utf8_char(after_lt)})}));
    g->define_rule(root, g->seq({text, g->opt(g->seq({head, body}))}));
  } else {
    g->define_rule(root, g->seq({head, body}));
  }
  g->set_root(root);
  g->prune_unproductive();
  return g;
}

namespace {

std::shared_ptr<const Grammar> response_format_grammar(const ojson& rf) {
  if (rf.is_null()) return nullptr;
  const std::string type = rf["type"].get<std::string>();
  if (type == "text") return nullptr;
  JsonGrammarOptions options;
  if (auto aw = rf.find("any_whitespace"); aw != rf.end()) {
    if (!aw->is_boolean()) throw bad_param("response_format", "response_format.any_whitespace must be a boolean");
    options.any_whitespace = aw->get<bool>();
  }
  if (type == "json_object") return json_object_grammar(options);
  if (type == "json_schema") {
    auto js = rf.find("json_schema");
    if (js == rf.end() || !js->is_object())
      throw bad_param("response_format", "response_format json_schema needs 'json_schema': {name, schema, strict}");
    auto schema = js->find("schema");
    if (schema == js->end()) throw bad_param("response_format", "response_format.json_schema needs a 'schema'");
    if (auto st = js->find("strict"); st != js->end() && !st->is_boolean() && !st->is_null())
      throw bad_param("response_format", "response_format.json_schema.strict must be a boolean");
    try {
      check_json_depth(*schema, "the JSON schema");
      return json_schema_grammar(schema->dump(), options);
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      throw bad_param("response_format", std::string("response_format.json_schema.schema: ") + e.what());
    }
  }
  throw bad_param("response_format", "response_format type '" + type +
                                         "' is not supported (use text, json_object or json_schema)");
}

// The output constraint a request's own fields ask for: response_format (json), SGLang's regex or ebnf.
std::shared_ptr<const Grammar> requested_grammar(const GenerationFields& r) {
  auto format = response_format_grammar(r.response_format);
  const int asked = (format != nullptr) + r.regex.has_value() + r.ebnf.has_value();
  if (asked > 1)
    throw bad_param(r.regex ? "regex" : "ebnf",
                    "give at most one of response_format (json_object / json_schema), 'regex' and 'ebnf'");
  auto compile = [](const char* param, auto&& make) -> std::shared_ptr<const Grammar> {
    try {
      return make();
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      throw bad_param(param, std::string("'") + param + "': " + e.what());
    }
  };
  if (r.regex) return compile("regex", [&] { return regex_grammar(*r.regex); });
  if (r.ebnf) return compile("ebnf", [&] { return ebnf_grammar(*r.ebnf); });
  return format;
}

}  // namespace

std::shared_ptr<const Grammar> completion_grammar(const CompletionRequest& r) { return requested_grammar(r); }

std::shared_ptr<const Grammar> chat_grammar(const ChatRequest& r, bool tool_parser_on) {
  auto format = requested_grammar(r);
  // Which tools a call may name, and whether a call is required.
  std::string mode = "auto", name;
  if (r.tool_choice.is_string()) mode = r.tool_choice.get<std::string>();
  else if (r.tool_choice.is_object()) mode = "function", name = r.tool_choice["function"]["name"].get<std::string>();
  bool any_strict = false;
  std::vector<ToolSpec> specs;
  if (r.tools.is_array()) {
    for (const auto& t : r.tools) {
      const auto& fn = t["function"];
      std::string fname = fn["name"].get<std::string>();
      if (mode == "function" && fname != name) continue;
      if (auto st = fn.find("strict"); st != fn.end() && st->is_boolean() && st->get<bool>()) any_strict = true;
      auto params = fn.find("parameters");
      specs.push_back({fname, params == fn.end() || params->is_null() ? "" : params->dump()});
    }
  }
  const bool forced = mode == "required" || mode == "function";
  if (forced && r.tools.is_null()) throw bad_param("tool_choice", "tool_choice '" + mode + "' needs 'tools'");
  if (mode == "function" && specs.empty())
    throw bad_param("tool_choice", "tool_choice names function '" + name + "', which is not in 'tools'");
  const bool constrain_tools = forced || (mode == "auto" && any_strict);
  if (!constrain_tools) return format;
  if (format)
    throw bad_param(r.regex ? "regex" : r.ebnf ? "ebnf" : "response_format",
                    std::string(r.regex ? "'regex'" : r.ebnf ? "'ebnf'" : "response_format json_object / json_schema") +
                        " cannot be combined with tool_choice '" + mode + "' or strict tools");
  if (!tool_parser_on)
    throw bad_param("tool_choice", "constrained tool calls need the tool-call parser (start kiln serve with "
                                   "--tool-call-parser qwen3_coder)");
  try {
    return tool_call_grammar(specs, mode != "function" && r.parallel_tool_calls, /*text_first=*/!forced);
  } catch (const InternalError&) {
    throw;
  } catch (const Error& e) {
    throw bad_param("tools", e.what());
  }
}

namespace {

// GPT-2 byte-level alphabet: code point -> byte (the inverse of bytes_to_unicode).
const std::unordered_map<uint32_t, uint8_t>& byte_level_inverse() {
  static const auto table = [] {
    std::unordered_map<uint32_t, uint8_t> inv;
    std::vector<bool> direct(256, false);
    for (int b = '!'; b <= '~'; ++b) direct[static_cast<size_t>(b)] = true;
    for (int b = 0xA1; b <= 0xAC; ++b) direct[static_cast<size_t>(b)] = true;
    for (int b = 0xAE; b <= 0xFF; ++b) direct[static_cast<size_t>(b)] = true;
    uint32_t n = 0;
    for (int b = 0; b < 256; ++b) {
      if (direct[static_cast<size_t>(b)]) inv[static_cast<uint32_t>(b)] = static_cast<uint8_t>(b);
      else inv[256 + n++] = static_cast<uint8_t>(b);
    }
    return inv;
  }();
  return table;
}

// A vocabulary string in the byte-level alphabet -> its bytes; nullopt when some character is outside
// the alphabet (an added token written as plain text).
std::optional<std::string> byte_level_decode(const std::string& s) {
  const auto& inv = byte_level_inverse();
  std::string out;
  for (size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    uint32_t cp;
    size_t len;
    if (c < 0x80) cp = c, len = 1;
    else if ((c >> 5) == 6 && i + 1 < s.size()) cp = ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu), len = 2;
    else return std::nullopt;  // the alphabet has nothing above U+0143
    auto it = inv.find(cp);
    if (it == inv.end()) return std::nullopt;
    out.push_back(static_cast<char>(it->second));
    i += len;
  }
  return out;
}

}  // namespace

std::shared_ptr<const grammar::TokenTable> token_table(const tok::Tokenizer& tokenizer, int64_t vocab_size) {
  const int64_t n = std::max<int64_t>(vocab_size, tokenizer.vocab_size());
  std::vector<std::string> bytes(static_cast<size_t>(n));
  for (int64_t i = 0; i < tokenizer.vocab_size(); ++i) {
    auto id = static_cast<int32_t>(i);
    if (tokenizer.is_special(id)) continue;
    std::string raw = tokenizer.id_to_token(id);
    if (raw.empty()) continue;
    auto b = byte_level_decode(raw);
    bytes[static_cast<size_t>(i)] = b ? *b : raw;
  }
  return std::make_shared<grammar::TokenTable>(std::move(bytes));
}

void warm_token_table(const std::shared_ptr<const grammar::TokenTable>& table) {
  grammar::CompiledGrammar g(json_object_grammar(), table);
  // Inside a string (at a character boundary, and after a backslash): the views every JSON string shares.
  for (std::string_view prefix : {"{\"", "{\"\\"}) {
    const int32_t s = g.step_bytes(g.initial_state(), prefix);
    if (s >= 0) g.mask(s);
  }
}

}  // namespace kiln::server
