// The parallel flags (cli/parallel_flags.h): parsing with SGLang's names straight into backend::ParallelOptions, the
// node-0 rule of the commands other than serve, and the shard-plan check before anything loads. The sizes' own
// checks are backend::validate_parallel's (tests/unit/backend/device_test.cpp).
#include "cli/parallel_flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"

namespace kiln::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Parses argv (after the program name) into the options the way the commands do.
backend::ParallelOptions parse(std::vector<std::string> args) {
  CLI::App app;
  backend::ParallelOptions p;
  add_parallel_flags(app, p);
  std::reverse(args.begin(), args.end());  // CLI11 takes the vector form last-first
  app.parse(args);
  return p;
}

TEST(ParallelFlags, ParsesSglangNames) {
  const backend::ParallelOptions p = parse({"--tp-size", "16", "--ep", "2", "--nnodes", "2", "--node-rank", "1",
                                            "--dist-init-addr", "10.0.0.1:5000", "--base-gpu-id", "1",
                                            "--gpu-id-step", "2", "--dist-timeout", "42"});
  EXPECT_EQ(p.tp_size, 16);
  EXPECT_EQ(p.ep_size, 2);
  EXPECT_EQ(p.nnodes, 2);
  EXPECT_EQ(p.node_rank, 1);
  EXPECT_EQ(p.dist_init_addr, "10.0.0.1:5000");
  EXPECT_EQ(p.base_gpu_id, 1);
  EXPECT_EQ(p.gpu_id_step, 2);
  EXPECT_EQ(p.dist_timeout_s, 42);
  EXPECT_EQ(parse({"--tp", "4"}).tp_size, 4);
}

TEST(ParallelFlags, Defaults) {
  const backend::ParallelOptions p = parse({});
  EXPECT_EQ(p.tp_size, 1);
  EXPECT_EQ(p.ep_size, 1);
  EXPECT_EQ(p.nnodes, 1);
  EXPECT_EQ(p.node_rank, 0);
  EXPECT_EQ(p.base_gpu_id, 0);
  EXPECT_EQ(p.gpu_id_step, 1);
  EXPECT_EQ(p.dist_timeout_s, 600);
  EXPECT_EQ(p.single_rank, -1);
  EXPECT_TRUE(p.dist_init_addr.empty());
  EXPECT_FALSE(p.is_group());
  // Step 0: every rank on one GPU (correctness runs).
  EXPECT_EQ(parse({"--gpu-id-step", "0"}).gpu_id_step, 0);
}

TEST(ParallelFlags, CliRangesRejectNonsense) {
  EXPECT_THROW(parse({"--nnodes", "0"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--node-rank", "-1"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--gpu-id-step", "-1"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--base-gpu-id", "-2"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--tp-size", "0"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--dist-timeout", "0"}), CLI::ValidationError);
}

TEST(ParallelFlags, OnlyServeRunsTheOtherNodes) {
  // generate / bench-engine drive the group from node 0; the other nodes are `kiln serve` processes.
  backend::ParallelOptions p;
  p.tp_size = 4;
  p.nnodes = 2;
  p.dist_init_addr = "127.0.0.1:5000";
  EXPECT_NO_THROW(check_node_zero(p, "generate"));
  p.node_rank = 1;
  EXPECT_THAT([&] { check_node_zero(p, "generate"); },
              ThrowsMessage<Error>(HasSubstr("kiln generate --node-rank 1: only node 0 runs generate; start the other "
                                             "nodes with `kiln serve`")));
}

// Before a port opens: the sizes' own checks, then whether the model splits over them (kiln-tiny: 4 query heads).
TEST(ParallelFlags, CheckedAgainstTheModelBeforeLoading) {
  const format::ModelDir dir = format::ModelDir::open(std::string(KILN_SOURCE_DIR) + "/models/kiln-tiny");
  const format::ModelConfig config = format::load_model_config(dir);
  backend::ParallelOptions p;
  p.tp_size = 4;
  EXPECT_NO_THROW(check_parallel_flags(p, config, dir));
  p.tp_size = 3;
  EXPECT_THAT([&] { check_parallel_flags(p, config, dir); },
              ThrowsMessage<Error>(HasSubstr("4 query heads do not split over 3 ranks")));
  p.tp_size = 4;
  p.ep_size = 3;
  EXPECT_THAT([&] { check_parallel_flags(p, config, dir); },
              ThrowsMessage<Error>(HasSubstr("--ep-size 3 must divide --tp-size 4")));
}

}  // namespace
}  // namespace kiln::cli
