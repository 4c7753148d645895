// Loading a model on the CPU backend (the load options themselves are in backend/backend.h).
#pragma once
#include <string>
#include <memory>

#include "backend/backend.h"
#include "backend/rendezvous.h"
#include "format/model_dir.h"
#include "model/model.h"
#include "model/model_runner.h"
#include "model/runner.h"

namespace kiln::backend {

// The runner options these load options ask for (every backend's runner starts from them).
model::RunnerOptions runner_options(const LoadOptions& options);

// Several machines: meets the other nodes of this launch at options.dist_init_addr (backend/rendezvous.h) and keeps
// the connections as the group's link. Every node must agree on the model, --tp-size, --ep-size, the device and the
// dtypes (the fingerprint). Node 0 decides the runner's sizes: its KV pages, state slots, context, page size and
// pass size (ro) reach every node and replace theirs there (so `kiln generate` on node 0 sizes the group as well as
// `kiln serve`); node 0's payload (the NCCL id) reaches every node. `device`: "cpu" or "cuda".
struct NodeJoin {
  std::shared_ptr<model::NodeLink> link;
  std::vector<uint8_t> payload;
};
NodeJoin join_nodes(const format::ModelDir& dir, const LoadOptions& options, const std::string& device,
                    model::RunnerOptions& ro, const std::vector<uint8_t>& payload);

// The CPU backend's Ops (for tests and tools that drive ops directly).
std::unique_ptr<Backend> make_cpu_backend();

// Loads `dir` (config, quantisation config, checkpoint verified against the config: a mismatch is a kiln::Error
// listing every problem) and returns a ready runner (a model::Runner).
std::unique_ptr<model::ModelRunner> load_cpu_model(const format::ModelDir& dir, const LoadOptions& options);

}  // namespace kiln::backend
