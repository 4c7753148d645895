// EBNF grammar text -> Grammar (SGLang's "ebnf" sampling parameter; the GBNF dialect of llama.cpp and xgrammar).
//
//   root   ::= "{" ws pair ("," ws pair)* "}"     # a comment
//   pair   ::= [a-z]+ ws ":" ws value
//   ws     ::= [ \t\n]{0,4}
// Rules: NAME ::= alternatives (NAME: letters, digits, '_', '-'); a rule runs until the next "NAME ::=". Terms:
// "string" (escapes \n \r \t \\ \" \' \[ \] \xHH \uHHHH \UHHHHHHHH), [class] and [^class] of code points (ranges and
// the same escapes), '.' (any character), a rule name, ( group ); postfix * + ? {m} {m,} {m,n} (n <= kMaxRepeat);
// '|' alternation. The start rule is "root". Errors (syntax, an undefined rule, left recursion, a rule that can never
// end, the limits) are kiln::Error with the line.
#pragma once
#include <memory>
#include <string_view>

#include "engine/grammar/grammar.h"

namespace kiln::grammar {

std::shared_ptr<Grammar> parse_ebnf(std::string_view text, const CompileLimits& limits = {});

}  // namespace kiln::grammar
