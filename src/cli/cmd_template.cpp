// kiln template: renders a chat request with a model's chat template, exactly as the server would.
//
//   echo '{"messages":[{"role":"user","content":"Hi"}]}' | kiln template [--model-path DIR]
//   kiln template --model-path DIR --chat-template my.jinja < request.json
//
// The request is an OpenAI chat request (messages, optional tools, add_generation_prompt (default
// true), chat_template_kwargs). The prompt is printed as is, without a trailing newline. Without
// --model-path and --chat-template: the embedded model's template.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <sstream>

#include "cli/command.h"
#include "core/error.h"
#include "format/model_dir.h"
#include "template/chat_template.h"

namespace {

struct TemplateOptions {
  std::string model_path;
  std::string chat_template_file;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) kiln::fail("cannot read chat template file {}", path);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int run_template(const TemplateOptions& opts) {
  std::optional<std::string> jinja_text;
  std::string tokenizer_config;
  // The model folder: the given one, else the embedded model (unless a template file alone is given).
  if (!opts.model_path.empty() || opts.chat_template_file.empty()) {
    auto dir = kiln::format::ModelDir::open_or_embedded(opts.model_path);
    if (dir.has("chat_template.jinja")) jinja_text = dir.read_text("chat_template.jinja");
    if (dir.has("tokenizer_config.json")) tokenizer_config = dir.read_text("tokenizer_config.json");
  }
  if (!opts.chat_template_file.empty()) jinja_text = read_file(opts.chat_template_file);

  auto tmpl = kiln::tmpl::ChatTemplate::from_model_files(jinja_text, tokenizer_config);
  std::string request((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  std::string prompt = tmpl->render_json_text(request);
  std::fwrite(prompt.data(), 1, prompt.size(), stdout);
  return 0;
}

kiln::cli::Registrar reg{"template", "Render a chat request (JSON on stdin) with a model's chat template",
                         [](CLI::App& app) {
                           auto opts = std::make_shared<TemplateOptions>();
                           app.add_option("--model-path", opts->model_path,
                                          "Model folder (chat_template.jinja or tokenizer_config.json); default: the "
                                          "embedded model");
                           app.add_option("--chat-template", opts->chat_template_file,
                                          "Jinja file to use instead of the model's template");
                           return [opts]() -> int { return run_template(*opts); };
                         }};

}  // namespace
