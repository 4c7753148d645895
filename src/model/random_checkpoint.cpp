#include "model/random_checkpoint.h"

#include <atomic>
#include <cstring>
#include <filesystem>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "format/model_config.h"
#include "format/quant_config.h"
#include "format/safetensors.h"
#include "model/dummy_weights.h"
#include "model/family.h"
#include "model/ops.h"

namespace kiln::model {

namespace fs = std::filesystem;

RandomCheckpointSummary write_random_checkpoint(const format::ModelDir& config_dir, const std::string& out_dir,
                                                const RandomCheckpointOptions& options) {
  const format::ModelConfig config = format::load_model_config(config_dir);
  const format::QuantConfig quant = format::load_quant_config(config_dir);
  const NormKind norm_kind = family_for(config.arch).norm_kind();
  const format::Checkpoint ckpt = dummy_checkpoint(config_dir, config, quant, /*vision=*/true);

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) fail("cannot create '{}': {}", out_dir, ec.message());
  for (const auto& e : fs::directory_iterator(out_dir))
    if (e.path().extension() == ".safetensors")
      fail("'{}' already holds safetensors files ({}); choose an empty folder", out_dir, e.path().filename().string());

  const uint64_t total = ckpt.total_bytes();
  auto done = std::make_shared<std::atomic<uint64_t>>(0);
  format::SafetensorsWriter writer;
  for (const auto& [name, info] : ckpt.tensors()) {
    const format::TensorInfo t = info;
    writer.add_generated(name, t.dtype, t.shape, [t, norm_kind, &ckpt, &options, done, total](std::span<uint8_t> out) {
      const int64_t numel = t.shape.numel();
      if (numel == 1 && t.shape.ndim == 0 && t.dtype == DType::F32) {
        const float v = dummy_scalar(t.name, ckpt);  // weight_scale_2, FP8 weight_scale, input_scale
        std::memcpy(out.data(), &v, sizeof v);
      } else {
        const RandomFill fill = dummy_fill(t, norm_kind);
        const size_t elem = dtype_size(t.dtype);
        ThreadPool::global().parallel_for(
            numel,
            [&](int64_t b, int64_t e) { fill_random_host_range(t.dtype, b, e - b, fill, out.data() + b * elem); },
            int64_t{1} << 20);
      }
      const uint64_t now = done->fetch_add(out.size()) + out.size();
      if (options.progress) options.progress(now, total);
    });
  }
  RandomCheckpointSummary s;
  s.tensors = writer.size();
  s.bytes = writer.total_bytes();
  s.files = writer.write_sharded(out_dir, options.max_shard_bytes);
  return s;
}

}  // namespace kiln::model
