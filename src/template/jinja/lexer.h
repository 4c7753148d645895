// Tokenizer for Jinja templates, with Jinja2's whitespace rules as Hugging Face configures them:
// trim_blocks (drop the first newline after a block or comment tag), lstrip_blocks (drop spaces and
// tabs before a block or comment tag that starts a line), `-`/`+` markers on tags, {% raw %},
// newlines normalised to \n and one trailing newline of the source dropped.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln::tmpl::jinja {

struct SourcePos {
  int line = 1;
  int column = 1;
};

enum class Tok : uint8_t {
  Data,
  VariableBegin,
  VariableEnd,
  BlockBegin,
  BlockEnd,
  Name,
  String,
  Integer,
  Float,
  // operators
  Add,
  Sub,
  Div,
  FloorDiv,
  Mul,
  Mod,
  Pow,
  Tilde,
  LBracket,
  RBracket,
  LParen,
  RParen,
  LBrace,
  RBrace,
  Eq,
  Ne,
  Gt,
  GtEq,
  Lt,
  LtEq,
  Assign,
  Dot,
  Colon,
  Pipe,
  Comma,
  Semicolon,
  Eof,
};

struct Token {
  Tok type = Tok::Eof;
  std::string text;  // Data text, name, decoded string literal
  int64_t int_value = 0;
  double float_value = 0;
  SourcePos pos;
};

struct LexerOptions {
  bool trim_blocks = true;
  bool lstrip_blocks = true;
  bool keep_trailing_newline = false;
};

// Throws kiln::Error "... at line L, column C: ..." on malformed input.
std::vector<Token> tokenize(std::string_view source, const LexerOptions& options = {});

std::string_view describe(Tok t);

}  // namespace kiln::tmpl::jinja
