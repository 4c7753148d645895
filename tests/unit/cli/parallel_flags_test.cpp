// The parallel flags (cli/parallel_flags.h): parsing with SGLang's names, validation before anything loads, and
// the load options they set.
#include "cli/parallel_flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"

namespace kiln::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Parses argv (after the program name) into flags the way the commands do.
ParallelFlags parse(std::vector<std::string> args) {
  CLI::App app;
  ParallelFlags f;
  add_parallel_flags(app, f);
  std::reverse(args.begin(), args.end());  // CLI11 takes the vector form last-first
  app.parse(args);
  return f;
}

TEST(ParallelFlags, ParsesSglangNamesIntoLoadOptions) {
  const ParallelFlags f = parse({"--tp-size", "16", "--ep", "2", "--nnodes", "2", "--node-rank", "1",
                                 "--dist-init-addr", "10.0.0.1:5000", "--base-gpu-id", "1", "--gpu-id-step", "2"});
  backend::LoadOptions lo;
  apply_parallel_flags(f, lo, "cuda");
  EXPECT_EQ(lo.tp_size, 16);
  EXPECT_EQ(lo.ep_size, 2);
  EXPECT_EQ(lo.nnodes, 2);
  EXPECT_EQ(lo.node_rank, 1);
  EXPECT_EQ(lo.dist_init_addr, "10.0.0.1:5000");
  EXPECT_EQ(lo.base_gpu_id, 1);
  EXPECT_EQ(lo.gpu_id_step, 2);
}

TEST(ParallelFlags, Defaults) {
  const ParallelFlags f = parse({});
  backend::LoadOptions lo;
  apply_parallel_flags(f, lo, "cpu");
  EXPECT_EQ(lo.tp_size, 1);
  EXPECT_EQ(lo.nnodes, 1);
  EXPECT_EQ(lo.node_rank, 0);
  EXPECT_EQ(lo.base_gpu_id, 0);
  EXPECT_EQ(lo.gpu_id_step, 1);
  EXPECT_TRUE(lo.dist_init_addr.empty());
  // Step 0: every rank on one GPU (correctness runs).
  EXPECT_EQ(parse({"--gpu-id-step", "0"}).gpu_id_step, 0);
}

TEST(ParallelFlags, CliRangesRejectNonsense) {
  EXPECT_THROW(parse({"--nnodes", "0"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--node-rank", "-1"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--gpu-id-step", "-1"}), CLI::ValidationError);
  EXPECT_THROW(parse({"--base-gpu-id", "-2"}), CLI::ValidationError);
}

void expect_invalid(const ParallelFlags& f, const std::string& message) {
  EXPECT_THAT([&] { validate_parallel_flags(f); }, ThrowsMessage<Error>(HasSubstr(message)));
}

TEST(ParallelFlags, Validation) {
  ParallelFlags f;
  f.nnodes = 0;
  expect_invalid(f, "--nnodes must be at least 1, got 0");

  f = {};
  f.tp_size = 8;
  f.nnodes = 2;
  f.node_rank = 2;
  f.dist_init_addr = "10.0.0.1:5000";
  expect_invalid(f, "--node-rank 2 is outside 0..1 (--nnodes 2)");

  f.node_rank = 1;
  f.tp_size = 6;
  f.nnodes = 4;
  expect_invalid(f, "--tp-size 6 does not divide over --nnodes 4");

  f = {};
  f.tp_size = 4;
  f.nnodes = 2;
  expect_invalid(f, "--nnodes 2 needs --dist-init-addr host:port");

  f.dist_init_addr = "10.0.0.1";
  expect_invalid(f, "--dist-init-addr '10.0.0.1': no port");
  f.dist_init_addr = "10.0.0.1:99999";
  expect_invalid(f, "port 99999 is outside 1..65535");

  f.dist_init_addr = "node0:5000";
  EXPECT_NO_THROW(validate_parallel_flags(f));

  f = {};
  f.tp_size = 4;
  f.ep_size = 3;
  expect_invalid(f, "--ep-size 3 must divide --tp-size 4");
}

TEST(ParallelFlags, OnlyServeRunsTheOtherNodes) {
  // generate / bench-engine drive the group from node 0; the other nodes are `kiln serve` processes.
  ParallelFlags f;
  f.tp_size = 4;
  f.nnodes = 2;
  f.dist_init_addr = "127.0.0.1:5000";
  EXPECT_NO_THROW(check_node_zero(f, "generate"));
  f.node_rank = 1;
  EXPECT_THAT([&] { check_node_zero(f, "generate"); },
              ThrowsMessage<Error>(HasSubstr("kiln generate --node-rank 1: only node 0 runs generate; start the other "
                                             "nodes with `kiln serve`")));
  // The CPU backend spans machines too (its ranks meet over TCP): the flags pass through to the load options.
  backend::LoadOptions lo;
  f.dist_timeout_s = 42;
  apply_parallel_flags(f, lo, "cpu");
  EXPECT_EQ(lo.nnodes, 2);
  EXPECT_EQ(lo.node_rank, 1);
  EXPECT_EQ(lo.dist_timeout_s, 42);
  EXPECT_EQ(parse({"--dist-timeout", "7"}).dist_timeout_s, 7);
  EXPECT_THROW(parse({"--dist-timeout", "0"}), CLI::ValidationError);
}

}  // namespace
}  // namespace kiln::cli
