#include "model/weights.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "format/weight_map.h"
#include "model/dummy_weights.h"

namespace kiln::model {

const char* weight_format_name(WeightFormat f) {
  switch (f) {
    case WeightFormat::dense: return "dense";
    case WeightFormat::fp8_tensor: return "fp8";
    case WeightFormat::nvfp4: return "nvfp4";
  }
  return "?";
}

int64_t LinearWeight::weight_bytes() const {
  int64_t n = weight.data ? static_cast<int64_t>(weight.nbytes()) : 0;
  if (block_scale.data) n += static_cast<int64_t>(block_scale.nbytes());
  if (bias.data) n += static_cast<int64_t>(bias.nbytes());
  return n;
}

format::TensorSlice WeightBinder::slice_of(const format::TensorInfo& t) const {
  if (!slicing_ || slicing_->rank.tp == 1) {
    format::TensorSlice s;
    s.shape = t.shape;
    return s;
  }
  auto it = slicing_->tensors.find(t.name);
  if (it == slicing_->tensors.end()) fail("{}: not a tensor of this model's layout: cannot split it over ranks", t.name);
  return format::slice_tensor(slicing_->full, slicing_->rank, it->second, t.shape);
}

TensorView WeightBinder::place(const format::TensorInfo& t) const {
  auto it = placed_.find(t.name);
  if (it != placed_.end()) return it->second;
  const format::TensorSlice s = slice_of(t);
  TensorView v;
  if (!s.held) {
    v = TensorView();  // another rank's
  } else if (s.whole()) {
    v = t.data ? ops_.place_weight(t.view()) : ops_.place_random(t.dtype, t.shape, dummy_fill(t, dummy_norm_kind_));
  } else {
    const size_t elem = dtype_size(t.dtype);
    const int64_t row_elems = t.shape.ndim > 0 ? t.shape.numel() / t.shape[0] : 1;
    if (t.data && s.split_dim == 0 && s.rows.size() == 1 && s.col_parts == 1) {
      // One range of whole rows: the checkpoint's bytes in place.
      v = ops_.place_weight(TensorView(static_cast<char*>(const_cast<void*>(static_cast<const void*>(t.data))) +
                                           static_cast<size_t>(s.rows[0].begin * row_elems) * elem,
                                       t.dtype, s.shape));
    } else if (!t.data) {  // dummy: the slice of the same full random tensor, filled by the backend
      v = ops_.place_random_slice(t.dtype, t.shape, s, dummy_fill(t, dummy_norm_kind_));
    } else {
      auto buf = std::make_unique<uint8_t[]>(std::max<size_t>(static_cast<size_t>(s.shape.numel()) * elem, 16));
      format::copy_slice(s, t.shape, elem, t.data, buf.get());
      v = ops_.place_weight(TensorView(buf.get(), t.dtype, s.shape));
      // Alive as long as the model when viewed in place, else until the copy is done (finish()).
      (v.data == buf.get() ? model_.slice_storage : copying_from_).push_back(std::move(buf));
    }
  }
  placed_.emplace(t.name, v);
  return v;
}

uint64_t WeightBinder::bytes_to_place(const std::vector<format::ExpectedTensor>& expected) const {
  uint64_t total = 0;
  for (const format::ExpectedTensor& e : expected) {
    const format::TensorInfo* t = ckpt_.find(e.name);
    if (!t || t->shape.numel() <= 1) continue;
    const format::TensorSlice s = slice_of(*t);
    if (s.held) total += static_cast<uint64_t>(s.shape.numel()) * dtype_size(t->dtype);
  }
  return total;
}

void WeightBinder::finish() {
  ops_.finish_weights();
  copying_from_.clear();
}

std::string WeightBinder::layer_prefix(int layer) const { return format::layer_prefix(config_, layer); }

TensorView WeightBinder::tensor(const std::string& name, Shape shape) const {
  const format::TensorInfo& t = ckpt_.get(name);
  const format::TensorSlice s = slice_of(t);
  if (!s.held) return TensorView();
  if (s.shape.numel() != shape.numel())
    fail("{}: shape {} does not match the config (expected {} elements as {}){}", name, s.shape.str(),
         shape.numel(), shape.str(), s.whole() ? "" : " (this rank's slice)");
  TensorView v = place(t);
  v.shape = shape;
  v.set_contiguous_strides();
  return v;
}

float WeightBinder::scalar(const std::string& name) const {
  const format::TensorInfo& t = ckpt_.get(name);
  if (t.shape.numel() != 1 || !dtype_is_float(t.dtype))
    fail("{}: expected a float scalar, found {} {}", name, dtype_name(t.dtype), t.shape.str());
  if (!t.data) return dummy_scalar(name, ckpt_);
  return load_as_f32(t.dtype, t.data);
}

LinearWeight WeightBinder::linear(const std::string& module, int64_t out_features, int64_t in_features) const {
  LinearWeight w;
  w.out_features = out_features;
  w.in_features = in_features;
  const format::TensorInfo& t = ckpt_.get(module + ".weight");
  const format::QuantScheme scheme = format::effective_scheme(config_, quant_, module);
  if (!slice_of(t).held) return w;  // another expert-parallel rank's expert
  auto expect = [&](const format::TensorInfo& ti, DType dtype, Shape shape) {
    const format::TensorSlice s = slice_of(ti);
    if (ti.dtype != dtype || !(s.shape == shape))
      fail("{}: {} {} in the checkpoint{}, expected {} {} ({} storage)", ti.name, dtype_name(ti.dtype), s.shape.str(),
           s.whole() ? "" : " (this rank's slice)", dtype_name(dtype), shape.str(), format::quant_scheme_name(scheme));
  };
  switch (scheme) {
    case format::QuantScheme::none:
      if (t.dtype != DType::BF16 && t.dtype != DType::F16 && t.dtype != DType::F32)
        fail("{}: dtype {}, expected BF16, F16 or F32 (not quantised according to the quantisation config)", t.name,
             dtype_name(t.dtype));
      expect(t, t.dtype, Shape{out_features, in_features});
      w.format = WeightFormat::dense;
      w.weight = place(t);
      break;
    case format::QuantScheme::nvfp4: {
      if (in_features % 16) fail("{}: {} inputs is not a multiple of 16: cannot be NVFP4", module, in_features);
      expect(t, DType::U8, Shape{out_features, in_features / 2});
      const format::TensorInfo& s = ckpt_.get(module + ".weight_scale");
      expect(s, DType::F8_E4M3, Shape{out_features, in_features / 16});
      w.format = WeightFormat::nvfp4;
      w.weight = place(t);
      w.block_scale = place(s);
      w.scale = scalar(module + ".weight_scale_2");
      break;
    }
    case format::QuantScheme::fp8:
      expect(t, DType::F8_E4M3, Shape{out_features, in_features});
      w.format = WeightFormat::fp8_tensor;
      w.weight = place(t);
      w.scale = scalar(module + ".weight_scale");
      break;
  }
  if (ckpt_.has(module + ".bias")) w.bias = tensor(module + ".bias", Shape{out_features});
  model_.bytes_by_format[static_cast<int>(w.format)] += w.weight_bytes();
  return w;
}

LinearWeight WeightBinder::dense_slice(const std::string& name, int64_t expert, int64_t row_begin,
                                       int64_t rows) const {
  const format::TensorInfo& t = ckpt_.get(name);
  // A tensor-parallel rank holds experts [outer.begin, outer.end()) of it, each cut to its intermediate slice.
  const format::TensorSlice s = slice_of(t);
  const Shape& shape = s.shape;
  const int64_t local = expert - s.outer.begin;
  LinearWeight w;
  w.format = WeightFormat::dense;
  w.out_features = rows;
  if (s.outer.count && (local < 0 || local >= s.outer.count)) {  // another expert-parallel rank's expert
    w.in_features = shape.ndim == 3 ? shape[2] : 0;
    return w;
  }
  if (shape.ndim != 3 || local >= shape[0] || row_begin + rows > shape[1])
    fail("{}: shape {}{} cannot hold expert {} rows [{}, {})", name, shape.str(), s.whole() ? "" : " (this rank's slice)",
         expert, row_begin, row_begin + rows);
  if (t.dtype != DType::BF16 && t.dtype != DType::F16 && t.dtype != DType::F32)
    fail("{}: dtype {}, expected BF16, F16 or F32", name, dtype_name(t.dtype));
  // Placed once as a whole tensor (a GPU backend copies it once), then sliced.
  TensorView whole = place(t);
  const int64_t k = shape[2];
  w.in_features = k;
  w.weight = TensorView(static_cast<char*>(whole.data) + ((local * shape[1] + row_begin) * k) * dtype_size(t.dtype),
                        t.dtype, Shape{rows, k});
  model_.bytes_by_format[0] += static_cast<int64_t>(w.weight.nbytes());
  return w;
}

}  // namespace kiln::model
