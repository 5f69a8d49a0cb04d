// Sharded ZeRO checkpoints (dist/checkpoint.h) through dist_zero_check: saved without
// gathering the model, resumed at other world sizes and stages bit for bit, and refused when
// the index disagrees with its shards.
//
// The reference for a resume on W ranks is the same training state saved in today's whole
// (DDP) format and resumed on W ranks: every run accumulates as no_sync, where the ZeRO stages
// are DDP's arithmetic bit for bit (ZeroEquivalence), so the two must agree exactly; on the
// saving world size both must equal the uninterrupted run. (Across world sizes the batch's sums
// round in another order, so an uninterrupted run on W ranks is no reference.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/core/file_io.h"
#include "tessera/dist/checkpoint.h"

#include "run_job.h"

namespace {

namespace fs = std::filesystem;
using tessera::test_jobs::JobResult;
using tessera::test_jobs::run_job;

constexpr int kGlobalRows = 12, kSteps = 6, kSaveAt = 3;

fs::path scratch() {
  static const fs::path dir = tessera::test_jobs::fresh_scratch_folder("zero_checkpoint");
  return dir;
}

std::string on_ranks(int nproc) {
  if (nproc == 1) return "env -u RANK -u WORLD_SIZE " DIST_ZERO_CHECK;
  return std::string(TESSERA_CLI) + " launch --nproc-per-node " + std::to_string(nproc) + " " + DIST_ZERO_CHECK;
}

// A GPT of 4 blocks; --bucket-bytes 3000 gives stages 0-2 several buckets (stage 3: one a unit).
std::string job(int nproc, int stage, const std::string& out, const std::string& extra) {
  return "env OMP_NUM_THREADS=1 " + on_ranks(nproc) + " --zero-accumulation no_sync --layers 4 --bucket-bytes 3000" +
         " --steps " + std::to_string(kSteps) + " --rows " + std::to_string(kGlobalRows / nproc) + " --zero-stage " +
         std::to_string(stage) + " --out " + (scratch() / out).string() + " " + extra;
}

// "param NAME v0 v1 ..." lines of a result file: NAME -> the values as printed (%.9g of f32
// round-trips, so equal text is equal bits).
std::map<std::string, std::vector<std::string>> final_weights(const std::string& out) {
  std::map<std::string, std::vector<std::string>> weights;
  std::ifstream in(scratch() / out);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream is(line);
    std::string kind, name, v;
    is >> kind >> name;
    if (kind != "param") continue;
    while (is >> v) weights[name].push_back(v);
  }
  return weights;
}

// Bit-identical weights; prints the largest absolute difference either way.
void expect_same_weights(const std::string& got, const std::string& want, const std::string& what) {
  const auto a = final_weights(got), b = final_weights(want);
  ASSERT_FALSE(b.empty()) << want;
  ASSERT_EQ(a.size(), b.size()) << what;
  double max_diff = 0;
  size_t differing = 0;
  for (const auto& [name, values] : b) {
    ASSERT_TRUE(a.count(name)) << what << ": " << name;
    ASSERT_EQ(a.at(name).size(), values.size()) << what << ": " << name;
    for (size_t i = 0; i < values.size(); ++i) {
      max_diff = std::max(max_diff, std::fabs(std::stod(a.at(name)[i]) - std::stod(values[i])));
      differing += a.at(name)[i] != values[i];
    }
  }
  std::printf("[ zero-ckpt ] %s: max |difference| %.3g over %zu tensors (%zu values differ)\n", what.c_str(),
              max_diff, b.size(), differing);
  EXPECT_EQ(differing, 0u) << what;
}

void run_ok(const std::string& command) {
  const JobResult r = run_job(command, 300);
  ASSERT_EQ(r.status, 0) << command << "\n" << r.output;
}

struct Resume {
  int nproc, stage;
};

// Trains `saved_nproc` ranks at `saved_stage`, saving after step kSaveAt, and the same in DDP's
// whole format; then resumes both at each (nproc, stage) and compares the final weights.
void expect_bit_identical_resumes(int saved_nproc, int saved_stage, const std::vector<Resume>& resumes) {
  const std::string tag = "s" + std::to_string(saved_stage) + "x" + std::to_string(saved_nproc);
  const std::string sharded = (scratch() / (tag + "_ckpt")).string();
  const std::string whole = (scratch() / ("ddp_x" + std::to_string(saved_nproc) + "_ckpt")).string();
  const std::string save = " --save-at " + std::to_string(kSaveAt) + " --save ";
  run_ok(job(saved_nproc, saved_stage, tag + "_full.txt", save + sharded));
  if (!fs::exists(whole)) run_ok(job(saved_nproc, 0, "ddp_x" + std::to_string(saved_nproc) + "_full.txt", save + whole));
  expect_same_weights(tag + "_full.txt", "ddp_x" + std::to_string(saved_nproc) + "_full.txt",
                      tag + " uninterrupted vs DDP uninterrupted");
  // One shard a rank, and model.safetensors streamed from them: the whole save's file byte for byte.
  EXPECT_EQ(tessera::read_file(sharded + "/model.safetensors"),
            tessera::read_file(whole + "/model.safetensors"));
  std::ifstream index_file(sharded + "/model_shards.json");
  const auto index = nlohmann::json::parse(index_file);
  EXPECT_EQ(index["world_size"].get<int>(), saved_nproc);
  EXPECT_EQ(index["files"].size(), static_cast<size_t>(saved_nproc));
  const std::string resume = " --start-step " + std::to_string(kSaveAt) + " --resume ";
  for (const Resume& r : resumes) {
    const std::string at = std::to_string(r.nproc) + "x_s" + std::to_string(r.stage);
    run_ok(job(r.nproc, r.stage, tag + "_on_" + at + ".txt", resume + sharded));
    if (r.nproc == saved_nproc) {
      expect_same_weights(tag + "_on_" + at + ".txt", tag + "_full.txt",
                          tag + " checkpoint resumed on " + at + " vs uninterrupted");
      continue;
    }
    const std::string reference = "ddp_x" + std::to_string(saved_nproc) + "_on_" + std::to_string(r.nproc) + ".txt";
    if (!fs::exists(scratch() / reference)) run_ok(job(r.nproc, 0, reference, resume + whole));
    expect_same_weights(tag + "_on_" + at + ".txt", reference,
                        tag + " checkpoint resumed on " + at + " vs the whole checkpoint resumed there");
  }
}

TEST(ZeroShardedCheckpoint, Stage3Of4RanksResumesBitIdenticallyOn1To4RanksAndUnderDdp) {
  expect_bit_identical_resumes(4, 3, {{4, 3}, {3, 3}, {2, 3}, {1, 3}, {2, 0}});
}

TEST(ZeroShardedCheckpoint, Stage1And2Of2RanksResumeBitIdenticallyOn3And1Ranks) {
  expect_bit_identical_resumes(2, 1, {{3, 1}, {1, 1}});
  expect_bit_identical_resumes(2, 2, {{2, 2}, {3, 2}, {1, 0}});
}

// "save memory rank R training_peak P alive_before_save A save_peak S unit U
// parameters_at_save_peak Q training_peak_after_save P2" per rank.
TEST(ZeroShardedCheckpoint, SaveStaysWithinTheTrainingPeakPlusOneUnit) {
  const std::string ckpt = (scratch() / "memory_ckpt").string();
  const JobResult r = run_job(job(4, 3, "memory.txt", "--save-memory --save-at 3 --save " + ckpt), 300);
  ASSERT_EQ(r.status, 0) << r.output;
  int ranks = 0;
  for (size_t at = r.output.find("save memory rank"); at != std::string::npos;
       at = r.output.find("save memory rank", at + 1), ++ranks) {
    std::istringstream is(r.output.substr(at, r.output.find('\n', at) - at));
    std::string w;
    int rank;
    int64_t training_peak, alive, save_peak, unit, parameters, training_peak_after;
    is >> w >> w >> w >> rank >> w >> training_peak >> w >> alive >> w >> save_peak >> w >> unit >>
        w >> parameters >> w >> training_peak_after;
    std::printf("[ zero-ckpt ] rank %d: training peak %lld B, save_state peak %lld B (%lld B alive before it), "
                "one unit %lld B\n",
                rank, (long long)training_peak, (long long)save_peak, (long long)alive, (long long)unit);
    EXPECT_GT(unit, 0);
    EXPECT_LE(save_peak, training_peak + unit) << "rank " << rank;
    // Gathering the model would add every other rank's slices (about 3/4 of the model here).
    EXPECT_LE(save_peak - alive, unit) << "rank " << rank;
    // The save is measured apart: the training steps' peak window is left as it was.
    EXPECT_EQ(training_peak_after, training_peak) << "rank " << rank;
  }
  EXPECT_EQ(ranks, 4) << r.output;
}

// ---- an index that disagrees with its shards is refused before anything loads ----

class DamagedShardedCheckpoint : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    source_ = (scratch() / "damage_source").string();
    const JobResult r = run_job("env OMP_NUM_THREADS=1 " + on_ranks(2) + " --layers 4 --rows 6 --steps 2 --zero-stage 3" +
                                    " --out " + (scratch() / "damage.txt").string() + " --save-at 1 --save " + source_,
                                300);
    ASSERT_EQ(r.status, 0) << r.output;
  }
  // A fresh copy of the checkpoint to damage.
  std::string copy(const std::string& name) {
    const fs::path dir = scratch() / name;
    fs::remove_all(dir);
    fs::copy(source_, dir, fs::copy_options::recursive);
    return dir.string();
  }
  static nlohmann::json index_of(const std::string& dir) {
    return nlohmann::json::parse(tessera::read_file(fs::path(dir) / "model_shards.json"));
  }
  // Rewrites the index and the folder's checksums: an index consistent with checksums.json
  // that disagrees with its shards.
  static void rewrite_index(const std::string& dir, const nlohmann::json& index) {
    tessera::write_file_atomically(fs::path(dir) / "model_shards.json", index.dump(1));
    tessera::write_folder_checksums(dir);
  }
  static std::string refusal(const std::string& dir) {
    try {
      const auto index = tessera::dist::read_sharded_model_index(dir, 0);
      for (const auto& [name, entry] : index.tensors) tessera::dist::read_sharded_range(index, name, 0, entry.numel);
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  }
  static std::string source_;
};
std::string DamagedShardedCheckpoint::source_;

TEST_F(DamagedShardedCheckpoint, MissingShardFileIsRefusedNamingIt) {
  const std::string dir = copy("missing");
  fs::remove(fs::path(dir) / "model_shards/rank_1.safetensors");
  const std::string why = refusal(dir);
  std::printf("[ zero-ckpt ] missing shard: %s\n", why.c_str());
  EXPECT_NE(why.find("model_shards/rank_1.safetensors is missing"), std::string::npos) << why;
}

TEST_F(DamagedShardedCheckpoint, ShardOfAnotherSizeIsRefusedNamingIt) {
  const std::string dir = copy("resized");
  std::ofstream(fs::path(dir) / "model_shards/rank_0.safetensors", std::ios::app) << "extra";
  const std::string why = refusal(dir);
  std::printf("[ zero-ckpt ] wrong size: %s\n", why.c_str());
  EXPECT_NE(why.find("model_shards/rank_0.safetensors has"), std::string::npos) << why;
  EXPECT_NE(why.find("but the index says"), std::string::npos) << why;
}

// Through the check program's Accelerator::load_state: the damaged range's file and tensor.
TEST_F(DamagedShardedCheckpoint, DamagedRangeIsRefusedByLoadStateNamingFileAndTensor) {
  const std::string dir = copy("flipped");
  const auto index = index_of(dir);
  const auto first = index["files"][1]["ranges"].begin();
  const std::string tensor = first.key();
  const nlohmann::json range = first.value();
  const fs::path shard = fs::path(dir) / "model_shards/rank_1.safetensors";
  std::string bytes = tessera::read_file(shard);
  bytes[range["offset"].get<size_t>() + 1] ^= 0x40;
  tessera::write_file_atomically(shard, bytes);
  const JobResult r = run_job("env OMP_NUM_THREADS=1 " + on_ranks(1) + " --layers 4 --rows 12 --steps 2 --zero-stage 0" +
                                  " --out " + (scratch() / "flipped.txt").string() + " --start-step 1 --resume " + dir,
                              120);
  std::printf("[ zero-ckpt ] damaged range: %s", r.output.c_str());
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("rank_1.safetensors"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("'" + tensor + "'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("differ from their checksum"), std::string::npos) << r.output;
}

TEST_F(DamagedShardedCheckpoint, GapAndOverlapInTheRangesAreRefusedNamingTheTensor) {
  for (const int shift : {+1, -1}) {
    const std::string dir = copy(shift > 0 ? "gap" : "overlap");
    auto index = index_of(dir);
    // A range of rank 1 that does not start a tensor, moved by one element.
    std::string tensor;
    for (auto& [name, range] : index["files"][1]["ranges"].items())
      if (range["begin"].get<int64_t>() > 0) {
        tensor = name;
        // Gap: starts one element late (and ends where it did); overlap: one element early.
        range["begin"] = range["begin"].get<int64_t>() + shift;
        if (shift > 0) range["numel"] = range["numel"].get<int64_t>() - shift;
        break;
      }
    ASSERT_FALSE(tensor.empty()) << "no tensor is split between the two ranks";
    rewrite_index(dir, index);
    const std::string why = refusal(dir);
    std::printf("[ zero-ckpt ] %s: %s\n", shift > 0 ? "gap" : "overlap", why.c_str());
    EXPECT_NE(why.find("tensor '" + tensor + "'"), std::string::npos) << why;
    EXPECT_NE(why.find(shift > 0 ? "are in no shard" : "overlapping ranges"), std::string::npos) << why;
    EXPECT_NE(why.find("model_shards/rank_"), std::string::npos) << why;
  }
}

TEST_F(DamagedShardedCheckpoint, IntactCheckpointReadsWhole) {
  EXPECT_EQ(refusal(copy("intact")), "");
}

}  // namespace
