#include "server/metrics_text.h"

#include <fmt/format.h>

namespace kiln::server {

namespace {

std::string escape_label(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void histogram(std::string& out, const char* name, const char* help, const engine::Histogram::Snapshot& h,
               const std::string& labels) {
  header(out, name, "histogram", help);
  for (size_t i = 0; i < h.upper_bounds.size(); ++i)
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, labels, h.upper_bounds[i], h.cumulative_counts[i]);
  out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, labels, h.count);
  out += fmt::format("{}_sum{{{}}} {}\n", name, labels, h.sum);
  out += fmt::format("{}_count{{{}}} {}\n", name, labels, h.count);
}

}  // namespace

std::string render_metrics(const engine::EngineMetricsSnapshot& m, const HttpCounts& http,
                           const std::string& model_name, const std::vector<model::DeviceMemory>& devices) {
  std::string out;
  std::string model = fmt::format("model_name=\"{}\"", escape_label(model_name));
  auto gauge = [&](const char* name, const char* help, double v) {
    header(out, name, "gauge", help);
    out += fmt::format("{}{{{}}} {}\n", name, model, v);
  };
  auto counter = [&](const char* name, const char* help, double v) {
    header(out, name, "counter", help);
    out += fmt::format("{}{{{}}} {}\n", name, model, v);
  };
  gauge("kiln:num_running_reqs", "Sequences in the running batch.", m.num_running);
  gauge("kiln:num_queue_reqs", "Sequences waiting to be admitted.", m.num_waiting);
  gauge("kiln:kv_pages_used", "KV cache pages held by sequences.", static_cast<double>(m.kv_pages_used));
  gauge("kiln:kv_pages_total", "KV cache pages in the pool.", static_cast<double>(m.kv_pages_total));
  double usage = m.kv_pages_total > 0 ? static_cast<double>(m.kv_pages_used) / m.kv_pages_total : 0.0;
  gauge("kiln:kv_cache_usage_ratio", "Fraction of KV cache pages in use (0..1).", usage);
  gauge("kiln:token_usage", "Fraction of KV cache token capacity in use (0..1; SGLang's name).", usage);
  gauge("kiln:state_slots_used", "Recurrent-state slots held by sequences.", m.state_slots_used);
  gauge("kiln:state_slots_total", "Recurrent-state slots.", m.state_slots_total);
  gauge("kiln:kv_pages_cached", "KV cache pages the prefix cache holds.", static_cast<double>(m.kv_pages_cached));
  gauge("kiln:state_snapshots_cached", "State slots holding prefix-cache snapshots.",
        static_cast<double>(m.state_snapshots_cached));
  counter("kiln:prefix_cache_query_tokens_total", "Prompt tokens looked up in the prefix cache.",
          static_cast<double>(m.prefix_cache_query_tokens_total));
  counter("kiln:prefix_cache_hit_tokens_total", "Prompt tokens served from the prefix cache.",
          static_cast<double>(m.prefix_cache_hit_tokens_total));
  gauge("kiln:cache_hit_rate", "Prefix cache hit tokens / query tokens so far (SGLang's name).",
        m.prefix_cache_query_tokens_total > 0
            ? static_cast<double>(m.prefix_cache_hit_tokens_total) / m.prefix_cache_query_tokens_total
            : 0.0);
  counter("kiln:prefix_cache_evicted_pages_total", "KV pages evicted from the prefix cache.",
          static_cast<double>(m.prefix_cache_evicted_pages_total));
  counter("kiln:prefix_cache_evicted_snapshots_total", "State snapshots evicted from the prefix cache.",
          static_cast<double>(m.prefix_cache_evicted_snapshots_total));
  counter("kiln:preemptions_total", "Running sequences retracted for KV pages (recomputed later).",
          static_cast<double>(m.preemptions_total));
  counter("kiln:prompt_tokens_total", "Prompt tokens prefilled.", static_cast<double>(m.prompt_tokens_total));
  counter("kiln:generation_tokens_total", "Tokens generated.", static_cast<double>(m.generation_tokens_total));
  counter("kiln:forward_steps_total", "Model forward steps run.", static_cast<double>(m.steps_total));

  header(out, "kiln:requests_finished_total", "counter", "Sequences finished, by finish reason.");
  for (auto [reason, v] : {std::pair<const char*, uint64_t>{"stop", m.finished_stop},
                           {"length", m.finished_length},
                           {"abort", m.finished_abort},
                           {"error", m.finished_error}})
    out += fmt::format("kiln:requests_finished_total{{{},finish_reason=\"{}\"}} {}\n", model, reason, v);
  header(out, "kiln:requests_rejected_total", "counter", "Requests the engine refused, by reason.");
  out += fmt::format("kiln:requests_rejected_total{{{},reason=\"queue_full\"}} {}\n", model, m.rejected_queue_full);
  out += fmt::format("kiln:requests_rejected_total{{{},reason=\"invalid\"}} {}\n", model, m.rejected_too_long);

  header(out, "kiln:http_requests_total", "counter", "HTTP requests answered, by endpoint and status.");
  for (const auto& [key, v] : http.requests)
    out += fmt::format("kiln:http_requests_total{{{},endpoint=\"{}\",status=\"{}\"}} {}\n", model,
                       escape_label(key.first), key.second, v);

  histogram(out, "kiln:time_to_first_token_seconds", "Time from submission to the first token.",
            m.time_to_first_token_s, model);
  histogram(out, "kiln:inter_token_latency_seconds", "Time between consecutive tokens of a sequence.",
            m.inter_token_latency_s, model);
  histogram(out, "kiln:e2e_request_latency_seconds", "Time from submission to the end of a sequence.",
            m.e2e_latency_s, model);
  histogram(out, "kiln:queue_time_seconds", "Time a sequence waited before admission.", m.queue_time_s, model);
  if (m.speculative_num_steps > 0) {  // speculative decoding (MTP): SGLang's accept length = accepted / verifies + 1
    counter("kiln:spec_draft_tokens_total", "Draft tokens verified (speculative decoding).",
            static_cast<double>(m.spec_draft_tokens_total));
    counter("kiln:spec_accepted_tokens_total", "Draft tokens accepted (speculative decoding).",
            static_cast<double>(m.spec_accepted_tokens_total));
    counter("kiln:spec_carried_drafts_total",
            "First drafts carried from the step before (the MTP head ran them inside that greedy step).",
            static_cast<double>(m.spec_carried_drafts_total));
    histogram(out, "kiln:spec_accept_length", "Tokens a sequence got from one verify step (accepted drafts + 1).",
              m.spec_accept_length, model);
    histogram(out, "kiln:spec_step_draft_length",
              "Draft length K chosen for each step with decoding sequences (0: a plain step; adaptive unless "
              "--speculative-fixed-steps).",
              m.spec_step_draft_length, model);
  }
  // Per GPU rank: one series per device, labelled by its CUDA ordinal and tensor-parallel rank.
  if (!devices.empty()) {
    auto per_gpu = [&](const char* name, const char* help, auto field) {
      header(out, name, "gauge", help);
      for (const model::DeviceMemory& d : devices)
        out += fmt::format("{}{{{},gpu=\"{}\",rank=\"{}\"}} {}\n", name, model, d.device, d.rank,
                           static_cast<double>(field(d)));
    };
    header(out, "kiln:gpu_info", "gauge", "The GPU of each rank (value 1; its name in the label).");
    for (const model::DeviceMemory& d : devices)
      out += fmt::format("kiln:gpu_info{{{},gpu=\"{}\",rank=\"{}\",name=\"{}\"}} 1\n", model, d.device, d.rank,
                         escape_label(d.name));
    per_gpu("kiln:gpu_weight_bytes", "Device memory held by the rank's weights.",
            [](const model::DeviceMemory& d) { return d.weight_bytes; });
    per_gpu("kiln:gpu_kv_cache_bytes", "Device memory of the rank's KV page pool.",
            [](const model::DeviceMemory& d) { return d.kv_bytes; });
    per_gpu("kiln:gpu_state_bytes", "Device memory of the rank's recurrent / conv state slots.",
            [](const model::DeviceMemory& d) { return d.state_bytes; });
    per_gpu("kiln:gpu_scratch_bytes", "Device memory of the rank's per-step scratch arena.",
            [](const model::DeviceMemory& d) { return d.scratch_bytes; });
    per_gpu("kiln:gpu_total_bytes", "The GPU's memory.", [](const model::DeviceMemory& d) { return d.total_bytes; });
  }
  return out;
}

}  // namespace kiln::server
