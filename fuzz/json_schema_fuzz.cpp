// libFuzzer target for structured-output grammars: any JSON schema, regular expression or tool parameter schema
// must either compile within the limits of server/structured_output.h or fail with a user error (kiln::Error, not
// an InternalError), and a compiled grammar's automaton must run over any bytes without crashing.
//
// Input: first byte selects the mode (mod 5; 0: JSON schema, 1: SGLang regex, 2: a tool's parameters schema, 3: JSON
// schema with any_whitespace, 4: SGLang EBNF); the rest up to the first NUL byte is the schema or pattern, the bytes after it are text fed
// to the automaton.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/error.h"
#include "engine/grammar/grammar.h"
#include "server/structured_output.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  const size_t nul = rest.find('\0');
  const std::string spec(rest.substr(0, nul));
  const std::string_view text = nul == std::string_view::npos ? std::string_view() : rest.substr(nul + 1);
  std::shared_ptr<const kiln::grammar::Grammar> g;
  try {
    switch (data[0] % 5) {
      case 0: g = kiln::server::json_schema_grammar(spec); break;
      case 1: g = kiln::server::regex_grammar(spec); break;
      case 2: g = kiln::server::tool_call_grammar({{"f", spec}}, /*parallel=*/true); break;
      case 4: g = kiln::server::ebnf_grammar(spec); break;
      default: {
        kiln::server::JsonGrammarOptions o;
        o.any_whitespace = true;
        g = kiln::server::json_schema_grammar(spec, o);
      }
    }
  } catch (const kiln::InternalError&) {
    __builtin_trap();  // a bug: bad input must be a user error
  } catch (const kiln::Error&) {
    return 0;
  }
  if (g->nodes().size() > kiln::server::kMaxGrammarNodes + 1024) __builtin_trap();  // past the node limit
  try {
    kiln::grammar::Automaton a(g);
    int32_t s = a.initial_state();
    for (char c : text) {
      s = a.step(s, static_cast<uint8_t>(c));
      if (s == kiln::grammar::Automaton::kDead) break;
      (void)a.accepting(s);
      (void)a.opaque_view(s);
    }
  } catch (const kiln::InternalError&) {
    __builtin_trap();
  } catch (const kiln::Error&) {
  }
  return 0;
}
