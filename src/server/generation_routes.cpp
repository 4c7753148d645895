// The OpenAI generation routes: POST /v1/chat/completions and /v1/completions.
#include "server/generation.h"
#include "server/server_state.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

namespace {

void handle_chat(ServerState& s, const httplib::Request& req, httplib::Response& res) {
  s.require_generation();
  ChatRequest cr = parse_chat_request(req.body, s.limits);
  s.check_model_name(cr.model);
  PreparedChat p = prepare_chat(s, cr);
  auto job = std::make_shared<GenerationJob>();
  job->chat = true;
  init_job(s, *job, "chatcmpl-", "/v1/chat/completions", cr);
  job->stream_reasoning = cr.stream_reasoning;
  job->images = std::move(p.images);
  run_generation(s, req, res, job, {p.prompt}, p.choice, "messages");
}

void handle_completion(ServerState& s, const httplib::Request& req, httplib::Response& res) {
  s.require_generation();
  CompletionRequest cr = parse_completion_request(req.body, s.limits);
  s.check_model_name(cr.model);
  if (cr.echo && cr.logprobs) throw bad_param("echo", "'echo' together with 'logprobs' is not supported");
  cr.constraint = s.make_constraint(completion_grammar(cr), false);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> echo_texts;  // per choice
  for (const auto& prompt : cr.prompts) {
    std::string echo_text;
    if (auto* text = std::get_if<std::string>(&prompt)) {
      prompts.push_back(s.model.tokenizer->encode(*text, /*parse_special=*/true));
      echo_text = *text;
    } else {
      prompts.push_back(std::get<std::vector<int32_t>>(prompt));
      if (cr.echo) echo_text = s.model.tokenizer->decode(prompts.back(), false);
    }
    if (cr.echo) echo_texts.insert(echo_texts.end(), static_cast<size_t>(cr.n), echo_text);
  }
  ChoiceOptions co;
  co.stop = cr.stop;
  co.skip_special_tokens = cr.skip_special_tokens;
  co.want_logprobs = cr.logprobs;
  auto job = std::make_shared<GenerationJob>();
  job->chat = false;
  init_job(s, *job, "cmpl-", "/v1/completions", cr);
  job->echo_texts = std::move(echo_texts);
  run_generation(s, req, res, job, prompts, co, "prompt");
}

}  // namespace

void add_generation_routes(Routes& routes, ServerState& state) {
  routes.post("/v1/chat/completions", [&state](const auto& q, auto& r) { handle_chat(state, q, r); });
  routes.post("/v1/completions", [&state](const auto& q, auto& r) { handle_completion(state, q, r); });
}

}  // namespace kiln::server
