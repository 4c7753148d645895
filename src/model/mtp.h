// The multi-token-prediction (MTP) head of Qwen3.5 / Qwen3-Next, over the shared blocks and any backend's Ops.
//
// One MTP "entry" pairs a token with the hidden state of the position before it: entry j = (t[j+1], h[j]), where
// h[j] is the target model's hidden state at position j after the final norm (what lm_head reads; vLLM and SGLang
// hand the drafter exactly that: their models return the normed state, see tools/reference/make_fixtures.py).
// The entry runs at position j through the MTP decoder layer, whose KV cache lives in the same pages as the main
// full-attention layers' (slot j of the sequence's page table), and gives logits for t[j+2]:
//   x = fc([pre_fc_norm_embedding(embed(t[j+1])) | pre_fc_norm_hidden(h[j])])   (embedding first)
//   g = norm(layer(x));  logits = lm_head(g)
// A draft chain feeds g (the normed output) back as the next entry's hidden state with the drafted token.
#pragma once
#include "model/family.h"
#include "model/forward.h"
#include "model/weights.h"

namespace kiln::model {

// g [T, H] for T entries: ids I32 [T] (t[j+1]), hidden [T, H] (h[j]); f.step lays the entries out (positions j),
// f.kv_index[mtp_layer] is the MTP layer's KV cache; mtp_layer = config.num_layers.
TensorView mtp_forward(Forward& f, const ModelWeights& w, const Family& family, int mtp_layer, const TensorView& ids,
                       const TensorView& hidden);

}  // namespace kiln::model
