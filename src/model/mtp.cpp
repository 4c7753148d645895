#include "model/mtp.h"

#include "core/error.h"
#include "model/blocks.h"

namespace kiln::model {

TensorView mtp_forward(Forward& f, const ModelWeights& w, const Family& family, int mtp_layer, const TensorView& ids,
                       const TensorView& hidden) {
  KILN_CHECK(w.has_mtp, "mtp_forward on a model without an MTP head");
  const int64_t T = ids.numel(), H = f.config.hidden_size;
  const NormKind kind = family.norm_kind();
  TensorView emb = f.f32(Shape{T, H});
  embed(f, w, ids, emb);
  // [norm_e(embed) | norm_h(hidden)] -> fc
  TensorView cat = f.f32(Shape{T, 2 * H});
  TensorView ne = rms_norm(f, emb, w.mtp.pre_fc_norm_embedding, kind);
  TensorView nh = rms_norm(f, hidden, w.mtp.pre_fc_norm_hidden, kind);
  f.ops.copy(ne, strided_view(cat, 0, Shape{T, H}, {2 * H, 1}));
  f.ops.copy(nh, strided_view(cat, H, Shape{T, H}, {2 * H, 1}));
  f.name("mtp_fc_in", mtp_layer, cat);
  TensorView x = f.f32(Shape{T, H});
  f.ops.linear(cat, w.mtp.fc, x);
  f.name("mtp_fc_out", mtp_layer, x);
  KILN_CHECK(!f.pending_residual.data, "mtp_forward: a block output is pending");
  family.forward_layer(f, mtp_layer, w.mtp.layer, x);
  residual_flush(f, x);
  f.name("layer_out", mtp_layer, x);
  TensorView g = rms_norm(f, x, w.mtp.norm, kind);
  f.name("mtp_norm", mtp_layer, g);
  return g;
}

}  // namespace kiln::model
