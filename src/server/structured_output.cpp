#include "server/structured_output.h"

#include <map>
#include <optional>
#include <unordered_map>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "server/api_error.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

using grammar::Frag;

namespace {

using json = ojson;  // ordered: keeps "properties" in declaration order

std::array<bool, 256> no_bytes() {
  std::array<bool, 256> a{};
  a.fill(false);
  return a;
}

// Builds JSON pieces into one grammar; shared rules (whitespace, strings, numbers, any value) are made once.
class JsonBuilder {
 public:
  explicit JsonBuilder(Grammar& g) : g_(g) {}

  Frag ws() {
    if (ws_rule_ < 0) {
      ws_rule_ = g_.new_rule("ws");
      auto set = no_bytes();
      for (char c : std::string_view(" \t\n\r")) set[static_cast<uint8_t>(c)] = true;
      g_.define_rule(ws_rule_, g_.repeat([&] { return g_.byte_set(set); }, 0, kMaxWhitespace));
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

  // {"k": v, ...} with any keys; values from make_value.
  Frag map_object(const std::function<Frag()>& make_value) {
    auto member = [&] { return g_.seq({string(), ws(), g_.literal(":"), ws(), make_value()}); };
    Frag members = g_.seq({member(), g_.star(g_.seq({ws(), g_.literal(","), ws(), member()})), ws()});
    return g_.seq({g_.literal("{"), ws(), g_.opt(members), g_.literal("}")});
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
  int32_t ws_rule_ = -1, string_rule_ = -1, integer_rule_ = -1, number_rule_ = -1,
          value_rule_ = -1;
};

const std::set<std::string>& annotation_keywords() {
  static const std::set<std::string> k = {"title",   "description", "default",  "examples",  "$schema",
                                          "$id",     "$comment",    "deprecated", "readOnly", "writeOnly"};
  return k;
}

const std::set<std::string>& supported_keywords() {
  static const std::set<std::string> k = {"type",     "properties", "required", "additionalProperties",
                                          "items",    "minItems",   "maxItems", "minLength",
                                          "maxLength", "enum",      "const",    "anyOf",
                                          "$ref",     "$defs",      "definitions"};
  return k;
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

// JSON Schema -> grammar fragments.
class SchemaCompiler {
 public:
  SchemaCompiler(JsonBuilder& b, const json& root) : b_(b), g_(b.g()), root_(root) {}

  Frag value(const json& s, const std::string& path) {
    if (s.is_boolean()) {
      if (s.get<bool>()) return b_.any_value();
      fail("the JSON schema at {} is false: no value can match it", where(path));
    }
    if (!s.is_object()) fail("the JSON schema at {} must be an object or a boolean", where(path));
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (supported_keywords().count(it.key()) || annotation_keywords().count(it.key())) continue;
      fail("unsupported JSON schema keyword '{}' at {} (supported: type, properties, required, additionalProperties, "
           "items, minItems, maxItems, minLength, maxLength, enum, const, anyOf, $ref, $defs)",
           it.key(), where(path));
    }
    if (auto r = s.find("$ref"); r != s.end()) return ref(*r, pointer_child(path, "$ref"));
    if (auto c = s.find("const"); c != s.end()) return g_.literal(c->dump());
    if (auto e = s.find("enum"); e != s.end()) {
      if (!e->is_array() || e->empty()) fail("'enum' at {} must be a non-empty array", where(path));
      std::vector<Frag> opts;
      for (const json& v : *e) opts.push_back(g_.literal(v.dump()));
      return g_.alt(std::move(opts));
    }
    if (auto a = s.find("anyOf"); a != s.end()) {
      if (!a->is_array() || a->empty()) fail("'anyOf' at {} must be a non-empty array", where(path));
      std::vector<Frag> opts;
      for (size_t i = 0; i < a->size(); ++i)
        opts.push_back(value((*a)[i], pointer_child(path, "anyOf") + "/" + std::to_string(i)));
      return g_.alt(std::move(opts));
    }
    auto t = s.find("type");
    if (t == s.end()) {
      if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required"))
        return typed(s, "object", path);
      if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) return typed(s, "array", path);
      if (s.contains("minLength") || s.contains("maxLength")) return typed(s, "string", path);
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

 private:
  static int64_t count(const json& s, const char* key, int64_t dflt, const std::string& path) {
    auto it = s.find(key);
    if (it == s.end()) return dflt;
    if (!it->is_number_integer() || it->get<int64_t>() < 0)
      fail("'{}' at {} must be a non-negative integer", key, where(path));
    return it->get<int64_t>();
  }

  Frag typed(const json& s, const std::string& type, const std::string& path) {
    if (type == "string") {
      int64_t lo = count(s, "minLength", 0, path), hi = count(s, "maxLength", -1, path);
      if (hi >= 0 && hi < lo) fail("'maxLength' at {} is below 'minLength'", where(path));
      if (hi > 4096 || lo > 4096) fail("'minLength' / 'maxLength' at {} above 4096 is not supported", where(path));
      return b_.string(lo, hi);
    }
    if (type == "integer") return b_.integer();
    if (type == "number") return b_.number();
    if (type == "boolean") return b_.boolean();
    if (type == "null") return g_.literal("null");
    if (type == "array") {
      int64_t lo = count(s, "minItems", 0, path), hi = count(s, "maxItems", -1, path);
      if (hi >= 0 && hi < lo) fail("'maxItems' at {} is below 'minItems'", where(path));
      if (hi > 1024 || lo > 1024) fail("'minItems' / 'maxItems' at {} above 1024 is not supported", where(path));
      auto items = s.find("items");
      std::string ipath = pointer_child(path, "items");
      if (items != s.end() && items->is_array()) fail("'items' at {} as a list (tuple form) is not supported", where(path));
      if (items != s.end() && items->is_boolean() && !items->get<bool>()) hi = 0;
      if (hi == 0 && lo > 0) fail("the array at {} must have items but 'items' is false", where(path));
      const json* item_schema = items != s.end() ? &*items : nullptr;
      return b_.array_of([&] { return item_schema ? value(*item_schema, ipath) : b_.any_value(); }, lo, hi);
    }
    if (type == "object") return object(s, path);
    fail("unsupported JSON schema type '{}' at {} (supported: object, array, string, number, integer, boolean, null)",
         type, where(path));
  }

  Frag object(const json& s, const std::string& path) {
    auto props = s.find("properties");
    auto req = s.find("required");
    auto extra = s.find("additionalProperties");
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
      if (extra != s.end() && extra->is_boolean() && !extra->get<bool>())
        return g_.seq({g_.literal("{"), b_.ws(), g_.literal("}")});
      if (extra != s.end() && extra->is_object()) {
        std::string epath = pointer_child(path, "additionalProperties");
        const json& es = *extra;
        return b_.map_object([&] { return value(es, epath); });
      }
      return b_.any_object();
    }
    for (const std::string& r : required)
      if (!props->contains(r)) fail("required property '{}' at {} is not in 'properties' (declare it there)", r, where(path));
    // Members in declaration order over two lanes: "none" (nothing written yet: no comma before the next
    // member) and "some" (a comma first). An optional member may be skipped; a required one may not.
    Frag head = g_.seq({g_.literal("{"), b_.ws()});
    int32_t none = g_.empty().start, some = g_.empty().start;
    g_.link(head.end, none);
    for (auto it = props->begin(); it != props->end(); ++it) {
      std::string ppath = pointer_child(pointer_child(path, "properties"), it.key());
      auto member = [&] {
        return g_.seq({g_.literal(json(it.key()).dump()), b_.ws(), g_.literal(":"), b_.ws(), value(it.value(), ppath)});
      };
      int32_t next_none = g_.empty().start, next_some = g_.empty().start;
      Frag first = member();
      g_.link(none, first.start);
      g_.link(first.end, next_some);
      Frag later = g_.seq({b_.ws(), g_.literal(","), b_.ws(), member()});
      g_.link(some, later.start);
      g_.link(later.end, next_some);
      if (!required.count(it.key())) {
        g_.link(none, next_none);
        g_.link(some, next_some);
      }
      none = next_none;
      some = next_some;
    }
    Frag close = g_.seq({b_.ws(), g_.literal("}")});
    Frag close_empty = g_.literal("}");
    g_.link(some, close.start);
    g_.link(none, close_empty.start);  // reachable only when every member is optional
    g_.link(close_empty.end, close.end);
    return {head.start, close.end};
  }

public:
  // One argument value of a Qwen3.5 XML tool call: strings are raw text (server/tool_parser.cpp keeps them
  // as they are), other types JSON text that the parser converts by the parameter's type.
  Frag tool_value(const json& s, const std::string& path) {
    if (!s.is_object()) fail("the schema of tool parameter {} must be an object", where(path));
    for (auto it = s.begin(); it != s.end(); ++it)
      if (!supported_keywords().count(it.key()) && !annotation_keywords().count(it.key()))
        fail("unsupported JSON schema keyword '{}' at {}", it.key(), where(path));
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
        int64_t lo = count(s, "minLength", 0, path), hi = count(s, "maxLength", -1, path);
        if (hi >= 0 && hi < lo) fail("'maxLength' at {} is below 'minLength'", where(path));
        if (hi > 4096 || lo > 4096) fail("'minLength' / 'maxLength' at {} above 4096 is not supported", where(path));
        std::array<bool, 128> no_lt{};
        for (int i = 1; i < 128; ++i) no_lt[static_cast<size_t>(i)] = i != '<';
        if (lo > 0 || hi >= 0) {
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
  Frag ref(const json& r, const std::string& path) {
    if (!r.is_string()) fail("'$ref' at {} must be a string", where(path));
    std::string target = r.get<std::string>();
    auto it = ref_rules_.find(target);
    if (it != ref_rules_.end()) return g_.call(it->second);
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
    int32_t rule = g_.new_rule("ref " + target);
    ref_rules_[target] = rule;
    std::string tpath = target == "#" ? "" : target.substr(1);
    g_.define_rule(rule, value(*node, tpath));
    return g_.call(rule);
  }

  JsonBuilder& b_;
  Grammar& g_;
  const json& root_;
  std::map<std::string, int32_t> ref_rules_;
};

json parse_schema(std::string_view text, const char* what) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("{} is not valid JSON", what);
  return j;
}

}  // namespace

std::shared_ptr<const Grammar> json_object_grammar() {
  auto g = std::make_shared<Grammar>();
  JsonBuilder b(*g);
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->seq({b.ws(), b.any_object()}));
  g->set_root(root);
  g->validate();
  return g;
}

std::shared_ptr<const Grammar> json_schema_grammar(std::string_view schema_json) {
  json schema = parse_schema(schema_json, "the JSON schema");
  auto g = std::make_shared<Grammar>();
  JsonBuilder b(*g);
  SchemaCompiler c(b, schema);
  int32_t root = g->new_rule("root");
  g->define_rule(root, g->seq({b.ws(), c.value(schema, "")}));
  g->set_root(root);
  g->validate();
  return g;
}

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
  g->validate();
  return g;
}

namespace {

std::shared_ptr<const Grammar> response_format_grammar(const ojson& rf) {
  if (rf.is_null()) return nullptr;
  const std::string type = rf["type"].get<std::string>();
  if (type == "text") return nullptr;
  if (type == "json_object") return json_object_grammar();
  if (type == "json_schema") {
    auto js = rf.find("json_schema");
    if (js == rf.end() || !js->is_object())
      throw bad_param("response_format", "response_format json_schema needs 'json_schema': {name, schema, strict}");
    auto schema = js->find("schema");
    if (schema == js->end()) throw bad_param("response_format", "response_format.json_schema needs a 'schema'");
    if (auto st = js->find("strict"); st != js->end() && !st->is_boolean() && !st->is_null())
      throw bad_param("response_format", "response_format.json_schema.strict must be a boolean");
    try {
      return json_schema_grammar(schema->dump());
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      throw bad_param("response_format", std::string("response_format.json_schema.schema: ") + e.what());
    }
  }
  throw bad_param("response_format", "response_format type '" + type +
                                         "' is not supported (use text, json_object or json_schema)");
}

}  // namespace

std::shared_ptr<const Grammar> completion_grammar(const CompletionRequest& r) {
  return response_format_grammar(r.response_format);
}

std::shared_ptr<const Grammar> chat_grammar(const ChatRequest& r, bool tool_parser_on) {
  auto format = response_format_grammar(r.response_format);
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
    throw bad_param("response_format", "response_format json_object / json_schema cannot be combined with tool_choice '" +
                                           mode + "' or strict tools");
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
