// --speculative-algorithm / --speculative-num-steps / --speculative-num-draft-tokens / --speculative-eagle-topk
// (SGLang's names), shared by serve, generate and bench-engine: speculative decoding with the checkpoint's own
// multi-token-prediction head (engine/engine.h's speculative step, engine/speculative.h's rules).
//
//   auto (default)  NEXTN when the checkpoint has an MTP head (config.json mtp_num_hidden_layers and its mtp.*
//                   tensors), off otherwise
//   NEXTN / EAGLE   on (EAGLE is accepted as an alias: the head is the MTP layer either way); an error without a head
//   none            off
// The runner loads the head only when speculation is on (backend::LoadOptions::mtp).
#pragma once
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <string>

#include "backend/backend.h"
#include "core/error.h"
#include "format/model_config.h"
#include "model/model_runner.h"

namespace kiln::cli {

struct SpeculativeFlags {
  std::string algorithm = "auto";
  int num_steps = 3;         // K, the most draft tokens per verify
  int num_draft_tokens = 0;  // 0: num_steps + 1 (the verified tokens per sequence: K drafts + the pending one)
  int eagle_topk = 1;        // 1: a chain (trees are not supported)
  bool fixed_steps = false;  // every decode step drafts num_steps (default: adaptive, from measured step costs)
  bool no_carry = false;     // greedy steps do not carry the next step's first draft (A/B runs)
  bool no_defer = false;     // the draft chain's ids come back to the host before the verify (A/B runs)
};

// What the flags resolve to for one model: the most draft steps (0: off) and a line for the startup summary.
struct SpeculativeChoice {
  int num_steps = 0;
  bool requested = false;  // NEXTN / EAGLE named explicitly (no head is then an error, not "off")
  std::string summary;
  bool adaptive = true;  // false: every decode step drafts num_steps (--speculative-fixed-steps)
  bool carry = true;     // greedy steps carry the next step's first draft (EngineOptions::speculative_carry)
  bool defer = true;     // EngineOptions::speculative_defer_chain
};

inline void add_speculative_flags(CLI::App& app, SpeculativeFlags& f) {
  app.add_option("--speculative-algorithm", f.algorithm,
                 "Speculative decoding with the checkpoint's MTP head: auto (on when the checkpoint has one), NEXTN "
                 "(EAGLE: the same), none")
      ->capture_default_str();
  app.add_option("--speculative-num-steps", f.num_steps,
                 "Most draft tokens per sequence per step, 1-5 (each step drafts 0 .. this many, chosen from the "
                 "measured step costs)")
      ->capture_default_str();
  app.add_option("--speculative-num-draft-tokens", f.num_draft_tokens,
                 "Tokens verified per sequence per step; must be --speculative-num-steps + 1 (the default)");
  app.add_option("--speculative-eagle-topk", f.eagle_topk, "Draft tree width; only 1 (a chain) is supported")
      ->capture_default_str();
  app.add_flag("--speculative-fixed-steps", f.fixed_steps,
               "Every decode step drafts --speculative-num-steps tokens per sequence, at any batch size (SGLang's "
               "behaviour; default: 0 .. that many, chosen from the measured step costs)");
  app.add_flag("--disable-draft-carry", f.no_carry,
               "Greedy steps do not run the MTP head's first draft of the next step (each step's draft chain then "
               "runs all its steps; for A/B runs)");
  app.add_flag("--disable-draft-defer", f.no_defer,
               "With carried first drafts, bring the draft chain's ids back to the host before the verify pass "
               "instead of leaving them on the device for it (for A/B runs)");
}

// Checks the flags and resolves them against the model's config (before loading): kiln::Error naming the fix.
// nnodes: machines the tensor-parallel group spans (speculation runs on one machine's group, any --tp-size).
inline SpeculativeChoice resolve_speculative_flags(const SpeculativeFlags& f, const format::ModelConfig& config,
                                                   int nnodes = 1) {
  std::string alg = f.algorithm;
  std::transform(alg.begin(), alg.end(), alg.begin(), [](unsigned char c) { return std::tolower(c); });
  if (alg != "auto" && alg != "nextn" && alg != "eagle" && alg != "none")
    fail("--speculative-algorithm '{}' is not supported: NEXTN (or its alias EAGLE), none, or auto", f.algorithm);
  if (f.eagle_topk != 1)
    fail("--speculative-eagle-topk {}: kiln drafts one chain per sequence (top-k 1); draft trees are not supported",
         f.eagle_topk);
  if (f.num_steps < 1 || f.num_steps > 5) fail("--speculative-num-steps {} is outside 1-5", f.num_steps);
  if (f.num_draft_tokens != 0 && f.num_draft_tokens != f.num_steps + 1)
    fail("--speculative-num-draft-tokens {} must be --speculative-num-steps + 1 = {} (a chain verifies its K drafts "
         "and the pending token)", f.num_draft_tokens, f.num_steps + 1);
  SpeculativeChoice c;
  c.requested = alg == "nextn" || alg == "eagle";
  if (alg == "none") {
    c.summary = "off (--speculative-algorithm none)";
    return c;
  }
  if (!config.has_mtp()) {
    if (c.requested)
      fail("--speculative-algorithm {}: the checkpoint has no MTP head (config.json mtp_num_hidden_layers and mtp.* "
           "tensors); drop the flag or pass --speculative-algorithm none", f.algorithm);
    c.summary = "off (the checkpoint has no MTP head)";
    return c;
  }
  if (nnodes > 1) {
    if (c.requested)
      fail("--speculative-algorithm {} with --nnodes {}: speculative decoding across machines is not supported; run "
           "with --speculative-algorithm none", f.algorithm, nnodes);
    c.summary = fmt::format("off (--nnodes {}: speculative decoding runs on one machine's group only)", nnodes);
    return c;
  }
  c.num_steps = f.num_steps;
  c.adaptive = !f.fixed_steps;
  c.carry = !f.no_carry;
  c.defer = !f.no_defer;
  c.summary = c.adaptive ? fmt::format("NEXTN with the checkpoint's MTP head, up to {} draft tokens per step (adaptive: "
                                       "fewer or none where verifying costs more than it returns; "
                                       "--speculative-algorithm none turns it off)", f.num_steps)
                         : fmt::format("NEXTN with the checkpoint's MTP head, {} draft tokens per step at every batch "
                                       "size (--speculative-fixed-steps; --speculative-algorithm none turns it off)",
                                       f.num_steps);
  return c;
}

inline void apply_speculative_choice(const SpeculativeChoice& c, backend::LoadOptions& lo) { lo.mtp = c.num_steps > 0; }

// After loading: a head the loader left off (config.json names it, the tensors do not match) turns auto off.
inline void check_speculative_runner(SpeculativeChoice& c, const model::ModelRunner& runner) {
  if (c.num_steps == 0 || runner.mtp_layers() > 0) return;
  if (c.requested)
    fail("speculative decoding: the model loaded without its MTP head (see the log above); pass "
         "--speculative-algorithm none");
  c.num_steps = 0;
  c.summary = "off (the MTP head did not load; see the log above)";
}

}  // namespace kiln::cli
