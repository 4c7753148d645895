#include "model/model.h"

#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"
#include "model/dummy_weights.h"

namespace kiln::model {

LoadFormat parse_load_format(const std::string& name) {
  if (name == "auto" || name == "safetensors") return LoadFormat::safetensors;
  if (name == "dummy") return LoadFormat::dummy;
  fail("unknown --load-format '{}' (use auto, safetensors or dummy)", name);
}

std::unique_ptr<LoadedModel> load_model(const format::ModelDir& dir, Ops& ops, LoadFormat load_format,
                                        const format::RankShard* shard, bool with_mtp, bool with_vision) {
  auto m = std::make_unique<LoadedModel>();
  m->dir = dir;
  m->config = format::load_model_config(dir);
  if (!with_mtp) m->config.mtp_num_layers = 0;
  if (m->config.mtp_num_layers > 1) {
    KILN_LOG_WARN("{}: {} MTP layers; kiln drafts with the first only", dir.display_path(), m->config.mtp_num_layers);
    m->config.mtp_num_layers = 1;
  }
  m->quant = format::load_quant_config(dir);
  m->family = &family_for(m->config.arch);
  const auto& c = m->config;
  if (c.rope_type != "default")
    fail("{}: rope type '{}' is not supported (only 'default', with partial_rotary_factor / text M-RoPE)",
         dir.display_path(), c.rope_type);
  if (c.head_dim <= 0 || c.rotary_dim() % 2 || c.rotary_dim() > c.head_dim)
    fail("{}: bad rotary setup: head_dim {}, rotary dim {}", dir.display_path(), c.head_dim, c.rotary_dim());
  if (load_format == LoadFormat::dummy) {
    m->checkpoint = std::make_unique<format::Checkpoint>(model::dummy_checkpoint(dir, m->config, m->quant));
    if (!shard || shard->rank == 0)
      KILN_LOG_WARN("--load-format dummy: {} random weights from config.json alone (output is meaningless; for "
                    "benchmarks)", m->checkpoint->size());
  } else {
    m->checkpoint = std::make_unique<format::Checkpoint>(format::Checkpoint::open(dir));
  }
  // Lists every missing / mis-typed / mis-shaped tensor in one kiln::Error.
  m->report = format::verify_checkpoint(*m->checkpoint, m->config, m->quant);

  m->full_config = m->config;
  std::vector<format::ExpectedTensor> expected = format::expected_tensors(m->config, m->quant);
  std::unique_ptr<RankSlicing> slicing;
  if (shard && shard->tp > 1) {
    // A tensor-parallel rank: the binder cuts each tensor to the rank's slice; the runner sizes its KV cache and
    // state from the rank's config.
    m->shard = *shard;
    slicing = std::make_unique<RankSlicing>();
    slicing->full = m->config;
    slicing->rank = *shard;
    for (const auto& t : expected) slicing->tensors.emplace(t.name, t);
    m->config = format::rank_config(m->full_config, *shard);
    m->weights.vocab_parallel = true;
    m->weights.vocab_begin = shard->vocab.begin;
  }
  WeightBinder b(*m->checkpoint, m->config, m->quant, ops, m->weights, slicing.get());
  b.set_dummy_norm_kind(m->family->norm_kind());
  // The process's progress line (one for all ranks loading at once; silent when nothing is copied, as on the CPU).
  // Until `loaded`, an error must wait for the backend's copies before their host bytes go (reverse order below).
  struct LoadGuard {
    WeightBinder& b;
    bool loaded = false;
    ~LoadGuard() {
      if (loaded) return;
      try {
        b.finish();
      } catch (...) {  // the first error is the one being reported
      }
      weight_progress().end(false);
    }
  };
  weight_progress().begin(b.bytes_to_place(expected),
                          load_format == LoadFormat::dummy ? "loading random weights" : "loading weights");
  LoadGuard guard{b};
  const int64_t H = c.hidden_size, V = m->shard ? m->shard->vocab.count : c.vocab_size;
  const std::string& P = c.tensor_prefix;
  m->weights.embed_tokens = b.tensor(P + "embed_tokens.weight", Shape{V, H});
  m->weights.final_norm = b.tensor(P + "norm.weight", Shape{H});
  if (b.has("lm_head.weight")) {
    m->weights.lm_head = b.linear("lm_head", V, H);
  } else if (c.tie_word_embeddings) {
    m->weights.lm_head.out_features = V;
    m->weights.lm_head.in_features = H;
    m->weights.lm_head.weight = m->weights.embed_tokens;
  } else {
    fail("{}: lm_head.weight is missing and tie_word_embeddings is false", dir.display_path());
  }
  m->weights.layers.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    m->weights.layers[l].type = c.layer_types[l];
    m->family->bind_layer(b, l, m->weights.layers[l]);
  }
  if (c.mtp_num_layers > 0) {
    // The MTP head: its decoder layer is bound by the family as layer num_layers (format::layer_prefix names it
    // "mtp.layers.0."), a full-attention layer with the main layers' FFN.
    MtpWeights& mtp = m->weights.mtp;
    mtp.fc = b.linear("mtp.fc", H, 2 * H);
    mtp.pre_fc_norm_embedding = b.tensor("mtp.pre_fc_norm_embedding.weight", Shape{H});
    mtp.pre_fc_norm_hidden = b.tensor("mtp.pre_fc_norm_hidden.weight", Shape{H});
    mtp.norm = b.tensor("mtp.norm.weight", Shape{H});
    mtp.layer.type = format::LayerType::full_attention;
    m->family->bind_layer(b, c.num_layers, mtp.layer);
    m->weights.has_mtp = true;
  }
  try {
    b.finish();  // every placed weight holds its bytes before anything runs
  } catch (const Error& e) {
    fail("{}: loading the weights failed: {}", dir.display_path(), e.what());
  }
  if (with_vision && c.has_vision && (!m->shard || m->shard->rank == 0)) {
    if (load_format == LoadFormat::dummy) {
      KILN_LOG_INFO("{}: the vision tower is not loaded with --load-format dummy (image inputs off)", dir.display_path());
    } else if (format::detect_vision_prefix(*m->checkpoint).empty()) {
      KILN_LOG_INFO("{}: config.json describes a vision tower but the checkpoint has none: image inputs off",
                    dir.display_path());
    } else {
      try {
        m->vision = load_vision_weights(*m->checkpoint, m->full_config, ops);
      } catch (const Error& e) {
        fail("{}: loading the vision tower failed: {}", dir.display_path(), e.what());
      }
    }
  }
  guard.loaded = true;
  weight_progress().end(true);
  if (m->shard)
    KILN_LOG_DEBUG("rank {} of {}: loaded its slices ({:.1f} MB of linear weights)", m->shard->rank, m->shard->tp,
                   (m->weights.bytes_by_format[0] + m->weights.bytes_by_format[1] + m->weights.bytes_by_format[2]) / 1e6);
  if (!m->shard || m->shard->rank == 0)
    KILN_LOG_INFO("loaded {} ({}, {} layers: {}{}), {} tensors matched{}", dir.display_path(),
                  format::arch_name(c.arch), c.num_layers, c.layer_pattern(),
                  std::string(c.mtp_num_layers ? " + MTP head" : "") + (m->vision ? " + vision tower" : ""),
                  m->report.matched,
                  m->quant.is_quantized() ? ", quantisation " + m->quant.quant_algo : std::string());
  return m;
}

}  // namespace kiln::model
