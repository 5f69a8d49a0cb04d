// `tessera train --gradient-checkpointing [POLICY]` and `tessera plan --gradient-checkpointing
// [POLICY]`: the activations the allocator counted at the peak of a real fp32 CPU training
// step fall as the policy recomputes more (none > attention, mlp > every_k:2 > full), the
// plan of the same shape predicts each within 2%, the policy reaches the run (the same losses
// under every policy, also under ZeRO-3), and bad policies are refused before any work, naming
// them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

#include "tests/cli/cli_harness.h"

using namespace tessera_cli_test;

namespace {

// 4 blocks of 64 channels: the blocks' activations outweigh the embeddings and the logits.
const std::string kShape = " --n-layer 4 --n-head 2 --n-embd 64 --seq 64 --batch 4 ";

std::string train_args(const std::string& out) {
  return "train --data " + (prepared("byte") / "train.bin").string() + kShape + " --steps 2 --out " +
         (scratch() / out).string() + " --overwrite-output-dir ";
}

std::string policy_flag(const std::string& policy) {
  return policy == "none" ? "" : " --gradient-checkpointing " + policy;
}

TEST(CliCheckpointing, PlanPredictsEachPolicysActivationPeakWithinTwoPercent) {
  const std::vector<std::string> policies = {"none", "attention", "mlp", "every_k:2", "full"};
  std::map<std::string, double> measured, planned;
  std::vector<double> first_losses;
  for (const std::string& policy : policies) {
    SCOPED_TRACE(policy);
    auto r = run(train_args("checkpointing_" + policy.substr(0, policy.find(':'))) +
                 "--memory-report" + policy_flag(policy));
    ASSERT_EQ(r.rc, 0) << r.output;
    const int64_t vocab = static_cast<int64_t>(numbers_after(r.output, "vocab ", 1)[0]);
    // The split at the step's peak in MiB: parameters gradients optimizer activations ...
    measured[policy] = numbers_after(r.output, "rank 0 peak", 7)[3] * (1 << 20);

    r = run("plan --device cpu --nproc 1 --vocab " + std::to_string(vocab) + kShape +
            policy_flag(policy));
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("gradient checkpointing " + policy), std::string::npos) << r.output;
    planned[policy] = numbers_after(r.output, "peak_bytes_by_category", 6)[3];
    const double error = (planned[policy] - measured[policy]) / measured[policy];
    std::printf("[ checkpointing ] %-10s activations at the step's peak: measured %9.0f bytes, "
                "planned %9.0f (%+.2f%%)\n",
                policy.c_str(), measured[policy], planned[policy], 100 * error);
    EXPECT_NEAR(planned[policy], measured[policy], 0.02 * measured[policy]);
  }
  for (const char* sub_layer : {"attention", "mlp"}) {
    EXPECT_LT(measured[sub_layer], measured["none"]) << sub_layer;
    EXPECT_GT(measured[sub_layer], measured["every_k:2"]) << sub_layer;
  }
  EXPECT_GT(measured["every_k:2"], measured["full"]);
}

// The recompute replays the first run's draws (dropout on): every policy trains the same
// model, so the logged losses are the run without checkpointing's.
TEST(CliCheckpointing, EveryPolicyLogsTheSameLosses) {
  std::vector<std::pair<int64_t, double>> plain;
  for (const std::string& policy : {"none", "every_k:3", "attention", "mlp", "full"}) {
    SCOPED_TRACE(policy);
    const std::string out = "checkpointing_losses_" + policy.substr(0, policy.find(':'));
    const auto r = run(train_args(out) + "--dropout 0.1" + policy_flag(policy));
    ASSERT_EQ(r.rc, 0) << r.output;
    const auto losses = losses_after(scratch() / out, 0);
    ASSERT_GE(losses.size(), 2u);  // the two steps (and the evaluation at the end)
    if (plain.empty()) plain = losses;
    EXPECT_EQ(losses, plain);
  }
  // Given without a value the flag means full; the run's settings say which policy it took.
  const auto r = run(train_args("checkpointing_flag_only") + "--gradient-checkpointing --dropout 0.1");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(losses_after(scratch() / "checkpointing_flag_only", 0), plain);
}

// ZeRO-3 gathers each block's parameters from the block's hooks, in forward and again before its
// backward: a recomputed block or sub-layer must find them there. On 2 ranks every policy trains
// the run without checkpointing's model, bit for bit.
TEST(CliCheckpointing, ZeroStage3TrainsTheSameModelUnderEveryPolicy) {
  const std::string launch = "launch --nproc-per-node 2 " + tessera_binary() + " ";
  std::vector<std::pair<int64_t, double>> plain;
  std::string plain_model;
  for (const std::string& policy : {"none", "every_k:2", "attention", "mlp", "full"}) {
    SCOPED_TRACE(policy);
    const std::string out = "checkpointing_zero3_" + policy.substr(0, policy.find(':'));
    const auto r = run(launch + train_args(out) + "--zero-stage 3 --dropout 0.1" + policy_flag(policy));
    ASSERT_EQ(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("ZeRO-3 over 2 processes"), std::string::npos) << r.output;
    const auto losses = losses_after(scratch() / out, 0);
    const std::string model = slurp(scratch() / out / "model" / "model.safetensors");
    ASSERT_GE(losses.size(), 2u);
    if (plain.empty()) {
      plain = losses;
      plain_model = model;
    }
    EXPECT_EQ(losses, plain);
    EXPECT_TRUE(model == plain_model) << "the exported weights differ";
  }
}

TEST(CliCheckpointing, BadPoliciesAreRefusedBeforeAnyWorkNamingThem) {
  for (const std::string bad : {"every_k:0", "every_k:x", "every_k:2.5", "every_k:-1", "blocks",
                                "Full", "every_k:5"}) {
    SCOPED_TRACE(bad);
    auto r = run(train_args("checkpointing_bad") + "--gradient-checkpointing " + bad);
    EXPECT_NE(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("'" + bad + "'"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << r.output;
    r = run("plan --device cpu" + kShape + " --gradient-checkpointing " + bad);
    EXPECT_NE(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find("--gradient-checkpointing: gradient checkpointing policy '" + bad + "'"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("peak_bytes"), std::string::npos) << r.output;
  }
  // every_k:K with K > n_layer says how many blocks the model has.
  auto r = run(train_args("checkpointing_bad") + "--gradient-checkpointing every_k:5");
  EXPECT_NE(r.output.find("4 blocks"), std::string::npos) << r.output;
  // A model from --init is held to its own blocks when the run enables the policy on it.
  r = run(train_args("checkpointing_init_source"));
  ASSERT_EQ(r.rc, 0) << r.output;
  const std::string init = " --init " + (scratch() / "checkpointing_init_source" / "model").string();
  r = run(train_args("checkpointing_init") + init + " --gradient-checkpointing every_k:6");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("'every_k:6'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("4 blocks"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("step 1/"), std::string::npos) << r.output;
  r = run(train_args("checkpointing_init") + init + " --gradient-checkpointing every_k:4");
  EXPECT_EQ(r.rc, 0) << r.output;
}

}  // namespace
