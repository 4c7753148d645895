// The speculative-decoding flags (cli/speculative_flags.h): SGLang's names and checks, auto on when the checkpoint
// has an MTP head, any --tp-size on one machine, --nnodes > 1 off (auto) or an error (NEXTN); the runner check after
// loading.
#include "cli/speculative_flags.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"

namespace kiln::cli {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

SpeculativeFlags parse(std::vector<std::string> args) {
  CLI::App app;
  SpeculativeFlags f;
  add_speculative_flags(app, f);
  std::reverse(args.begin(), args.end());  // CLI11 takes the vector form last-first
  app.parse(args);
  return f;
}

format::ModelConfig with_head(bool head) {
  format::ModelConfig c;
  c.mtp_num_layers = head ? 1 : 0;
  return c;
}

TEST(SpeculativeFlags, AutoFollowsTheCheckpointsHead) {
  const SpeculativeChoice on = resolve_speculative_flags(parse({}), with_head(true));
  EXPECT_EQ(on.num_steps, 3);
  EXPECT_FALSE(on.requested);
  EXPECT_THAT(on.summary, HasSubstr("NEXTN"));
  const SpeculativeChoice off = resolve_speculative_flags(parse({}), with_head(false));
  EXPECT_EQ(off.num_steps, 0);
  EXPECT_THAT(off.summary, HasSubstr("no MTP head"));
  EXPECT_EQ(resolve_speculative_flags(parse({"--speculative-algorithm", "none"}), with_head(true)).num_steps, 0);
  EXPECT_EQ(resolve_speculative_flags(parse({"--speculative-algorithm", "EAGLE", "--speculative-num-steps", "5"}),
                                      with_head(true))
                .num_steps,
            5);
}

// Adaptive by default; --speculative-fixed-steps drafts K at every step, and the startup summary says which.
TEST(SpeculativeFlags, FixedStepsTurnsTheAdaptiveChoiceOff) {
  const SpeculativeChoice adaptive = resolve_speculative_flags(parse({}), with_head(true));
  EXPECT_TRUE(adaptive.adaptive);
  EXPECT_THAT(adaptive.summary, HasSubstr("adaptive"));
  const SpeculativeChoice fixed =
      resolve_speculative_flags(parse({"--speculative-fixed-steps", "--speculative-num-steps", "4"}), with_head(true));
  EXPECT_FALSE(fixed.adaptive);
  EXPECT_EQ(fixed.num_steps, 4);
  EXPECT_THAT(fixed.summary, HasSubstr("4 draft tokens per step at every batch size"));
}

TEST(SpeculativeFlags, ErrorsNameTheFix) {
  EXPECT_THAT([] { resolve_speculative_flags(parse({"--speculative-algorithm", "NEXTN"}), with_head(false)); },
              ThrowsMessage<Error>(HasSubstr("no MTP head")));
  EXPECT_THAT([] { resolve_speculative_flags(parse({"--speculative-algorithm", "medusa"}), with_head(true)); },
              ThrowsMessage<Error>(HasSubstr("'medusa' is not supported")));
  EXPECT_THAT([] { resolve_speculative_flags(parse({"--speculative-eagle-topk", "4"}), with_head(true)); },
              ThrowsMessage<Error>(HasSubstr("draft trees are not supported")));
  EXPECT_THAT([] { resolve_speculative_flags(parse({"--speculative-num-steps", "6"}), with_head(true)); },
              ThrowsMessage<Error>(HasSubstr("outside 1-5")));
  EXPECT_THAT(
      [] {
        resolve_speculative_flags(parse({"--speculative-num-steps", "2", "--speculative-num-draft-tokens", "4"}),
                                  with_head(true));
      },
      ThrowsMessage<Error>(HasSubstr("must be --speculative-num-steps + 1 = 3")));
}

// One machine's tensor-parallel group drafts together (model::TpRunner::draft); several machines do not.
TEST(SpeculativeFlags, SeveralMachinesTurnItOff) {
  const SpeculativeChoice one = resolve_speculative_flags(parse({}), with_head(true), 1);
  EXPECT_EQ(one.num_steps, 3);
  const SpeculativeChoice two = resolve_speculative_flags(parse({}), with_head(true), 2);
  EXPECT_EQ(two.num_steps, 0);
  EXPECT_THAT(two.summary, HasSubstr("--nnodes 2"));
  EXPECT_THAT([] { resolve_speculative_flags(parse({"--speculative-algorithm", "NEXTN"}), with_head(true), 2); },
              ThrowsMessage<Error>(HasSubstr("across machines is not supported")));
}

}  // namespace
}  // namespace kiln::cli
