// The classification Trainer on 2 and 3 processes (TCP, through `tessera launch`) gives the
// metrics and predictions of one process, on an evaluation set of 13 examples (divisible by
// neither): every example scored once, in dataset order, nothing duplicated or dropped.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "tests/dist/run_job.h"
#include "tessera/core/safetensors.h"
#include "tests/train/classify_fixture.h"

namespace fs = std::filesystem;
using tessera::test_jobs::run_job;

namespace {

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  return nlohmann::json::parse(in);
}

void expect_near_all(const nlohmann::json& got, const nlohmann::json& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(got[i].get<double>(), want[i].get<double>(), tol) << what << " [" << i << "]";
}

// Runs classify_ranks_check on `world` processes (one: directly; more: `tessera launch`, TCP)
// with a global batch of 6; `extra` is its optional ZeRO stage and "freeze". Its output folder.
fs::path run_world(const fs::path& dir, const fs::path& train, const fs::path& eval, int world,
                   const std::string& extra) {
  const fs::path out = dir / ("world" + std::to_string(world) + (extra.empty() ? "" : "_" + extra.substr(0, 1)));
  fs::remove_all(out);
  fs::create_directories(out);
  const std::string program = std::string(CLASSIFY_RANKS_CHECK) + " " + train.string() + " " + eval.string() +
                              " " + out.string() + " " + std::to_string(6 / world) + " " + extra;
  const std::string command =
      world == 1 ? program
                 : "env HF_HOME=" + (dir / "hf").string() + " " + TESSERA_CLI + " launch --nproc-per-node " +
                       std::to_string(world) + " " + program;
  const auto r = run_job(command, 240);
  EXPECT_EQ(r.status, 0) << r.output;
  return out;
}

}  // namespace

TEST(ClassificationRanks, TwoAndThreeProcessesGiveOneProcesssMetricsAndPredictions) {
  const fs::path dir = tessera::test_jobs::fresh_scratch_folder("tessera_classify_ranks");
  const fs::path train = tessera::test::write_rows(dir / "train.jsonl", 18, 21);
  const fs::path eval = tessera::test::write_rows(dir / "eval.jsonl", 13, 22);
  auto job = [&](int world) { return run_world(dir, train, eval, world, ""); };
  const nlohmann::json one = read_json(job(1) / "rank0.json");
  ASSERT_EQ(one["predictions_shape"], nlohmann::json::array({13, tessera::test::kClasses}));
  ASSERT_EQ(one["label_ids"].size(), 13u);
  for (const int world : {2, 3}) {
    const fs::path out = job(world);
    for (int rank = 0; rank < world; ++rank) {
      const std::string tag = "world " + std::to_string(world) + " rank " + std::to_string(rank);
      ASSERT_TRUE(fs::exists(out / ("rank" + std::to_string(rank) + ".json"))) << tag;
      const nlohmann::json got = read_json(out / ("rank" + std::to_string(rank) + ".json"));
      EXPECT_EQ(got["predictions_shape"], one["predictions_shape"]) << tag;
      EXPECT_EQ(got["label_ids"], one["label_ids"]) << tag;
      EXPECT_EQ(got["compute_metrics_labels"], one["label_ids"]) << tag;
      // DDP averages the same examples' gradients in another order: float rounding only.
      expect_near_all(got["predictions"], one["predictions"], 2e-5, tag + " predictions");
      expect_near_all(got["compute_metrics_logits"], one["predictions"], 2e-5, tag + " compute_metrics");
      ASSERT_EQ(got["metrics"].size(), one["metrics"].size()) << tag;
      for (const auto& [name, value] : one["metrics"].items())
        EXPECT_NEAR(got["metrics"][name].get<double>(), value.get<double>(), 2e-5) << tag << " " << name;
    }
  }
}

// A frozen word embedding (requires_grad false) under DDP and every ZeRO stage on 2 processes:
// bit-identical to its initialisation after the steps, and the rest of the model equals the
// one-process run's.
TEST(ClassificationRanks, AFrozenEmbeddingStaysBitIdenticalUnderDdpAndEveryZeroStage) {
  const fs::path dir = tessera::test_jobs::fresh_scratch_folder("tessera_classify_frozen");
  const fs::path train = tessera::test::write_rows(dir / "train.jsonl", 18, 23);
  const fs::path eval = tessera::test::write_rows(dir / "eval.jsonl", 5, 24);
  const std::string frozen = "bert.embeddings.word_embeddings.weight";
  const auto initial_model = tessera::test::tiny_bert();
  const auto initial = initial_model->state_dict();
  const tessera::Tensor& start = std::find_if(initial.begin(), initial.end(), [&](const auto& kv) {
                                   return kv.first == frozen;
                                 })->second;
  auto weights = [](const fs::path& out) {
    return tessera::load_safetensors((out / "run" / "checkpoint-3" / "model.safetensors").string());
  };
  const auto one = weights(run_world(dir, train, eval, 1, "0 freeze"));
  ASSERT_TRUE(one.contains(frozen));
  EXPECT_EQ(one.at(frozen).to_vector<float>(), start.to_vector<float>());
  for (const int stage : {0, 1, 2, 3}) {
    const std::string tag = "stage " + std::to_string(stage);
    const auto two = weights(run_world(dir, train, eval, 2, std::to_string(stage) + " freeze"));
    ASSERT_EQ(two.tensors.size(), one.tensors.size()) << tag;
    EXPECT_EQ(two.at(frozen).to_vector<float>(), start.to_vector<float>()) << tag << ": the frozen tensor moved";
    bool trained_something = false;
    for (const auto& [name, t] : one.tensors) {
      const std::vector<float> want = t.to_vector<float>(), got = two.at(name).to_vector<float>();
      ASSERT_EQ(got.size(), want.size()) << tag << " " << name;
      for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(got[i], want[i], 2e-5) << tag << " " << name << "[" << i << "]";
      if (name != frozen) {
        const auto init = std::find_if(initial.begin(), initial.end(), [&](const auto& kv) { return kv.first == name; });
        trained_something = trained_something || init->second.to_vector<float>() != want;
      }
    }
    EXPECT_TRUE(trained_something) << tag;
  }
}
