// The device mesh (dist/device_mesh.h): Megatron's rank order and the groups of each axis for
// 8 ranks, the refusals, a mesh of one process; and the Accelerator on meshes of 4 and 8 ranks
// (dist_mesh_check jobs through `tessera launch`): tp2 x dp2, pp2 x dp2 (DDP, ZeRO-1, ZeRO-2),
// tp2 x pp2 and dp2 x tp2 x pp2 (dist::parallelize's pipeline of tensor-parallel stages) against
// one process, gather_for_metrics over the dp axis, and checkpoints of a mesh run resumed at
// other meshes.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "parallel_jobs.h"
#include "tessera/dist/device_mesh.h"
#include "tessera/dist/single_process_group.h"

namespace {

using namespace tessera;
using dist::MeshAxis;
using dist::MeshShape;
using tessera::parallel_check::error_of;

TEST(DeviceMesh, RanksAndGroupsFollowMegatronsOrderOn8Ranks) {
  const MeshShape s = dist::resolve_mesh_shape({.dp = 2, .tp = 2, .pp = 2}, 8);
  // rank = (d·pp + p)·tp + t: rank 5 is d 1, p 0, t 1.
  const dist::MeshCoordinate five = dist::mesh_coordinate(s, 5);
  EXPECT_EQ(five.dp, 1);
  EXPECT_EQ(five.pp, 0);
  EXPECT_EQ(five.tp, 1);
  EXPECT_EQ(dist::mesh_group_ranks(s, MeshAxis::tp, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(dist::mesh_group_ranks(s, MeshAxis::pp, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(dist::mesh_group_ranks(s, MeshAxis::dp, 5), (std::vector<int>{1, 5}));
  // Every axis cuts the world into groups that every rank of the group agrees on; the
  // coordinates name each rank once.
  std::set<std::vector<int>> coordinates;
  for (int r = 0; r < 8; ++r) {
    const dist::MeshCoordinate c = dist::mesh_coordinate(s, r);
    EXPECT_EQ(dist::mesh_rank(s, c), r);
    coordinates.insert({c.dp, c.pp, c.tp});
    for (MeshAxis axis : {MeshAxis::dp, MeshAxis::tp, MeshAxis::pp}) {
      const std::vector<int> group = dist::mesh_group_ranks(s, axis, r);
      EXPECT_EQ(group.size(), 2u);
      EXPECT_NE(std::find(group.begin(), group.end(), r), group.end());
      for (int other : group) EXPECT_EQ(dist::mesh_group_ranks(s, axis, other), group);
    }
  }
  EXPECT_EQ(coordinates.size(), 8u);
  // tp innermost (consecutive ranks), dp outermost: tp 4 x dp 2 on 8 ranks.
  const MeshShape wide = dist::resolve_mesh_shape({.tp = 4}, 8);
  EXPECT_EQ(wide.dp, 2);
  EXPECT_EQ(dist::mesh_group_ranks(wide, MeshAxis::tp, 6), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(dist::mesh_group_ranks(wide, MeshAxis::dp, 6), (std::vector<int>{2, 6}));
  EXPECT_EQ(dist::mesh_group_ranks(wide, MeshAxis::pp, 6), (std::vector<int>{6}));
  // A replica's tp x pp ranks: the same dp coordinate.
  EXPECT_EQ(dist::mesh_replica_ranks(s, 5), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(dist::mesh_replica_ranks(wide, 1), (std::vector<int>{0, 1, 2, 3}));
}

TEST(DeviceMesh, RefusesAMeshThatIsNotTheWorldNamingTheNumbers) {
  EXPECT_NE(error_of([] {
              dist::resolve_mesh_shape({.dp = 2, .tp = 2, .pp = 2}, 4);
            }).find("dp_size 2 x tp_size 2 x pp_size 2 = 8 is not the world size 4"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              dist::resolve_mesh_shape({.tp = 3}, 4);
            }).find("tp_size 3 x pp_size 1 = 3 does not divide the world size 4"),
            std::string::npos);
  EXPECT_NE(
      error_of([] { dist::resolve_mesh_shape({.tp = 0}, 4); }).find("tp_size must be >= 1, got 0"),
      std::string::npos);
  EXPECT_NE(error_of([] {
              dist::resolve_mesh_shape({.pp = -2}, 4);
            }).find("pp_size must be >= 1, got -2"),
            std::string::npos);
  EXPECT_NE(error_of([] { dist::resolve_mesh_shape({.dp = 0}, 4); }).find("dp_size must be >= 1"),
            std::string::npos);
  EXPECT_EQ(dist::resolve_mesh_shape({}, 4), (MeshShape{.dp = 4, .tp = 1, .pp = 1}));
  // Refused before the groups are made: a DeviceMesh over a world of one.
  EXPECT_NE(error_of([] {
              dist::DeviceMesh(std::make_shared<dist::SingleProcessGroup>(), {.tp = 2});
            }).find("tp_size 2 x pp_size 1 = 2 does not divide the world size 1"),
            std::string::npos);
}

TEST(DeviceMesh, OneProcessIsEveryAxisOfItself) {
  auto world = std::make_shared<dist::SingleProcessGroup>();
  const dist::DeviceMesh mesh(world, {});
  EXPECT_EQ(mesh.dp_group(), world);
  EXPECT_EQ(mesh.tp_group(), world);
  EXPECT_EQ(mesh.pp_group(), world);
  EXPECT_TRUE(mesh.data_parallel_only());
  EXPECT_EQ(mesh.describe(), "dp 1 x tp 1 x pp 1; rank 0: dp 0, tp 0, pp 0");
}

// ---- the Accelerator on a mesh of 4 CPU ranks ----
using tessera::parallel_check::launch;

double mesh_job(int nproc, const std::string& args) {
  const auto data = tessera::test_jobs::fresh_scratch_folder("mesh_data").string();
  return tessera::parallel_check::expect_equal_to_one_process(DIST_MESH_CHECK, "dist_mesh_check",
                                                              nproc, "--data " + data + " " + args);
}

// A 4-rank mesh job in f32 (within 1e-6 of one process) and in f64 (within 1e-10).
void expect_equal_in_f32_and_f64(const std::string& args) {
  EXPECT_LE(mesh_job(4, args), 1e-6);
  EXPECT_LE(mesh_job(4, args + " --f64 --rtol 1e-10"), 1e-10);
}

// GPT-2 (tied) split over tp 2 with DDP on the dp axis; every step's loss and every parameter
// after 10 AdamW steps (eps 1e-5, as test_tensor_parallel.cpp says why).
TEST(MeshJobs, Gpt2TensorParallel2TimesDataParallel2EqualsOneProcess) {
  expect_equal_in_f32_and_f64("--model gpt --tp 2");
  EXPECT_LE(mesh_job(4, "--model gpt --tp 2 --zero 2"), 1e-6);  // ZeRO-2 on the dp axis
}

// Llama split over tp 2 with ZeRO-1 on the dp axis.
TEST(MeshJobs, LlamaTensorParallel2TimesZero1On2EqualsOneProcess) {
  expect_equal_in_f32_and_f64("--model llama --tp 2 --zero 1");
}

// Two pipelines of 2 stages (8 micro-batches of one row each) with DDP between them.
TEST(MeshJobs, Gpt2PipelineParallel2TimesDataParallel2EqualsOneProcess) {
  expect_equal_in_f32_and_f64("--model gpt --pp 2");
}

TEST(MeshJobs, LlamaPipelineParallel2TimesDataParallel2EqualsOneProcess) {
  expect_equal_in_f32_and_f64("--model llama --pp 2");
}

// ZeRO-1 and ZeRO-2 on the dp axis of two pipelines (the stages' micro-batches accumulate in the
// full buckets, reduced once the step's last backward and the tied gradient are done).
TEST(MeshJobs, PipelineParallel2TimesZero1And2On2EqualsOneProcess) {
  EXPECT_LE(mesh_job(4, "--model gpt --pp 2 --zero 1"), 1e-6);
  EXPECT_LE(mesh_job(4, "--model gpt --pp 2 --zero 2"), 1e-6);
  EXPECT_LE(mesh_job(4, "--model llama --pp 2 --zero 2"), 1e-6);
}

// One pipeline of 2 stages, each split over 2 ranks (tp2 x pp2 on 4 ranks): GPT-2 (tied: the
// embedding's vocabulary rows on the first stage, the head's copy on the last) and Llama (GQA,
// an untied vocabulary-parallel head); then each with the other kind of head.
TEST(MeshJobs, TensorParallel2TimesPipelineParallel2EqualsOneProcess) {
  expect_equal_in_f32_and_f64("--model gpt --tp 2 --pp 2");
  expect_equal_in_f32_and_f64("--model llama --tp 2 --pp 2");
  EXPECT_LE(mesh_job(4, "--model gpt --tp 2 --pp 2 --flip-tie"), 1e-6);
  EXPECT_LE(mesh_job(4, "--model llama --tp 2 --pp 2 --flip-tie"), 1e-6);
}

// The full 3-D mesh on 8 ranks, dp2 x tp2 x pp2: DDP, ZeRO-1 and ZeRO-2 on the dp axis.
TEST(MeshJobs, DataTensorPipelineParallel2x2x2On8RanksEqualsOneProcess) {
  EXPECT_LE(mesh_job(8, "--model gpt --tp 2 --pp 2"), 1e-6);
  EXPECT_LE(mesh_job(8, "--model llama --tp 2 --pp 2"), 1e-6);
  EXPECT_LE(mesh_job(8, "--model gpt --tp 2 --pp 2 --zero 1"), 1e-6);
  EXPECT_LE(mesh_job(8, "--model llama --tp 2 --pp 2 --zero 2"), 1e-6);
}

// Global-norm clipping (max_norm 0.05, below every step's norm, so every step is scaled): the
// split model's norm and clipped steps equal one process's clip_grad_norm_, under DDP and ZeRO.
TEST(MeshJobs, GlobalNormClippingOfASplitModelEqualsOneProcess) {
  EXPECT_LE(mesh_job(4, "--model gpt --tp 2 --clip 0.05"), 1e-6);
  EXPECT_LE(mesh_job(4, "--model gpt --pp 2 --clip 0.05"), 1e-6);
  EXPECT_LE(mesh_job(4, "--model gpt --pp 2 --zero 2 --clip 0.05"), 1e-6);
  EXPECT_LE(mesh_job(4, "--model gpt --tp 2 --pp 2 --clip 0.05"), 1e-6);
  EXPECT_LE(mesh_job(8, "--model llama --tp 2 --pp 2 --zero 1 --clip 0.05"), 1e-6);
}

// gather_for_metrics over the dp axis: 7 items split (padded) over the dp ranks come back once
// each, in order, on tp2 x dp2, pp2 x dp2 and dp2 x tp2 x pp2 (and on dp 4, the world).
TEST(MeshJobs, GatherForMetricsGathersEachRowOnceOverTheDpAxis) {
  const auto data = tessera::test_jobs::fresh_scratch_folder("mesh_metrics").string();
  for (const auto& [nproc, flags] : std::vector<std::pair<int, std::string>>{
           {4, "--tp 2"}, {4, "--pp 2"}, {8, "--tp 2 --pp 2"}, {4, ""}}) {
    const tessera::test_jobs::JobResult r = tessera::test_jobs::run_job(
        tessera::parallel_check::launch(DIST_MESH_CHECK, nproc,
                                        "--data " + data + " --metrics 7 " + flags),
        120);
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_EQ(tessera::parallel_check::count_of(r.output, "every item once -> OK"), nproc)
        << r.output;
  }
}

// The mesh's sizes from `tessera launch --tp-size / --pp-size` (TESSERA_TP_SIZE, TESSERA_PP_SIZE
// for a program that leaves them at 1), and the launcher's own refusal of sizes that do not divide
// its ranks.
TEST(MeshJobs, LaunchPassesTheMeshSizesOn) {
  const auto data = tessera::test_jobs::fresh_scratch_folder("mesh_launch").string();
  for (const std::string flag : {"--tp-size 2", "--pp-size 2"}) {
    const std::string command = "env OMP_NUM_THREADS=1 " + std::string(TESSERA_CLI) +
                                " launch --nproc-per-node 4 " + flag + " " + DIST_MESH_CHECK +
                                " --data " + data;
    const tessera::test_jobs::JobResult r = tessera::test_jobs::run_job(command, 300);
    EXPECT_EQ(r.status, 0) << r.output;
    EXPECT_EQ(tessera::parallel_check::count_of(r.output, "-> OK"), 4) << r.output;
    EXPECT_EQ(tessera::parallel_check::count_of(
                  r.output, flag == "--tp-size 2" ? "dp 2 x tp 2 x pp 1" : "dp 2 x tp 1 x pp 2"),
              4)
        << r.output;
    EXPECT_LE(tessera::parallel_check::largest_difference_printed(r.output), 1e-6) << r.output;
  }
  const tessera::test_jobs::JobResult r = tessera::test_jobs::run_job(
      std::string(TESSERA_CLI) + " launch --nproc-per-node 2 --tp-size 2 --pp-size 2 " +
          DIST_MESH_CHECK + " --data " + data,
      60);
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--tp-size 2 x --pp-size 2 = 4 does not divide the world size 2"),
            std::string::npos)
      << r.output;
}

// Refused on every rank before any work, naming the numbers.
TEST(MeshJobs, AMeshThatIsNotTheWorldIsRefusedOnEveryRank) {
  const auto data = tessera::test_jobs::fresh_scratch_folder("mesh_refused").string();
  struct Refusal {
    int ranks;
    std::string flags, message;
  };
  for (const Refusal& r : std::vector<Refusal>{
           {4, "--tp 2 --pp 2 --dp 2",
            "dp_size 2 x tp_size 2 x pp_size 2 = 8 is not the world size 4"},
           {4, "--tp 2 --zero 3", "ZeRO-3 (zero_stage 3) needs tp_size = pp_size = 1"},
           {4, "--tp 2 --whole",
            "the device mesh dp 2 x tp 2 x pp 1 needs the model split over its tp group"},
           // The combinations of both splits.
           {4, "--tp 2 --pp 2 --whole",
            "the device mesh dp 1 x tp 2 x pp 2 needs the model split over its tp and pp groups "
            "at once (2 x 2 ranks)"},
           {4, "--tp 2 --pp 2 --zero 3", "ZeRO-3 (zero_stage 3) needs tp_size = pp_size = 1"},
           {8, "--tp 2 --pp 4", "pipeline parallelism: pp_size 4 exceeds the 2 blocks of GPT-2"},
           {8, "--model llama --kv-heads 2 --tp 4 --pp 2",
            "tensor parallelism: tp_size 4 does not divide Llama's num_key_value_heads 2"},
           {4, "--tp 2 --pp 2 --micro-batches 3",
            "pipeline parallelism: micro_batches 3 does not divide the batch of 16 rows"},
           {4, "--tp 2 --pp 2 --micro-batches 0",
            "pipeline parallelism: micro_batches must be >= 1, got 0"}})
    tessera::parallel_check::expect_refused(DIST_MESH_CHECK, r.ranks,
                                            "--data " + data + " " + r.flags, r.message);
}

// A run (f64) on `saving_ranks` ranks (4) with `split` saves after 5 of 10 steps (and save_model's
// full model at the end) and records its losses and final parameters; each resume (ranks, flags)
// loads the checkpoint and trains the last 5 steps. Resumed at the mesh that saved it, the run must
// end bit for bit as the uninterrupted one (--compare-rtol 0); elsewhere the sums run in another
// order, within the resume's --compare-rtol.
void expect_resumes(const std::string& split,
                    const std::vector<std::pair<int, std::string>>& resumes,
                    const std::string& model = "gpt", int saving_ranks = 4) {
  const auto dir = tessera::test_jobs::fresh_scratch_folder("mesh_resume").string();
  const std::string base = "--model " + model + " --f64 --rtol 1e-10 ";
  EXPECT_LE(
      mesh_job(saving_ranks, base + split + " --save-at 5 --save-dir " + dir + "/ckpt --record " +
                                 dir + "/run.safetensors --save-model " + dir + "/model"),
      1e-10);
  const std::string resume = "--resume " + dir + "/ckpt --compare " + dir + "/run.safetensors ";
  for (const auto& [ranks, flags] : resumes)
    EXPECT_LE(mesh_job(ranks, base + resume + flags), 1e-10);
  std::filesystem::remove_all(dir);
}

// tp2 x dp2 resumed at tp2 x dp2 (bit for bit), tp2 x dp1 and tp1 x dp1 (within 1e-10).
TEST(MeshJobs, TensorParallelCheckpointResumesAtOtherMeshes) {
  expect_resumes("--tp 2",
                 {{4, "--tp 2"}, {2, "--tp 2 --compare-rtol 1e-10"}, {1, "--compare-rtol 1e-10"}});
}

// One pipeline of 2 tensor-parallel stages (tp2 x pp2) resumed at tp2 x pp2 (bit for bit), at
// tp2 x pp1 and in one process; and back: a one-process-format run of 4 ranks (dp 4) resumed at
// tp2 x pp2.
TEST(MeshJobs, TensorPipelineParallelCheckpointResumesAtOtherMeshes) {
  expect_resumes(
      "--tp 2 --pp 2",
      {{4, "--tp 2 --pp 2"}, {2, "--tp 2 --compare-rtol 1e-10"}, {1, "--compare-rtol 1e-10"}});
  expect_resumes(
      "", {{4, "--tp 2 --pp 2 --compare-rtol 1e-10"}, {8, "--tp 2 --pp 2 --compare-rtol 1e-10"}});
}

// ZeRO-1 on the dp axis of two pipelines: its checkpoint is in the full format too (each rank's
// slices of the moments made whole over dp, then gathered over the pipeline), resumed at the
// same mesh (bit for bit), under ZeRO-2, at pp2 x dp1 under DDP, in one process and at
// dp2 x tp2 x pp2 under ZeRO-2.
TEST(MeshJobs, PipelineZeroCheckpointResumesAtOtherMeshes) {
  expect_resumes("--pp 2 --zero 1", {{4, "--pp 2 --zero 1"},
                                     {4, "--pp 2 --zero 2 --compare-rtol 1e-10"},
                                     {2, "--pp 2 --compare-rtol 1e-10"},
                                     {1, "--compare-rtol 1e-10"},
                                     {8, "--tp 2 --pp 2 --zero 2 --compare-rtol 1e-10"}});
}

// ZeRO-2 on the full 3-D mesh (Llama, dp2 x tp2 x pp2 on 8 ranks): resumed there (bit for bit),
// in one process and at tp2 x dp2 under ZeRO-1.
TEST(MeshJobs, DataTensorPipelineZeroCheckpointResumesAtOtherMeshes) {
  expect_resumes("--tp 2 --pp 2 --zero 2",
                 {{8, "--tp 2 --pp 2 --zero 2"},
                  {1, "--compare-rtol 1e-10"},
                  {4, "--tp 2 --zero 1 --compare-rtol 1e-10"}},
                 "llama", 8);
}

// Two pipelines of 2 stages resumed at pp2 x dp2 (bit for bit), pp2 x dp1 and in one process.
TEST(MeshJobs, PipelineParallelCheckpointResumesAtOtherMeshes) {
  expect_resumes("--pp 2",
                 {{4, "--pp 2"}, {2, "--pp 2 --compare-rtol 1e-10"}, {1, "--compare-rtol 1e-10"}});
}

}  // namespace
