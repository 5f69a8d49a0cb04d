// `tessera train` on a device mesh (docs/mesh.md): --tp-size / --pp-size (or the config's
// tp_size, pp_size, pipeline_micro_batches, pipeline_schedule, Accelerate's parallelism_config,
// or `tessera launch --tp-size`) split the model over 4 ranks as tp2 x dp2 and pp2 x dp2. Each
// run must give the one-process run's losses (train and evaluation) and final model.safetensors
// within 1e-6, a tp2 x dp2 checkpoint must continue exactly at tp1 x dp1, and bad meshes are
// refused before any work, naming the numbers.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tessera/core/safetensors.h"
#include "tessera/kernels/ops.h"
#include "tests/cli/cli_harness.h"

namespace fs = std::filesystem;
using namespace tessera_cli_test;

namespace {

// GPT-2 with tied embeddings and an odd vocabulary (the tp halves hold 151 and 150 rows).
const std::string kGpt = " --n-layer 2 --n-head 2 --n-embd 16 --seq 16 --vocab-size 301 ";
const std::string kLlama =
    " --arch llama --n-layer 2 --n-head 4 --n-kv-head 2 --n-embd 16 --intermediate-size 24 "
    "--seq 16 --vocab-size 301 ";
// 4 rows a step in all (dp 2 x 2 rows on the meshes), evaluated once at the end. AdamW's
// epsilon 1e-5 as the mesh jobs of tests/dist take it: a key bias's gradient is zero but for
// rounding, which a smaller epsilon would turn into updates of the learning rate's size.
const std::string kSteps = " --steps 10 --eval-batches 3 --lr 3e-3 --warmup 2 --eps 1e-5 ";

std::string launch(int nproc, const std::string& launch_flags = "") {
  return "launch --nproc-per-node " + std::to_string(nproc) + " " + launch_flags + " " +
         tessera_binary() + " ";
}

std::string write(const std::string& name, const std::string& text) {
  const fs::path p = scratch() / name;
  std::ofstream(p) << text;
  return p.string();
}

// The evaluation's rows per batch (per_device_eval_batch_size, which defaults to the training
// batch per rank): 4 in every run, so that all of them score the same batches.
std::string eval_config() {
  return " --config " + write("mesh_eval.json", R"({"per_device_eval_batch_size": 4})") + " ";
}

std::string train(const std::string& out, const std::string& model = kGpt,
                  bool with_eval_config = true) {
  return "train --data " + (prepared("byte") / "train.bin").string() + model + " --out " +
         (scratch() / out).string() + " " + (with_eval_config ? eval_config() : std::string());
}

// Norm-wise relative difference of two tensors (float64).
double relative_difference(const tessera::Tensor& got, const tessera::Tensor& want) {
  using namespace tessera;
  const auto g = ops::to(got, Device::cpu(), DType::f64).contiguous().to_vector<double>();
  const auto w = ops::to(want, Device::cpu(), DType::f64).contiguous().to_vector<double>();
  if (g.size() != w.size()) return INFINITY;
  double diff = 0, norm = 0;
  for (size_t i = 0; i < w.size(); ++i) diff += (g[i] - w[i]) * (g[i] - w[i]), norm += w[i] * w[i];
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// The run's logged losses (train, and evaluations as -eval_loss) and grad norms after `after`
// against the reference run's, and its final model.safetensors against the reference's, all
// within 1e-6 relative; prints the largest differences.
void expect_same_run(const std::string& what, const fs::path& run, const fs::path& reference,
                     int64_t after = 0, bool compare_model = true, bool grad_norms = true) {
  SCOPED_TRACE(what);
  const auto want = losses_after(reference, after), got = losses_after(run, after);
  ASSERT_EQ(got.size(), want.size());
  ASSERT_FALSE(want.empty());
  double worst_loss = 0, worst_norm = 0;
  int evaluations = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].first, want[i].first);
    const double d = std::fabs(got[i].second - want[i].second) / std::fabs(want[i].second);
    worst_loss = std::max(worst_loss, d);
    EXPECT_LE(d, 1e-6) << "step " << want[i].first << ": " << got[i].second << " against "
                       << want[i].second;
    evaluations += want[i].second < 0;
  }
  // The evaluation is reported once, by the main process, as one process reports it.
  EXPECT_EQ(evaluations, 1);
  std::vector<double> norms_want, norms_got;
  for (const auto& j : read_metrics(reference))
    if (j.contains("grad_norm") && j["step"] > after) norms_want.push_back(j["grad_norm"]);
  for (const auto& j : read_metrics(run))
    if (j.contains("grad_norm") && j["step"] > after) norms_got.push_back(j["grad_norm"]);
  ASSERT_EQ(norms_got.size(), norms_want.size());
  for (size_t i = 0; i < norms_want.size(); ++i)
    worst_norm = std::max(worst_norm, std::fabs(norms_got[i] - norms_want[i]) / norms_want[i]);
  if (grad_norms) EXPECT_LE(worst_norm, 1e-5);
  double worst_weight = 0;
  std::string worst_name;
  size_t tensors = 0;
  if (compare_model) {
    const auto ref = tessera::load_safetensors((reference / "model" / "model.safetensors").string(),
                                               {.memory_map = false})
                         .tensors;
    const auto mine = tessera::load_safetensors((run / "model" / "model.safetensors").string(),
                                                {.memory_map = false})
                          .tensors;
    ASSERT_EQ(mine.size(), ref.size());
    for (const auto& [name, value] : ref) {
      ASSERT_TRUE(mine.count(name)) << name;
      ASSERT_EQ(mine.at(name).shape(), value.shape()) << name;
      const double d = relative_difference(mine.at(name), value);
      if (d >= worst_weight) worst_weight = d, worst_name = name;
    }
    tensors = ref.size();
    EXPECT_LE(worst_weight, 1e-6) << worst_name;
  }
  std::printf(
      "[ mesh ] %s: %zu losses after step %lld, largest relative difference %.3g; grad norms "
      "%.3g; %zu tensors of model.safetensors, largest %.3g (%s)\n",
      what.c_str(), want.size(), static_cast<long long>(after), worst_loss, worst_norm, tensors,
      worst_weight, worst_name.c_str());
}

// Runs `command`, which must succeed and print `line`.
RunResult run_printing(const std::string& command, const std::string& line) {
  RunResult r = run(command);
  EXPECT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find(line), std::string::npos) << r.output;
  return r;
}

TEST(CliMesh, TensorAndPipelineParallelTrainingEqualsOneProcess) {
  auto r = run(train("mesh_one") + kSteps + "--batch 4 --save-every 5");
  ASSERT_EQ(r.rc, 0) << r.output;
  r = run_printing(launch(4) + train("mesh_tp") + kSteps + "--batch 2 --tp-size 2 --save-every 5",
                   "device mesh: dp 2 x tp 2 x pp 1, the model tensor parallel, DDP");
  expect_same_run("GPT-2 tp2 x dp2", scratch() / "mesh_tp", scratch() / "mesh_one");
  r = run_printing(launch(4) + train("mesh_pp") + kSteps +
                       "--batch 2 --pp-size 2 --micro-batches 2 --save-every 5",
                   "device mesh: dp 2 x tp 1 x pp 2, the model pipeline parallel, DDP");
  expect_same_run("GPT-2 pp2 x dp2", scratch() / "mesh_pp", scratch() / "mesh_one");

  // The tp2 x dp2 checkpoint of step 5 (full tensors under the full model's names) continues in
  // one process, as the uninterrupted runs did.
  const fs::path checkpoint = scratch() / "mesh_tp" / "checkpoint-5";
  ASSERT_TRUE(fs::exists(checkpoint)) << r.output;
  // Its 4 rows a step are the dp replicas' (2 x 2), not the world's 4 x 2: kept at --batch 4,
  // and refused, naming the rows, at the saved --batch 2.
  r = run("train --resume " + checkpoint.string() + " --tp-size 1 --out " +
          (scratch() / "mesh_tp_resumed_refused").string());
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("was written by 4 processes (4 rows per micro-step) but this job has 1 "
                          "process(es) of 2 rows (2 per micro-step): the world size changed; to "
                          "resume, keep the global batch of 4 rows (--batch 4"),
            std::string::npos)
      << r.output;
  r = run("train --resume " + checkpoint.string() + " --tp-size 1 --batch 4 --out " +
          (scratch() / "mesh_tp_resumed_one").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
  expect_same_run("tp2 x dp2 checkpoint-5 resumed at tp1 x dp1", scratch() / "mesh_tp_resumed_one",
                  scratch() / "mesh_one", 5);
  // And the one-process checkpoint continues as a pipeline.
  r = run(launch(4) + "train --resume " + (scratch() / "mesh_one" / "checkpoint-5").string() +
          " --pp-size 2 --micro-batches 2 --batch 2 --out " +
          (scratch() / "mesh_one_resumed_pp").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_same_run("tp1 x dp1 checkpoint-5 resumed at pp2 x dp2", scratch() / "mesh_one_resumed_pp",
                  scratch() / "mesh_one", 5);
  // A pipeline's checkpoint continues tensor parallel (each stage wrote its part whole).
  r = run(launch(4) + "train --resume " + (scratch() / "mesh_pp" / "checkpoint-5").string() +
          " --pp-size 1 --tp-size 2 --out " + (scratch() / "mesh_pp_resumed_tp").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_same_run("pp2 x dp2 checkpoint-5 resumed at tp2 x dp2", scratch() / "mesh_pp_resumed_tp",
                  scratch() / "mesh_one", 5);
}

// tp and pp at once (a pipeline of tensor-parallel stages, dist::split_over_mesh's fourth case)
// and ZeRO-1/2 on the dp axis of both splits: the one-process run's losses, grad norms and
// weights within 1e-6; the ZeRO-1 checkpoint of a tp2 x dp2 run continues in one process.
TEST(CliMesh, TensorParallelPipelinesAndZeroOnTheDpAxisEqualOneProcess) {
  auto r = run(train("mesh3_one") + kSteps + "--batch 4 --save-every 5");
  ASSERT_EQ(r.rc, 0) << r.output;
  r = run_printing(launch(4) + train("mesh3_tppp") + kSteps +
                       "--batch 4 --tp-size 2 --pp-size 2 --micro-batches 2",
                   "device mesh: dp 1 x tp 2 x pp 2, the model tensor-parallel pipeline, DDP");
  expect_same_run("GPT-2 tp2 x pp2", scratch() / "mesh3_tppp", scratch() / "mesh3_one");
  r = run(launch(4) + train("mesh3_tp_zero1") + kSteps +
          "--batch 2 --tp-size 2 --zero-stage 1 --save-every 5");
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_same_run("GPT-2 tp2 x dp2, ZeRO-1", scratch() / "mesh3_tp_zero1", scratch() / "mesh3_one");
  r = run(launch(4) + train("mesh3_pp_zero2") + kSteps +
          "--batch 2 --pp-size 2 --micro-batches 2 --zero-stage 2");
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_same_run("GPT-2 pp2 x dp2, ZeRO-2", scratch() / "mesh3_pp_zero2", scratch() / "mesh3_one");
  r = run("train --resume " + (scratch() / "mesh3_tp_zero1" / "checkpoint-5").string() +
          " --tp-size 1 --zero-stage 0 --batch 4 --out " + (scratch() / "mesh3_resumed").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_same_run("tp2 x dp2 ZeRO-1 checkpoint-5 resumed in one process",
                  scratch() / "mesh3_resumed", scratch() / "mesh3_one", 5);
}

TEST(CliMesh, LlamaSplitsOverTensorAndPipelineParallelMeshes) {
  const std::string steps = " --steps 4 --eval-batches 2 --eps 1e-5 --no-tie-word-embeddings ";
  auto r = run(train("mesh_llama_one", kLlama) + steps + "--batch 4");
  ASSERT_EQ(r.rc, 0) << r.output;
  r = run(launch(4) + train("mesh_llama_tp", kLlama) + steps + "--batch 2 --tp-size 2");
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_same_run("Llama (untied) tp2 x dp2", scratch() / "mesh_llama_tp",
                  scratch() / "mesh_llama_one");
  r = run(launch(4) + train("mesh_llama_pp", kLlama) + steps +
          "--batch 2 --pp-size 2 --micro-batches 2 --pipeline-schedule afab");
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_same_run("Llama (untied) pp2 x dp2 afab", scratch() / "mesh_llama_pp",
                  scratch() / "mesh_llama_one");
}

// The same meshes from a config file's keys (YAML: Tessera's names; JSON: Accelerate's nested
// parallelism_config) and from `tessera launch --tp-size 2`, which `tessera train` takes
// without repeating it.
TEST(CliMesh, ConfigFileKeysAndTheLaunchSizesSetTheMesh) {
  const fs::path one = scratch() / "mesh_config_one";
  auto r = run(train("mesh_config_one") + kSteps + "--batch 4");
  ASSERT_EQ(r.rc, 0) << r.output;
  const std::string yaml =
      write("mesh_pp.yaml",
            "pp_size: 2\npipeline_micro_batches: 2\npipeline_schedule: "
            "afab\nper_device_train_batch_size: 2\nper_device_eval_batch_size: 4\n");
  r = run(launch(4) + train("mesh_config_pp", kGpt, false) + kSteps + "--config " + yaml);
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_same_run("YAML pp_size 2, pipeline_micro_batches 2, afab", scratch() / "mesh_config_pp",
                  one);
  const auto saved =
      nlohmann::json::parse(slurp(scratch() / "mesh_config_pp" / "config.train.json"));
  EXPECT_EQ(saved["pp_size"], 2);
  EXPECT_EQ(saved["pipeline_micro_batches"], 2);
  EXPECT_EQ(saved["pipeline_schedule"], "afab");
  const std::string json = write(
      "mesh_tp.json",
      R"({"parallelism_config": {"tp_size": 2, "dp_replicate_size": 2, "dp_shard_size": 1, "cp_size": 1},
          "per_device_train_batch_size": 2, "per_device_eval_batch_size": 4})");
  r = run(launch(4) + train("mesh_config_tp", kGpt, false) + kSteps + "--config " + json);
  ASSERT_EQ(r.rc, 0) << r.output;
  expect_same_run("JSON parallelism_config tp_size 2 x dp_replicate_size 2",
                  scratch() / "mesh_config_tp", one);
  r = run_printing(launch(4, "--tp-size 2") + train("mesh_launch_tp") + kSteps + "--batch 2",
                   "device mesh: dp 2 x tp 2 x pp 1");
  expect_same_run("tessera launch --tp-size 2", scratch() / "mesh_launch_tp", one);
}

// load_best_model_at_end on a mesh: every rank reads the best checkpoint's full weights and
// keeps its piece (a pipeline through a gathered whole model), so the exported model is that
// checkpoint's, tensor for tensor. greater_is_better makes the highest loss the best: an
// early checkpoint, not the final weights.
TEST(CliMesh, LoadBestModelAtEndRestoresTheCheckpointOnEveryPiece) {
  for (const std::string& mesh :
       {std::string("--tp-size 2"), std::string("--pp-size 2 --micro-batches 2")}) {
    SCOPED_TRACE(mesh);
    const std::string out = mesh.starts_with("--tp") ? "mesh_best_tp" : "mesh_best_pp";
    const std::string config =
        write(out + ".json", R"({"load_best_model_at_end": true, "eval_steps": 3, "save_steps": 3,
                          "per_device_eval_batch_size": 4, "save_total_limit": 5,
                          "greater_is_better": true})");
    const auto r =
        run_printing(launch(4) + train(out, kGpt, false) + " --steps 7 --eval-batches 2 " +
                         "--batch 2 --config " + config + " " + mesh,
                     "loaded the best model");
    const auto state =
        nlohmann::json::parse(slurp(scratch() / out / "checkpoint-7" / "trainer_state.json"));
    const std::string best = state["best_model_checkpoint"];
    ASSERT_FALSE(best.empty()) << r.output;
    const auto want =
        tessera::load_safetensors((scratch() / out / best / "model.safetensors").string(),
                                  {.memory_map = false})
            .tensors;
    const auto got =
        tessera::load_safetensors((scratch() / out / "model" / "model.safetensors").string(),
                                  {.memory_map = false})
            .tensors;
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, value] : want)
      EXPECT_EQ(relative_difference(got.at(name), value), 0) << name;
    std::printf("[ mesh ] %s: load_best_model_at_end restored %s (%zu tensors exactly)\n",
                mesh.c_str(), best.c_str(), want.size());
  }
}

TEST(CliMesh, BadMeshesAreRefusedBeforeAnyWorkNamingTheNumbers) {
  const std::string fast = " --steps 2 --batch 4 ";
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {"", "--tp-size 2", "tp_size 2 x pp_size 1 = 2 does not divide the world size 1"},
      {"", "--dp-size 2", "dp_size 2 x tp_size 1 x pp_size 1 = 2 is not the world size 1"},
      {launch(4), "--tp-size 2 --pp-size 2 --dp-size 2",
       "dp_size 2 x tp_size 2 x pp_size 2 = 8 is not the world size 4"},
      {launch(2), "--tp-size 2 --n-head 1", "tp_size 2 does not divide GPT-2's n_head 1"},
      {launch(2), "--tp-size 2 --arch llama --n-head 4 --n-kv-head 1",
       "tp_size 2 does not divide Llama's num_key_value_heads 1"},
      {launch(2), "--pp-size 2 --n-layer 1", "pp_size 2 exceeds the 1"},
      {launch(2), "--pp-size 2 --batch 3 --micro-batches 2",
       "pipeline_micro_batches\" 2 does not divide"},
      {launch(2), "--pp-size 2 --grad-accum 2", "a pipeline's micro-batches are its accumulation"},
      {launch(2), "--pp-size 2 --pipeline-schedule gpipe", "must be 1f1b or afab"},
      {launch(2), "--tp-size 2 --zero-stage 3", "resolves to 3 (ZeRO-3)"},
      {launch(2), "--tp-size 2 --zero-stage 2 --offload optimizer --grad-clip 0",
       "does not support offload"},
      {launch(2), "--tp-size 2 --dropout 0.1", "without dropout"},
      {launch(2, "--tp-size 2"), "--tp-size 1", "the launch environment (TESSERA_TP_SIZE"},
      {"", "--tp-size 0", "\"tp_size\" must be from 1 to 65536 (got 0)"},
      {"", "--config " + write("mesh_cp.json", R"({"parallelism_config": {"cp_size": 2}})"),
       "cp_size 2 asks for context parallelism"},
      {"",
       "--config " + write("mesh_shard.json", R"({"parallelism_config": {"dp_shard_size": 2}})"),
       "dp_shard_size 2 asks for FSDP sharding"},
      {"",
       "--config " +
           write("mesh_both.json", R"({"parallelism_config": {"tp_size": 2}, "tp_size": 2})"),
       "set the same setting"},
  };
  for (const auto& [prefix, flags, message] : cases) {
    SCOPED_TRACE(flags);
    const bool own_config = flags.starts_with("--config");
    const auto r = run(prefix + train("mesh_refused", kGpt, !own_config) + fast + flags);
    EXPECT_NE(r.rc, 0) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << r.output;
    // Refused before the model was built and the ranks met: no model line, no step.
    EXPECT_EQ(r.output.find("model: "), std::string::npos) << r.output;
  }
}

}  // namespace

namespace {

// `tessera plan --tp-size 2` / `--pp-size 2` on 4 ranks against a real 4-rank run's
// --memory-report: every rank's parameters, gradients and optimizer state (and, tensor
// parallel, activations at the steps' peak) within 2% of the plan's (the dry run splits the
// model with the run's own split; a pipeline's stages are cut by its own pipeline_stage_blocks).
// The tensor-parallel traffic is checked against docs/mesh.md's count: 4L + 4 all-reduces a step,
// 4L + 2 of N·d values and the loss's N and 2N.
TEST(CliMesh, PlanPerRankMemoryMatchesAMeasuredRunWithinTwoPercent) {
  const int64_t layers = 2, embd = 64, seq = 16, batch = 2, vocab = 301;
  const std::string shape = " --n-layer 2 --n-head 4 --n-embd 64 --seq 16 --batch 2 ";
  for (const std::string& mesh :
       {std::string("--tp-size 2"), std::string("--pp-size 2 --micro-batches 2"),
        std::string("--pp-size 2 --micro-batches 2 --zero-stage 1")}) {
    SCOPED_TRACE(mesh);
    const bool tp = mesh.starts_with("--tp");
    const std::string out = tp ? "mesh_plan_tp"
                            : mesh.find("zero") == std::string::npos ? "mesh_plan_pp"
                                                                     : "mesh_plan_pp_zero1";
    auto r = run(launch(4) + "train --data " + (prepared("byte") / "train.bin").string() + shape +
                 " --vocab-size 301 --steps 2 --eval-batches 1 --memory-report --out " +
                 (scratch() / out).string() + " " + mesh);
    ASSERT_EQ(r.rc, 0) << r.output;
    const auto plan =
        run("plan --device cpu --nproc 4 --vocab " + std::to_string(vocab) + shape + mesh);
    ASSERT_EQ(plan.rc, 0) << plan.output;
    // The categories both give: parameters, gradients, optimizer state, and the activations
    // at the steps' peak (the report's peak row: the end-of-run evaluation is a phase of its
    // own): every rank's for tensor parallelism, stage 0's for a pipeline (the plan runs rank
    // 0's stage through its schedule; each stage's kept state comes from the stage table).
    const char* names[] = {"parameters", "gradients", "optimizer", "activations"};
    const int categories = tp ? 4 : 3;
    for (int rank = 0; rank < 4; ++rank) {
      const std::vector<double> measured_mib =
          numbers_after(r.output, "rank " + std::to_string(rank) + " peak", 4);
      // Megatron's order: tp rank = rank % 2 (tp2 x dp2), stage = rank % 2 (pp2 x dp2).
      const std::vector<double> predicted =
          tp ? numbers_after(plan.output, "step_peak_bytes_by_category", 4)
             : numbers_after(plan.output, "stage_bytes_by_category " + std::to_string(rank % 2), 3);
      std::vector<double> want = predicted;
      int compared = categories;
      if (!tp && rank % 2 == 0) {
        want.push_back(numbers_after(plan.output, "step_peak_bytes_by_category", 4)[3]);
        compared = 4;
      }
      for (int c = 0; c < compared; ++c) {
        const double measured = measured_mib[c] * (1 << 20);
        std::printf("[ plan ] %s: rank %d %-11s predicted %8.0f bytes, measured %8.0f (%.3f%%)\n",
                    mesh.c_str(), rank, names[c], want[c], measured,
                    measured > 0 ? 100 * std::fabs(want[c] - measured) / measured : 0.0);
        EXPECT_NEAR(want[c], measured, std::max(0.02 * measured, 2048.0))
            << names[c] << plan.output << r.output;
      }
    }
    if (tp) {
      const int64_t n = batch * seq;
      EXPECT_EQ(numbers_after(plan.output, "tp_collectives_per_step", 1)[0], 4 * layers + 4);
      EXPECT_EQ(numbers_after(plan.output, "tp_collective_bytes_per_step", 1)[0],
                ((4 * layers + 2) * n * embd + 3 * n) * 4);
    } else {  // each stage sends one [1, 16, 64] f32 activation (or its gradient) a micro-batch
      for (int stage = 0; stage < 2; ++stage)
        EXPECT_EQ(
            numbers_after(plan.output, "stage_send_bytes_per_step " + std::to_string(stage), 1)[0],
            2 * (batch / 2) * seq * embd * 4);
    }
  }
  // A mesh the plan cannot lay out is refused naming the numbers.
  const auto bad = run("plan --device cpu --nproc 4 --tp-size 3" + shape);
  EXPECT_NE(bad.rc, 0);
  EXPECT_NE(bad.output.find("tp_size 3 x pp_size 1 = 3 does not divide the world size 4"),
            std::string::npos)
      << bad.output;
}

}  // namespace
