#include "server/http_server.h"

#include <httplib.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <regex>
#include <thread>

#include "core/error.h"
#include "core/log.h"
#include "engine/engine.h"
#include "server/api_error.h"
#include "server/header_gate.h"
#include "server/metrics_text.h"
#include "server/protocol.h"
#include "server/response.h"
#include "server/structured_output.h"
#include "template/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kiln::server {

using json = nlohmann::json;

namespace {

bool constant_time_equal(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

const char* status_reason(int status) {
  switch (status) {
    case 400: return "bad request";
    case 401: return "unauthorized";
    case 404: return "not found";
    case 405: return "method not allowed";
    case 408: return "request timeout";
    case 413: return "payload too large";
    case 414: return "URI too long";
    case 500: return "internal server error";
    case 503: return "service unavailable";
    default: return "error";
  }
}

}  // namespace

// A connection as httplib's request processing reads it: a read buffer (its line reader asks for one byte at a
// time), the server's read and write timeouts.
class SocketStream : public httplib::Stream {
 public:
  SocketStream(socket_t sock, int read_timeout_s, int write_timeout_s)
      : sock_(sock), read_ms_(read_timeout_s * 1000), write_ms_(write_timeout_s * 1000) {}

  bool is_readable() const override { return off_ < len_ || ready(POLLIN, read_ms_); }
  bool is_writable() const override { return ready(POLLOUT, write_ms_); }

  ssize_t read(char* ptr, size_t size) override {
    if (off_ >= len_) {
      if (!ready(POLLIN, read_ms_)) return -1;
      ssize_t n;
      do n = ::recv(sock_, buf_, sizeof(buf_), 0);
      while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      off_ = 0;
      len_ = static_cast<size_t>(n);
    }
    size_t n = std::min(size, len_ - off_);
    std::memcpy(ptr, buf_ + off_, n);
    off_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!ready(POLLOUT, write_ms_)) return -1;
    ssize_t n;
    do n = ::send(sock_, ptr, size, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address(true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address(false, ip, port); }
  socket_t socket() const override { return sock_; }

 private:
  bool ready(short events, int timeout_ms) const {
    pollfd p{sock_, events, 0};
    int r;
    do r = ::poll(&p, 1, timeout_ms);
    while (r < 0 && errno == EINTR);
    return r > 0 && (p.revents & (events | POLLHUP)) != 0 && !(p.revents & (POLLERR | POLLNVAL));
  }
  void address(bool remote, std::string& ip, int& port) const {
    sockaddr_storage a{};
    socklen_t len = sizeof(a);
    int r = remote ? getpeername(sock_, reinterpret_cast<sockaddr*>(&a), &len)
                   : getsockname(sock_, reinterpret_cast<sockaddr*>(&a), &len);
    if (r != 0) return;
    char host[NI_MAXHOST] = "";
    if (getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof(host), nullptr, 0, NI_NUMERICHOST) == 0)
      ip = host;
    if (a.ss_family == AF_INET) port = ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
    else if (a.ss_family == AF_INET6) port = ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  }

  socket_t sock_;
  int read_ms_, write_ms_;
  char buf_[4096];
  size_t off_ = 0, len_ = 0;
};

// The httplib server with two changes. (1) The listen backlog is raised (the library's is 5, a compile-time
// constant: a burst of clients would see dropped or reset connections). (2) A new connection waits for its
// request headers in the HeaderGate, not in a worker of the pool: slow or silent clients cannot hold the
// workers that real requests need. Once the headers are there, a worker serves the connection (keep-alive
// included) as httplib would, through httplib's own request processing.
class ListeningServer : public httplib::Server {
 public:
  ListeningServer() = default;
  ~ListeningServer() override { stop_gate(); }

  void raise_backlog(int backlog) {
    socket_t fd = svr_sock_;
    if (fd != INVALID_SOCKET) ::listen(fd, backlog);
  }

  void configure(const ServerOptions& o) {
    read_timeout_s_ = o.read_timeout_s;
    write_timeout_s_ = o.write_timeout_s;
    keep_alive_timeout_s_ = o.keep_alive_timeout_s;
    HeaderGateOptions g;
    g.timeout_ms = o.header_timeout_ms;
    g.max_waiting = o.max_waiting_connections;
    gate_ = std::make_unique<HeaderGate>(g, [this](int fd) { dispatch(fd); });
    const int threads = o.http_threads > 0 ? o.http_threads : 64;
    // A fixed pool: each connection being served (an SSE stream included) holds one worker while it is open.
    new_task_queue = [this, threads] { return new Pool(*this, static_cast<size_t>(threads)); };
  }

  void stop_gate() {
    if (gate_) gate_->stop();
  }

 private:
  // The pool of workers; it tells the server while it can take connections.
  class Pool : public httplib::ThreadPool {
   public:
    Pool(ListeningServer& s, size_t n) : httplib::ThreadPool(n), server_(s) {
      std::lock_guard<std::mutex> lock(server_.pool_mu_);
      server_.pool_ = this;
    }
    void shutdown() override {
      {
        std::lock_guard<std::mutex> lock(server_.pool_mu_);
        server_.pool_ = nullptr;
      }
      httplib::ThreadPool::shutdown();
    }

   private:
    ListeningServer& server_;
  };

  // Headers complete: a worker takes the connection.
  void dispatch(int fd) {
    std::lock_guard<std::mutex> lock(pool_mu_);
    if (!pool_) {
      ::close(fd);
      return;
    }
    pool_->enqueue([this, fd] { serve(fd); });
  }

  // httplib's accept loop hands every new connection here (on a worker): into the gate.
  bool process_and_close_socket(socket_t sock) override {
    gate_->admit(sock);
    return true;
  }

  // What httplib does with a connection: requests while the client keeps it alive and the server runs.
  bool serve(socket_t sock) {
    bool ok = false;
    for (size_t count = keep_alive_max_count_; svr_sock_ != INVALID_SOCKET && count > 0 && next_request(sock);
         --count) {
      SocketStream strm(sock, read_timeout_s_, write_timeout_s_);
      bool connection_closed = false;
      ok = process_request(strm, /*close_connection=*/count == 1, connection_closed, nullptr);
      if (!ok || connection_closed) break;
    }
    ::shutdown(sock, SHUT_RDWR);
    ::close(sock);
    return ok;
  }

  // Waits (up to the keep-alive timeout) for the next request's bytes; false when none come or the peer left.
  bool next_request(socket_t sock) const {
    const auto deadline = Clock::now() + std::chrono::seconds(keep_alive_timeout_s_);
    while (svr_sock_ != INVALID_SOCKET) {
      pollfd p{sock, POLLIN, 0};
      int r = ::poll(&p, 1, 50);
      if (r < 0 && errno != EINTR) return false;
      if (r > 0) {
        if (p.revents & (POLLERR | POLLNVAL)) return false;
        char c;
        return ::recv(sock, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
      }
      if (Clock::now() >= deadline) return false;
    }
    return false;
  }

  int read_timeout_s_ = 30, write_timeout_s_ = 60, keep_alive_timeout_s_ = 5;
  std::unique_ptr<HeaderGate> gate_;
  std::mutex pool_mu_;
  httplib::ThreadPool* pool_ = nullptr;
};

struct HttpServer::Impl {
  ServerOptions opts;
  ListeningServer svr;
  int bound_port = -1;
  std::atomic<bool> ready{false};
  std::atomic<bool> draining{false};
  ModelContext model;
  bool reasoning_on = false;
  bool tools_on = false;
  ProtocolLimits limits;
  int64_t created_at = unix_now();
  std::mutex stats_mu;
  HttpCounts http_counts;
  std::atomic<int> active_jobs{0};
  std::vector<std::pair<std::regex, std::string>> routes;  // (path pattern, method), for 405 answers

  explicit Impl(ServerOptions o) : opts(std::move(o)) {}

  // Constrained decoding: the vocabulary's byte strings, built (and the JSON string masks warmed) on the first
  // constrained request; compiled grammars shared by the requests with the same grammar.
  std::once_flag token_table_once;
  std::shared_ptr<const grammar::TokenTable> token_table_;
  grammar::GrammarCache grammar_cache_;

  std::shared_ptr<const grammar::Constraint> make_constraint(std::shared_ptr<const grammar::Grammar> g,
                                                             bool starts_in_reasoning) {
    if (!g) return nullptr;
    std::call_once(token_table_once, [&] {
      token_table_ = token_table(*model.tokenizer, model.engine->vocab_size());
      warm_token_table(token_table_);
    });
    auto c = std::make_shared<grammar::Constraint>();
    c->grammar = std::move(g);
    c->tokens = token_table_;
    c->compiled = grammar_cache_.get(c->grammar, token_table_);  // shared by the choices and by later requests
    // Thinking stays free: the grammar starts after "</think>".
    if (starts_in_reasoning) c->start_after_token = model.tokenizer->token_to_id("</think>");
    return c;
  }

  // --- helpers ---

  static void send_json(httplib::Response& res, int status, const json& body) {
    res.status = status;
    res.set_content(dump_json(body), "application/json");
  }

  void send_error(httplib::Response& res, const ApiError& e) {
    res.status = e.status;
    if (e.status == 503) res.set_header("Retry-After", std::to_string(opts.retry_after_s));
    res.set_content(error_body(e), "application/json");
  }

  void require_model() const {
    if (!ready.load()) throw ApiError(503, "the model is still loading; retry shortly", "", "model_loading");
  }

  void require_generation() const {
    require_model();
    if (draining.load()) throw ApiError(503, "the server is shutting down", "", "shutting_down");
  }

  void check_model_name(const std::optional<std::string>& name) const {
    if (!name || name->empty()) return;
    if (*name == opts.served_model_name || *name == opts.model_path) return;
    throw ApiError(404,
                   "The model '" + *name + "' does not exist; this server serves '" + opts.served_model_name + "'",
                   "model", "model_not_found");
  }

  // Wraps a handler: ApiError and other exceptions become OpenAI error answers.
  httplib::Server::Handler wrap(std::function<void(const httplib::Request&, httplib::Response&)> fn) {
    return [this, fn = std::move(fn)](const httplib::Request& req, httplib::Response& res) {
      try {
        fn(req, res);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const InternalError& e) {
        KILN_LOG_ERROR("{} {}: internal error: {}", req.method, req.path, e.what());
        send_error(res, ApiError(500, std::string("internal error: ") + e.what()));
      } catch (const Error& e) {
        send_error(res, ApiError(400, e.what()));
      } catch (const std::exception& e) {
        KILN_LOG_ERROR("{} {}: {}", req.method, req.path, e.what());
        send_error(res, ApiError(500, std::string("internal error: ") + e.what()));
      }
    };
  }

  // --- generation ---

  // n sequences per prompt, in order (choice index = prompt index x n + j, as OpenAI numbers them).
  std::vector<engine::GenerateRequest> make_requests(const std::string& id,
                                                     const std::vector<std::vector<int32_t>>& prompts,
                                                     const GenerationFields& f,
                                                     const std::vector<int64_t>& max_tokens) const {
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
        r.ignore_eos = f.ignore_eos;
        r.stop_token_ids = f.stop_token_ids;
        r.want_logprobs = f.logprobs;
        r.top_logprobs = f.top_logprobs;
        r.constraint = f.constraint;
        reqs.push_back(std::move(r));
      }
    return reqs;
  }

  void run_generation(const httplib::Request& req, httplib::Response& res, std::shared_ptr<GenerationJob> job,
                      const std::vector<std::vector<int32_t>>& prompts, const ChoiceOptions& choice_opts,
                      const char* prompt_param) {
    engine::Engine& eng = *model.engine;
    const GenerationFields& f = job->fields;
    const int64_t context = eng.context_length();
    std::vector<int64_t> max_tokens;
    int64_t prompt_total = 0;
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
      prompt_total += prompt_len;  // usage counts each prompt once, whatever n is
    }
    const size_t num_choices = prompts.size() * static_cast<size_t>(f.n);

    job->prompt_tokens = prompt_total;
    job->tokenizer = model.tokenizer;
    for (size_t i = 0; i < num_choices; ++i) job->choices.emplace_back(*model.tokenizer, choice_opts);
    job->acc.resize(num_choices);
    job->probe = ConnectionProbe(req.remote_addr, req.remote_port, req.local_port);

    engine::SubmitResult sr = eng.submit(make_requests(job->id, prompts, f, max_tokens));
    switch (sr.status) {
      case engine::SubmitStatus::ok: break;
      case engine::SubmitStatus::queue_full: throw ApiError(503, sr.message, "", "queue_full");
      case engine::SubmitStatus::draining: throw ApiError(503, sr.message, "", "shutting_down");
      case engine::SubmitStatus::invalid: throw ApiError(400, sr.message, prompt_param, "invalid_request");
    }
    // From here on the job writes its own request-log line (the rejection logger skips answers with this id).
    res.set_header("X-Request-Id", job->id);
    job->channel = sr.channel;

    if (f.stream) {
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
              job->client_gone = true;
              job->channel->cancel();
              return false;
            }
            if (!out.empty() && !sink.write(out.data(), out.size())) {
              job->client_gone = true;
              job->channel->cancel();
              return false;
            }
            if (job->done) sink.done();
            return true;
          },
          [job](bool success) {
            if (!success || !job->done) {
              job->client_gone = true;
              job->channel->cancel();
              if (job->status == 200) job->status = 499;  // client closed the request
            }
            job->log_line();
          });
      return;
    }

    // Non-streamed: wait here, watching for the client to leave.
    while (!job->all_finished()) {
      std::vector<engine::TokenEvent> events;
      job->channel->wait(events, kWaitSlice);
      if (!events.empty()) job->accumulate_text(job->absorb(events));
      if (!job->all_finished() && job->probe_due() && job->probe.peer_gone()) {
        job->client_gone = true;
        job->channel->cancel();
        job->status = 499;
        job->log_line();
        res.status = 499;
        return;
      }
    }
    for (const auto& c : job->choices)
      if (c.engine_reason() == engine::FinishReason::error) {
        job->status = 500;
        job->log_line();
        throw ApiError(500, "generation failed: " + c.error());
      }
    send_json(res, 200, job->final_response());
    job->log_line();
  }

  std::shared_ptr<GenerationJob> new_job(bool chat, const char* endpoint, const GenerationFields& f) {
    auto job = std::make_shared<GenerationJob>();
    active_jobs.fetch_add(1);
    job->active = &active_jobs;
    job->chat = chat;
    job->id = (chat ? "chatcmpl-" : "cmpl-") + random_hex(24);
    job->endpoint = endpoint;
    job->created = unix_now();
    job->model_name = opts.served_model_name;
    job->fields = f;
    return job;
  }

  void handle_chat(const httplib::Request& req, httplib::Response& res) {
    require_generation();
    ChatRequest cr = parse_chat_request(req.body, limits);
    check_model_name(cr.model);
    auto answer_grammar = chat_grammar(cr, tools_on);
    if (!model.chat_template)
      throw ApiError(400,
                     "this model has no chat template; use /v1/completions, or start kiln serve with --chat-template",
                     "messages");
    std::string prompt_text;
    try {
      prompt_text = model.chat_template->render(cr.template_input);
    } catch (const InternalError&) {
      throw;
    } catch (const Error& e) {
      throw ApiError(400, std::string("the chat template rejected the request: ") + e.what(), "messages");
    }
    std::vector<int32_t> prompt = model.tokenizer->encode(prompt_text, /*parse_special=*/true);

    ChoiceOptions co;
    co.stop = cr.stop;
    co.skip_special_tokens = cr.skip_special_tokens;
    co.parse_reasoning = reasoning_on && cr.separate_reasoning;
    co.start_in_reasoning = tmpl::ChatTemplate::prompt_ends_inside_think(prompt_text);
    co.parse_tool_calls = tools_on && !cr.tools.is_null() && !cr.tool_choice_none;
    if (co.parse_tool_calls) co.tools = json::parse(cr.tools.dump());
    co.max_tool_calls = cr.parallel_tool_calls ? -1 : 1;
    co.want_logprobs = cr.logprobs;
    cr.constraint = make_constraint(std::move(answer_grammar), co.start_in_reasoning);
    auto job = new_job(true, "/v1/chat/completions", cr);
    job->stream_reasoning = cr.stream_reasoning;
    run_generation(req, res, job, {prompt}, co, "messages");
  }

  void handle_completion(const httplib::Request& req, httplib::Response& res) {
    require_generation();
    CompletionRequest cr = parse_completion_request(req.body, limits);
    check_model_name(cr.model);
    if (cr.echo && cr.logprobs) throw bad_param("echo", "'echo' together with 'logprobs' is not supported");
    cr.constraint = make_constraint(completion_grammar(cr), false);
    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::string> echo_texts;  // per choice
    for (const auto& p : cr.prompts) {
      std::string echo_text;
      if (auto* text = std::get_if<std::string>(&p)) {
        prompts.push_back(model.tokenizer->encode(*text, /*parse_special=*/true));
        echo_text = *text;
      } else {
        prompts.push_back(std::get<std::vector<int32_t>>(p));
        if (cr.echo) echo_text = model.tokenizer->decode(prompts.back(), false);
      }
      if (cr.echo) echo_texts.insert(echo_texts.end(), static_cast<size_t>(cr.n), echo_text);
    }
    ChoiceOptions co;
    co.stop = cr.stop;
    co.skip_special_tokens = cr.skip_special_tokens;
    co.want_logprobs = cr.logprobs;
    auto job = new_job(false, "/v1/completions", cr);
    job->echo_texts = std::move(echo_texts);
    run_generation(req, res, job, prompts, co, "prompt");
  }

  // --- operational endpoints ---

  void handle_health(const httplib::Request&, httplib::Response& res) {
    res.status = ready.load() && !draining.load() ? 200 : 503;
    res.set_content("", "text/plain");
    // A runner that cannot run steps any more (a multi-node group that broke) is not healthy; say why.
    if (res.status == 200 && model.engine) {
      const std::string why = model.engine->fatal_error();
      if (!why.empty()) {
        res.status = 503;
        res.set_content(why + "\n", "text/plain");
      }
    }
  }

  // As SGLang's: healthy as soon as the engine finishes a step after the check began, whether the step served
  // this check's own one-token generation or other requests, so a busy server (a full batch, a queue) answers
  // at once instead of after its queue. 503 when the engine makes no step for 20 s or the generation fails.
  void handle_health_generate(const httplib::Request&, httplib::Response& res) {
    require_generation();
    engine::Engine& eng = *model.engine;
    const uint64_t steps_before = eng.metrics().steps_total;
    engine::GenerateRequest r;
    r.id = "health-" + random_hex(8);
    r.prompt = model.tokenizer->encode("ping", false);
    if (r.prompt.empty()) r.prompt = {0};
    r.max_tokens = 1;
    r.ignore_eos = true;
    r.sampling.temperature = 0.0f;
    engine::SubmitResult sr = eng.submit({r});
    if (sr.status == engine::SubmitStatus::draining) throw ApiError(503, "the server is shutting down", "", "shutting_down");
    if (sr.status == engine::SubmitStatus::invalid) throw ApiError(503, "health generation not accepted: " + sr.message);
    // queue_full: the queue is busy, not the engine; its steps answer.
    std::shared_ptr<engine::RequestChannel> channel = sr.status == engine::SubmitStatus::ok ? sr.channel : nullptr;
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    std::vector<engine::TokenEvent> events;
    bool ok = false;
    std::string failure;
    while (!ok && failure.empty() && Clock::now() < deadline) {
      if (channel) {
        events.clear();
        channel->wait(events, std::chrono::milliseconds(20));
        for (const auto& ev : events)
          if (ev.finished) {
            if (ev.finish_reason == engine::FinishReason::error) failure = ev.error;
            else ok = true;
          }
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (failure.empty() && eng.metrics().steps_total > steps_before) ok = true;
    }
    if (channel) channel->cancel();  // done with it: the engine drops it if it has not run yet
    if (!failure.empty()) throw ApiError(503, "health generation failed: " + failure);
    if (!ok) throw ApiError(503, "the engine made no step within 20 s");
    res.status = 200;
    res.set_content("", "text/plain");
  }

  json model_card() const {
    return {{"id", opts.served_model_name},
            {"object", "model"},
            {"created", created_at},
            {"owned_by", "kiln"},
            {"root", opts.model_path},
            {"max_model_len", model.engine ? model.engine->context_length() : 0}};
  }

  void handle_models(const httplib::Request&, httplib::Response& res) {
    require_model();
    send_json(res, 200, {{"object", "list"}, {"data", json::array({model_card()})}});
  }

  void handle_model(const httplib::Request& req, httplib::Response& res) {
    require_model();
    std::string name = req.matches[1];
    check_model_name(name);
    send_json(res, 200, model_card());
  }

  void handle_model_info(const httplib::Request&, httplib::Response& res) {
    require_model();
    send_json(res, 200,
              {{"model_path", opts.model_path},
               {"tokenizer_path", opts.tokenizer_path},
               {"is_generation", true},
               {"preferred_sampling_params", nullptr},
               {"weight_version", opts.weight_version},
               {"has_image_understanding", false},
               {"has_audio_understanding", false},
               {"model_type", opts.model_type},
               {"architectures", opts.architectures},
               {"served_model_name", opts.served_model_name},
               {"context_length", model.engine->context_length()},
               {"vocab_size", model.engine->vocab_size()},
               {"eos_token_ids", opts.eos_token_ids}});
  }

  void handle_server_info(const httplib::Request&, httplib::Response& res) {
    json info = opts.server_args.is_object() ? opts.server_args : json::object();
    info["version"] = "0.1.0";
    info["status"] = !ready.load() ? "loading" : draining.load() ? "draining" : "ready";
    info["served_model_name"] = opts.served_model_name;
    info["reasoning_parser"] = reasoning_on ? "qwen3" : "none";
    info["tool_call_parser"] = tools_on ? "qwen3_coder" : "none";
    if (ready.load()) {
      engine::Engine& eng = *model.engine;
      const auto& cap = eng.capacity();
      auto m = eng.metrics();
      info["context_length"] = eng.context_length();
      info["page_size"] = cap.page_size;
      info["kv_pages"] = cap.kv_pages;
      info["max_total_num_tokens"] = cap.kv_pages * cap.page_size;
      info["state_slots"] = cap.state_slots;
      info["kv_bytes_per_token"] = cap.kv_bytes_per_token;
      info["state_bytes_per_slot"] = cap.state_bytes_per_slot;
      info["max_running_requests"] = eng.options().max_running_requests;
      info["max_queued_requests"] = eng.options().max_queued_requests;
      info["chunked_prefill_size"] = eng.options().chunked_prefill_size;
      info["backend"] = eng.describe();
      // One entry per GPU rank of this node (empty on the CPU backend).
      json gpus = json::array();
      for (const model::DeviceMemory& d : eng.device_memory())
        gpus.push_back({{"rank", d.rank}, {"gpu", d.device}, {"name", d.name}, {"weight_bytes", d.weight_bytes},
                        {"kv_cache_bytes", d.kv_bytes}, {"state_bytes", d.state_bytes},
                        {"scratch_bytes", d.scratch_bytes}, {"total_bytes", d.total_bytes}});
      info["gpus"] = gpus;
      info["internal_states"] = json::array({{{"num_running_reqs", m.num_running},
                                              {"num_queue_reqs", m.num_waiting},
                                              {"kv_pages_used", m.kv_pages_used},
                                              {"token_usage", m.kv_pages_total ? double(m.kv_pages_used) / m.kv_pages_total : 0.0}}});
    }
    send_json(res, 200, info);
  }

  void handle_metrics(const httplib::Request&, httplib::Response& res) {
    engine::EngineMetricsSnapshot m;
    std::vector<model::DeviceMemory> devices;
    if (ready.load()) {
      m = model.engine->metrics();
      devices = model.engine->device_memory();
    }
    HttpCounts counts;
    {
      std::lock_guard<std::mutex> lock(stats_mu);
      counts = http_counts;
    }
    res.status = 200;
    res.set_content(render_metrics(m, counts, opts.served_model_name, devices), "text/plain; version=0.0.4");
  }

  void handle_tokenize(const httplib::Request& req, httplib::Response& res) {
    require_model();
    ojson body = parse_json_object(req.body);
    const char* key = body.contains("prompt") ? "prompt" : "text";
    if (!body.contains(key)) throw bad_param("prompt", "'prompt' (or 'text') is required");
    const ojson& p = body[key];
    auto encode = [&](const ojson& s) {
      if (!s.is_string()) throw bad_param(key, std::string("'") + key + "' must be a string or a list of strings");
      return model.tokenizer->encode(s.get<std::string>(), true);
    };
    json out = {{"max_model_len", model.engine->context_length()}};
    if (p.is_array()) {
      json tokens = json::array(), counts = json::array();
      for (const auto& s : p) {
        auto ids = encode(s);
        counts.push_back(ids.size());
        tokens.push_back(ids);
      }
      out["tokens"] = tokens;
      out["count"] = counts;
    } else {
      auto ids = encode(p);
      out["tokens"] = ids;
      out["count"] = ids.size();
    }
    send_json(res, 200, out);
  }

  void handle_detokenize(const httplib::Request& req, httplib::Response& res) {
    require_model();
    ojson body = parse_json_object(req.body);
    if (!body.contains("tokens")) throw bad_param("tokens", "'tokens' is required");
    bool skip_special = true;
    if (body.contains("skip_special_tokens")) {
      if (!body["skip_special_tokens"].is_boolean())
        throw bad_param("skip_special_tokens", "'skip_special_tokens' must be a boolean");
      skip_special = body["skip_special_tokens"].get<bool>();
    }
    const int64_t vocab = model.tokenizer->vocab_size();
    auto ids_of = [&](const ojson& list) {
      if (!list.is_array()) throw bad_param("tokens", "'tokens' must be a list of token ids");
      std::vector<int32_t> ids;
      for (const auto& t : list) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab)
          throw bad_param("tokens", "'tokens' must hold token ids in [0, " + std::to_string(vocab) + ")");
        ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
      }
      return ids;
    };
    const ojson& t = body["tokens"];
    json out;
    if (t.is_array() && !t.empty() && t[0].is_array()) {
      json texts = json::array();
      for (const auto& row : t) texts.push_back(model.tokenizer->decode(ids_of(row), skip_special));
      out["text"] = texts;
    } else {
      out["text"] = model.tokenizer->decode(ids_of(t), skip_special);
    }
    send_json(res, 200, out);
  }

  // --- wiring ---

  void setup() {
    svr.configure(opts);
    svr.set_payload_max_length(opts.max_request_bytes);
    svr.set_read_timeout(opts.read_timeout_s, 0);
    svr.set_write_timeout(opts.write_timeout_s, 0);
    svr.set_keep_alive_timeout(opts.keep_alive_timeout_s);
    svr.set_keep_alive_max_count(1000);
    svr.set_tcp_nodelay(true);
    // httplib's default also sets SO_REUSEPORT, which lets a second server bind the same port and
    // silently share its traffic. Keep only SO_REUSEADDR (quick restarts).
    svr.set_socket_options([](socket_t sock) {
      int yes = 1;
      setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    });

    svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (opts.api_key.empty()) return httplib::Server::HandlerResponse::Unhandled;
      if (req.path == "/health" || req.path == "/health_generate" || req.path == "/metrics")
        return httplib::Server::HandlerResponse::Unhandled;
      std::string auth = req.get_header_value("Authorization");
      const std::string prefix = "Bearer ";
      if (auth.size() > prefix.size() && auth.compare(0, prefix.size(), prefix) == 0 &&
          constant_time_equal(auth.substr(prefix.size()), opts.api_key))
        return httplib::Server::HandlerResponse::Unhandled;
      res.status = 401;
      res.set_header("WWW-Authenticate", "Bearer");
      res.set_content(error_body(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                 "authentication_error", "", "invalid_api_key"),
                      "application/json");
      return httplib::Server::HandlerResponse::Handled;
    });

    svr.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (!res.body.empty()) return;  // a handler already wrote its answer
      std::string msg;
      if (res.status == 404) {
        // A path that exists under another method: 405 with the methods it takes.
        std::string allowed;
        for (const auto& [pattern, method] : routes)
          if (method != req.method && std::regex_match(req.path, pattern) && allowed.find(method) == std::string::npos)
            allowed += (allowed.empty() ? "" : ", ") + method;
        if (!allowed.empty()) {
          res.status = 405;
          res.set_header("Allow", allowed);
          msg = "method " + req.method + " is not allowed on " + req.path + " (use " + allowed + ")";
        } else {
          msg = "no route for " + req.method + " " + req.path;
        }
      }
      else if (res.status == 413)
        msg = "the request body is larger than the limit of " + std::to_string(opts.max_request_bytes) + " bytes";
      else
        msg = std::string(status_reason(res.status));
      res.set_content(error_body(res.status, msg), "application/json");
    });

    svr.set_exception_handler([](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown error";
      try {
        if (ep) std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      KILN_LOG_ERROR("{} {}: unhandled: {}", req.method, req.path, what);
      res.status = 500;
      res.set_content(error_body(500, "internal error: " + what), "application/json");
    });

    svr.set_logger([this](const httplib::Request& req, const httplib::Response& res) {
      static const char* known[] = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                                    "/health_generate", "/get_model_info", "/model_info", "/get_server_info",
                                    "/server_info", "/metrics", "/tokenize", "/v1/tokenize", "/detokenize",
                                    "/v1/detokenize"};
      std::string endpoint = "other";
      for (const char* k : known)
        if (req.path == k) endpoint = k;
      if (req.path.rfind("/v1/models/", 0) == 0) endpoint = "/v1/models/{id}";
      // Rejected requests enter the request log too; generations log their own line (they carry X-Request-Id).
      if (res.status >= 400 && !res.has_header("X-Request-Id")) {
        std::string message;
        auto body = json::parse(res.body, nullptr, /*allow_exceptions=*/false);
        if (body.is_object() && body.contains("error") && body["error"].is_object() &&
            body["error"].contains("message") && body["error"]["message"].is_string())
          message = body["error"]["message"].get<std::string>();
        KILN_LOG_INFO("request rejected method={} path={} remote={}:{} status={} error={}", req.method, req.path,
                      req.remote_addr, req.remote_port, res.status, dump_json(message));
      }
      std::lock_guard<std::mutex> lock(stats_mu);
      ++http_counts.requests[{endpoint, res.status}];
    });

    auto bind_get = [this](const char* path, void (Impl::*fn)(const httplib::Request&, httplib::Response&)) {
      routes.emplace_back(std::regex(path), "GET");
      svr.Get(path, wrap([this, fn](const httplib::Request& q, httplib::Response& r) { (this->*fn)(q, r); }));
    };
    auto bind_post = [this](const char* path, void (Impl::*fn)(const httplib::Request&, httplib::Response&)) {
      routes.emplace_back(std::regex(path), "POST");
      svr.Post(path, wrap([this, fn](const httplib::Request& q, httplib::Response& r) { (this->*fn)(q, r); }));
    };
    bind_get("/health", &Impl::handle_health);
    bind_get("/health_generate", &Impl::handle_health_generate);
    bind_get("/v1/models", &Impl::handle_models);
    bind_get(R"(/v1/models/(.+))", &Impl::handle_model);
    bind_get("/get_model_info", &Impl::handle_model_info);
    bind_get("/model_info", &Impl::handle_model_info);
    bind_get("/get_server_info", &Impl::handle_server_info);
    bind_get("/server_info", &Impl::handle_server_info);
    bind_get("/metrics", &Impl::handle_metrics);
    bind_post("/v1/chat/completions", &Impl::handle_chat);
    bind_post("/v1/completions", &Impl::handle_completion);
    bind_post("/tokenize", &Impl::handle_tokenize);
    bind_post("/v1/tokenize", &Impl::handle_tokenize);
    bind_post("/detokenize", &Impl::handle_detokenize);
    bind_post("/v1/detokenize", &Impl::handle_detokenize);
  }
};

HttpServer::HttpServer(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  if (impl_->opts.reasoning_parser != "auto" && impl_->opts.reasoning_parser != "qwen3" &&
      impl_->opts.reasoning_parser != "none")
    fail("unknown --reasoning-parser '{}' (use auto, qwen3 or none)", impl_->opts.reasoning_parser);
  if (impl_->opts.tool_call_parser != "auto" && impl_->opts.tool_call_parser != "qwen3_coder" &&
      impl_->opts.tool_call_parser != "none")
    fail("unknown --tool-call-parser '{}' (use auto, qwen3_coder or none)", impl_->opts.tool_call_parser);
  impl_->setup();
}

HttpServer::~HttpServer() { stop(); }

void HttpServer::bind() {
  const auto& o = impl_->opts;
  if (o.port == 0) {
    impl_->bound_port = impl_->svr.bind_to_any_port(o.host);
    if (impl_->bound_port <= 0) fail("cannot listen on {} (any port)", o.host);
  } else {
    if (!impl_->svr.bind_to_port(o.host, o.port))
      fail("cannot listen on {}:{} (in use, or not an address of this machine); pick another with --port / --host",
           o.host, o.port);
    impl_->bound_port = o.port;
  }
  impl_->svr.raise_backlog(4096);  // the kernel caps it at net.core.somaxconn
}

int HttpServer::port() const { return impl_->bound_port; }

void HttpServer::run() { impl_->svr.listen_after_bind(); }

void HttpServer::stop() {
  impl_->svr.stop();
  impl_->svr.stop_gate();
}

void HttpServer::attach(const ModelContext& model) {
  Impl& s = *impl_;
  KILN_CHECK(model.engine && model.tokenizer, "attach needs an engine and a tokenizer");
  s.model = model;
  s.limits.vocab_size = model.engine->vocab_size();
  s.limits.default_sampling = s.opts.default_sampling;
  const tmpl::ChatTemplate* t = model.chat_template;
  if (s.opts.reasoning_parser == "qwen3")
    s.reasoning_on = true;
  else if (s.opts.reasoning_parser == "auto")
    s.reasoning_on = t && t->injects_think();
  if (s.opts.tool_call_parser == "qwen3_coder")
    s.tools_on = true;
  else if (s.opts.tool_call_parser == "auto")
    s.tools_on = t && t->source().find("<function=") != std::string::npos &&
                 t->source().find("<parameter=") != std::string::npos;
  s.ready.store(true);
}

void HttpServer::set_draining() { impl_->draining.store(true); }
int HttpServer::active_requests() const { return impl_->active_jobs.load(); }
bool HttpServer::reasoning_parser_on() const { return impl_->reasoning_on; }
bool HttpServer::tool_call_parser_on() const { return impl_->tools_on; }

}  // namespace kiln::server
