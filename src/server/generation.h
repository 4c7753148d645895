// The path every generating route shares (chat and text completions, Anthropic Messages, Responses): a chat
// request rendered through the template and tokenized with its answer grammar and parser options; the
// context checks; submission to the engine (503 / 400 answers for a full queue, draining, invalid); and the
// answer: SSE through the job's stream rendering, or a wait for the whole body, both watching for the client
// to leave. A route differs only in how it parses its body into a ChatRequest and in its job's rendering
// (GenerationJob's virtual methods).
#pragma once
#include <httplib.h>

#include <memory>
#include <string>
#include <vector>

#include "server/choice_output.h"
#include "server/protocol.h"
#include "server/response.h"

namespace kiln::server {

struct ServerState;

// A chat request made ready to generate: its prompt tokens and text, and how to read the output.
struct PreparedChat {
  std::string prompt_text;
  std::vector<int32_t> prompt;  // with each image's placeholder expanded to its token count
  std::vector<engine::ImageInput> images;
  ChoiceOptions choice;
};

// Renders the template (a template error is a 400 on `messages_param`), tokenizes, reads and preprocesses the images
// (a bad image is a 400 naming its part), picks the parsers, and sets cr.constraint from response_format / tool_choice
// (structured_output.h).
PreparedChat prepare_chat(ServerState& state, ChatRequest& cr, const char* messages_param = "messages");

// Fills the job's common fields (id = prefix + random hex) and counts it as active.
void init_job(ServerState& state, GenerationJob& job, const std::string& id_prefix, const char* endpoint,
              const GenerationFields& fields);

// Checks the prompts against the context, submits n sequences per prompt, and answers (streamed or not).
void run_generation(ServerState& state, const httplib::Request& req, httplib::Response& res,
                    const std::shared_ptr<GenerationJob>& job, const std::vector<std::vector<int32_t>>& prompts,
                    const ChoiceOptions& choice_opts, const char* prompt_param);

}  // namespace kiln::server
