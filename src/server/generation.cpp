#include "server/generation.h"

#include <fmt/format.h>

#include "core/error.h"
#include "engine/engine.h"
#include "media/image_decode.h"
#include "media/image_source.h"
#include "server/server_state.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

using json = nlohmann::json;

namespace {

// n sequences per prompt, in order (choice index = prompt index x n + j, as OpenAI numbers them).
std::vector<engine::GenerateRequest> make_requests(const std::string& id,
                                                   const std::vector<std::vector<int32_t>>& prompts,
                                                   const GenerationFields& f, const std::vector<int64_t>& max_tokens,
                                                   const std::vector<engine::ImageInput>& images) {
  std::vector<engine::GenerateRequest> reqs;
  const bool several = prompts.size() * static_cast<size_t>(f.n) > 1;
  for (size_t p = 0; p < prompts.size(); ++p)
    for (int j = 0; j < f.n; ++j) {
      const size_t i = reqs.size();
      engine::GenerateRequest r;
      r.id = several ? id + "-" + std::to_string(i) : id;
      r.prompt = prompts[p];
      r.sampling = f.sampling;
      if (r.sampling.seed && i > 0) r.sampling.seed = *r.sampling.seed + static_cast<uint64_t>(i);
      r.max_tokens = max_tokens[p];
      r.min_tokens = f.min_tokens;
      r.ignore_eos = f.ignore_eos;
      r.stop_token_ids = f.stop_token_ids;
      r.want_logprobs = f.logprobs;
      r.top_logprobs = f.top_logprobs;
      r.constraint = f.constraint;
      if (prompts.size() == 1) r.images = images;
      reqs.push_back(std::move(r));
    }
  return reqs;
}

// The output budget of each prompt; 400 when a prompt is empty or cannot fit the context.
std::vector<int64_t> check_prompts(const engine::Engine& eng, const GenerationFields& f,
                                   const std::vector<std::vector<int32_t>>& prompts, const char* prompt_param) {
  const int64_t context = eng.context_length();
  std::vector<int64_t> max_tokens;
  for (size_t p = 0; p < prompts.size(); ++p) {
    const std::string param = prompts.size() > 1 ? std::string(prompt_param) + "[" + std::to_string(p) + "]"
                                                 : std::string(prompt_param);
    const int64_t prompt_len = static_cast<int64_t>(prompts[p].size());
    if (prompt_len == 0) throw bad_param(param, "the prompt is empty");
    if (prompt_len >= context)
      throw ApiError(400,
                     fmt::format("the prompt{} has {} tokens, but the context length is {} tokens; shorten it",
                                 prompts.size() > 1 ? " " + param : "", prompt_len, context),
                     param, "context_length_exceeded");
    max_tokens.push_back(f.max_tokens.value_or(context - prompt_len));
    if (std::string why = eng.check_fits(prompt_len, max_tokens.back()); !why.empty())
      throw ApiError(400, why, f.max_tokens ? "max_tokens" : param, "context_length_exceeded");
  }
  return max_tokens;
}

// Cancels the job's sequences because the client left.
void client_left(GenerationJob& job) {
  job.client_gone = true;
  job.channel->cancel();
}

void answer_streamed(httplib::Response& res, const std::shared_ptr<GenerationJob>& job) {
  res.status = 200;
  res.set_header("Cache-Control", "no-cache");
  res.set_header("X-Accel-Buffering", "no");
  res.set_chunked_content_provider(
      "text/event-stream",
      [job](size_t, httplib::DataSink& sink) -> bool {
        std::string out;
        if (!job->started) {
          job->started = true;
          out = job->stream_prologue();
        }
        std::vector<engine::TokenEvent> events;
        job->channel->wait(events, kWaitSlice);
        if (!events.empty()) {
          auto deltas = job->absorb(events);
          out += job->stream_events(deltas);
        }
        // Tokens that show no text (held back, special) write nothing: look at the socket too.
        if (!job->done && job->probe_due() && job->probe.peer_gone()) {
          client_left(*job);
          return false;
        }
        if (!out.empty() && !sink.write(out.data(), out.size())) {
          client_left(*job);
          return false;
        }
        if (job->done) sink.done();
        return true;
      },
      [job](bool success) {
        if (!success || !job->done) {
          client_left(*job);
          if (job->status == 200) job->status = 499;  // client closed the request
        }
        job->log_line();
      });
}

// Non-streamed: waits here for every choice, watching for the client to leave.
void answer_whole(httplib::Response& res, const std::shared_ptr<GenerationJob>& job) {
  while (!job->all_finished()) {
    std::vector<engine::TokenEvent> events;
    job->channel->wait(events, kWaitSlice);
    if (!events.empty()) job->accumulate_text(job->absorb(events));
    if (!job->all_finished() && job->probe_due() && job->probe.peer_gone()) {
      client_left(*job);
      job->status = 499;
      job->log_line();
      res.status = 499;
      return;
    }
  }
  for (const auto& c : job->choices) {
    if (c.engine_reason() == engine::FinishReason::error) {
      job->status = 500;
      job->log_line();
      throw ApiError(500, "generation failed: " + c.error());
    }
    if (c.engine_reason() == engine::FinishReason::abort) {  // a shutdown that timed out
      job->status = 503;
      job->log_line();
      throw shutdown_abort_error();
    }
  }
  send_json(res, 200, job->final_response());
  job->log_line();
}

// Reads, decodes and preprocesses the request's images, then gives each image placeholder of the prompt (in order) the
// image's token count: the prompt the engine runs and usage counts.
void place_images(ServerState& state, const ChatRequest& cr, PreparedChat& p, const char* messages_param) {
  const ModelContext& m = state.model;
  if (!m.image_processor || m.image_token_id < 0)
    throw bad_param(cr.images.front().where, "this model reads text only: it has no vision encoder loaded");
  std::vector<size_t> at;
  for (size_t i = 0; i < p.prompt.size(); ++i)
    if (p.prompt[i] == m.image_token_id) at.push_back(i);
  if (at.size() != cr.images.size())
    throw ApiError(400,
                   fmt::format("the chat template placed {} image placeholders for the request's {} images (an image "
                               "in a message the template does not render, or a placeholder token typed as text)",
                               at.size(), cr.images.size()),
                   messages_param);
  std::vector<int32_t> prompt;
  for (size_t i = 0; i < cr.images.size(); ++i) {
    const ImageRef& ref = cr.images[i];
    media::ProcessedImage img;
    try {
      const media::EncodedImage enc = media::load_image_url(ref.url, m.media);
      img = m.image_processor->process(media::decode_image(enc.bytes, m.media.max_pixels));
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      throw bad_param(ref.where, fmt::format("image {} ('{}'): {}", i, ref.where, e.what()));
    }
    prompt.insert(prompt.end(), p.prompt.begin() + static_cast<std::ptrdiff_t>(i == 0 ? 0 : at[i - 1] + 1),
                  p.prompt.begin() + static_cast<std::ptrdiff_t>(at[i]));
    engine::ImageInput in;
    in.offset = static_cast<int64_t>(prompt.size());
    in.grid_t = img.grid_t;
    in.grid_h = img.grid_h;
    in.grid_w = img.grid_w;
    in.hash = img.hash.low ^ (img.hash.high * 0x9E3779B97F4A7C15ull);
    prompt.insert(prompt.end(), static_cast<size_t>(img.num_image_tokens()), m.image_token_id);
    in.pixel_values = std::move(img.pixel_values);
    p.images.push_back(std::move(in));
  }
  prompt.insert(prompt.end(), p.prompt.begin() + static_cast<std::ptrdiff_t>(at.back() + 1), p.prompt.end());
  p.prompt = std::move(prompt);
}

}  // namespace

PreparedChat prepare_chat(ServerState& state, ChatRequest& cr, const char* messages_param) {
  auto answer_grammar = chat_grammar(cr, state.tools_on);
  const tmpl::ChatTemplate* chat_template = state.model.chat_template;
  if (!chat_template)
    throw ApiError(400, "this model has no chat template; use /v1/completions, or start kiln serve with --chat-template",
                   messages_param);
  PreparedChat p;
  try {
    p.prompt_text = chat_template->render(cr.template_input);
  } catch (const InternalError&) {
    throw;
  } catch (const Error& e) {
    throw ApiError(400, std::string("the chat template rejected the request: ") + e.what(), messages_param);
  }
  p.prompt = state.model.tokenizer->encode(p.prompt_text, /*parse_special=*/true);
  if (!cr.images.empty()) place_images(state, cr, p, messages_param);
  ChoiceOptions& co = p.choice;
  co.stop = cr.stop;
  co.skip_special_tokens = cr.skip_special_tokens;
  co.parse_reasoning = state.reasoning_on && cr.separate_reasoning;
  co.start_in_reasoning = tmpl::ChatTemplate::prompt_ends_inside_think(p.prompt_text);
  co.parse_tool_calls = state.tools_on && !cr.tools.is_null() && !cr.tool_choice_none;
  if (co.parse_tool_calls) co.tools = json::parse(cr.tools.dump());
  co.max_tool_calls = cr.parallel_tool_calls ? -1 : 1;
  co.want_logprobs = cr.logprobs;
  cr.constraint = state.make_constraint(std::move(answer_grammar), co.start_in_reasoning);
  return p;
}

void init_job(ServerState& state, GenerationJob& job, const std::string& id_prefix, const char* endpoint,
              const GenerationFields& fields) {
  state.active_jobs.fetch_add(1);
  job.active = &state.active_jobs;
  job.id = id_prefix + random_hex(24);
  job.endpoint = endpoint;
  job.created = unix_now();
  job.model_name = state.opts.served_model_name;
  job.fields = fields;
}

void run_generation(ServerState& state, const httplib::Request& req, httplib::Response& res,
                    const std::shared_ptr<GenerationJob>& job, const std::vector<std::vector<int32_t>>& prompts,
                    const ChoiceOptions& choice_opts, const char* prompt_param) {
  engine::Engine& eng = *state.model.engine;
  const GenerationFields& f = job->fields;
  std::vector<int64_t> max_tokens = check_prompts(eng, f, prompts, prompt_param);
  int64_t prompt_total = 0;
  for (const auto& p : prompts) prompt_total += static_cast<int64_t>(p.size());  // once per prompt, whatever n is
  const size_t num_choices = prompts.size() * static_cast<size_t>(f.n);

  job->prompt_tokens = prompt_total;
  job->tokenizer = state.model.tokenizer;
  for (size_t i = 0; i < num_choices; ++i) job->choices.emplace_back(*state.model.tokenizer, choice_opts);
  job->acc.resize(num_choices);
  job->probe = ConnectionProbe(req.remote_addr, req.remote_port, req.local_port);

  const std::string client_id = client_request_id(req);
  job->request_id = client_id.empty() ? job->id : client_id;
  std::vector<engine::GenerateRequest> reqs = make_requests(job->request_id, prompts, f, max_tokens, job->images);
  job->images.clear();  // the requests hold them now
  if (job->reasoning_budget >= 0) {  // the continuation after the thinking budget starts from this request
    job->engine = &eng;
    job->submitted = reqs.at(0);
  }
  engine::SubmitResult sr = eng.submit(std::move(reqs));
  switch (sr.status) {
    case engine::SubmitStatus::ok: break;
    case engine::SubmitStatus::queue_full: throw ApiError(503, sr.message, "", "queue_full");
    case engine::SubmitStatus::draining: throw ApiError(503, sr.message, "", "shutting_down");
    case engine::SubmitStatus::invalid: throw ApiError(400, sr.message, prompt_param, "invalid_request");
  }
  // From here on the job writes its own request-log line (the rejection logger skips answers with this id).
  res.set_header("X-Request-Id", job->request_id);
  job->channel = sr.channel;
  if (f.stream) answer_streamed(res, job);
  else answer_whole(res, job);
}

}  // namespace kiln::server
