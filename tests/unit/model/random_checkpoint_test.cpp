// kiln dummy-checkpoint's weights: the written folder holds exactly the values of `--load-format dummy`
// (each tensor against a single-threaded fill of the whole tensor; scalars against dummy_scalar), and a
// model loaded from it gives the same logits as the dummy load of its config.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "core/error.h"
#include "format/model_config.h"
#include "format/model_dir.h"
#include "format/quant_config.h"
#include "format/safetensors.h"
#include "model/dummy_weights.h"
#include "model/family.h"
#include "model/random_checkpoint.h"
#include "model/runner.h"

namespace kiln::model {
namespace {

namespace fs = std::filesystem;
const std::string kTiny = std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny";

struct TempDir {
  fs::path path;
  TempDir() : path(fs::temp_directory_path() / ("kiln_random_ckpt_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// A folder with the config of kiln-tiny and the random weights (small shards: the sharded layout is tested too).
void write_tiny(const fs::path& out) {
  fs::create_directories(out);
  for (const char* f : {"config.json", "hf_quant_config.json", "generation_config.json", "tokenizer.json",
                        "tokenizer_config.json", "chat_template.jinja"})
    fs::copy_file(fs::path(kTiny) / f, out / f);
  RandomCheckpointOptions o;
  o.max_shard_bytes = 4 << 20;
  uint64_t last = 0, total = 0;
  o.progress = [&](uint64_t done, uint64_t t) {
    EXPECT_GE(done, last);
    last = done;
    total = t;
  };
  const RandomCheckpointSummary s = write_random_checkpoint(format::ModelDir::open(kTiny), out.string(), o);
  EXPECT_GT(s.files.size(), 2u);  // several shards + the index
  EXPECT_EQ(last, total);
  EXPECT_EQ(total, s.bytes);
}

TEST(RandomCheckpoint, HoldsTheDummyWeightsValues) {
  TempDir tmp;
  write_tiny(tmp.path);
  const format::ModelDir dir = format::ModelDir::open(kTiny);
  const format::ModelConfig config = format::load_model_config(dir);
  const format::QuantConfig quant = format::load_quant_config(dir);
  const format::Checkpoint dummy = dummy_checkpoint(dir, config, quant);
  const format::Checkpoint written = format::Checkpoint::open(format::ModelDir::open(tmp.path.string()));
  ASSERT_EQ(written.size(), dummy.size());
  const NormKind norm = family_for(config.arch).norm_kind();
  for (const auto& [name, t] : dummy.tensors()) {
    const format::TensorInfo& w = written.get(name);
    ASSERT_EQ(w.dtype, t.dtype) << name;
    ASSERT_EQ(w.shape.str(), t.shape.str()) << name;
    std::vector<uint8_t> expect(w.nbytes);
    if (t.shape.ndim == 0) {
      const float v = dummy_scalar(name, dummy);
      std::memcpy(expect.data(), &v, sizeof v);
    } else {
      fill_random_host(t.dtype, t.shape.numel(), dummy_fill(t, norm), expect.data());
    }
    ASSERT_EQ(std::memcmp(expect.data(), w.data, expect.size()), 0) << name;
  }
}

TEST(RandomCheckpoint, LoadsToTheSameLogitsAsTheDummyLoad) {
  TempDir tmp;
  write_tiny(tmp.path);
  auto logits_of = [](const std::string& path, LoadFormat lf) {
    RunnerOptions ro;
    ro.load_format = lf;
    ro.state_slots = 1;
    ro.max_context = 64;
    Runner r(backend::make_cpu_backend(), format::ModelDir::open(path), ro);
    std::vector<int32_t> pages(r.capacity().kv_pages);
    for (size_t p = 0; p < pages.size(); ++p) pages[p] = static_cast<int32_t>(p);
    const std::vector<int32_t> prompt = {1, 50, 300, 7, 1999, 42};
    SeqChunk ch;
    ch.state_slot = 0;
    ch.tokens = prompt;
    ch.page_table = pages;
    std::vector<float> logits(r.vocab_size());
    r.forward({&ch, 1}, logits);
    return logits;
  };
  const std::vector<float> from_disk = logits_of(tmp.path.string(), LoadFormat::safetensors);
  const std::vector<float> dummy = logits_of(kTiny, LoadFormat::dummy);
  EXPECT_EQ(from_disk, dummy);
}

TEST(RandomCheckpoint, RefusesAFolderWithWeights) {
  TempDir tmp;
  write_tiny(tmp.path);
  EXPECT_THROW(write_random_checkpoint(format::ModelDir::open(kTiny), tmp.path.string(), {}), Error);
}

}  // namespace
}  // namespace kiln::model
