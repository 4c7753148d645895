// A compiled Jinja template. Rendering mirrors Python's jinja2 in the environment Hugging Face uses
// for chat templates: ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
// extensions=[loopcontrols, generation]), HF's tojson filter, raise_exception and strftime_now.
#pragma once
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>

#include "template/jinja/ast.h"
#include "template/jinja/lexer.h"
#include "template/jinja/value.h"

namespace kiln::tmpl::jinja {

// Guards against runaway templates (recursion, endless loops, huge outputs).
struct RenderLimits {
  int max_call_depth = 200;         // nested macro calls / recursive loops
  uint64_t max_steps = 20'000'000;  // loop iterations + macro calls + expressions
  size_t max_output_bytes = 256u << 20;
  int64_t max_range = 100'000;  // as jinja2.sandbox.MAX_RANGE
};

class Template {
 public:
  // Throws kiln::Error with line:column on syntax errors and unknown filters/tests.
  explicit Template(std::string_view source, const LexerOptions& options = {});

  // vars: template variables. The globals (range, dict, namespace, cycler, joiner, raise_exception,
  // strftime_now) are available unless vars shadows them.
  // Throws TemplateRaised (raise_exception) or kiln::Error "chat template error at line L, column C: ...".
  std::string render(const std::unordered_map<std::string, Value>& vars,
                     const RenderLimits& limits = {}) const;

 private:
  Body body_;
};

}  // namespace kiln::tmpl::jinja
