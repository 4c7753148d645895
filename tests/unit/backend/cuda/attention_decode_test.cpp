// The split-over-keys attention kernel (attention_decode.cu) and the KV store through CudaOps against the CPU backend:
// with the default choice (prefill-shaped steps go to attention_prefill.cu) and with --attention-backend
// kiln-paged-fp32, where this kernel serves every step, prefills of up to 150 tokens included. Skipped without a
// usable GPU.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "backend/cpu/cpu_backend.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/op_check.h"
#include "test_util.h"

namespace kiln::backend::cuda {
namespace {

using test::checks_of;
using test::expect_all_pass;

struct AttentionChoice {
  const char* name;
  bool prefill_tensor_cores;
};
// gtest prints the parameter by its name (not as bytes).
void PrintTo(const AttentionChoice& p, std::ostream* os) { *os << p.name; }

class PagedAttention : public ::testing::TestWithParam<AttentionChoice> {};

TEST_P(PagedAttention, MatchesCpu) {
  KILN_REQUIRE_CUDA_DEVICE();
  auto cpu = make_cpu_backend();
  CudaOptions o;
  o.prefill_attention_tensor_cores = GetParam().prefill_tensor_cores;
  CudaOps gpu(o);
  for (int64_t head_dim : {64, 128, 256}) {
    OpCheckConfig c;
    c.seed = 12;
    c.q_heads = 8;
    c.kv_heads = 2;
    c.head_dim = head_dim;
    c.rotary_dim = 32;
    c.prefill_lens = {1, 40, 150};
    c.page_size = 16;
    const std::vector<OpCheck> all = compare_ops(gpu, *cpu, c);
    std::vector<OpCheck> att = checks_of(all, "attention");
    for (const OpCheck& r : checks_of(all, "kv_store")) att.push_back(r);
    EXPECT_GE(att.size(), 4u);
    expect_all_pass(att, std::string(GetParam().name) + " head_dim " + std::to_string(head_dim));
  }
}

INSTANTIATE_TEST_SUITE_P(Choices, PagedAttention,
                         ::testing::Values(AttentionChoice{"KilnPaged", true}, AttentionChoice{"KilnPagedFp32", false}),
                         [](const ::testing::TestParamInfo<AttentionChoice>& info) {
                           return std::string(info.param.name);
                         });

}  // namespace
}  // namespace kiln::backend::cuda
