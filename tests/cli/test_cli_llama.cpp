// `tessera train --arch llama` end to end on the CPU: a tiny grouped-query Llama trains,
// resumes bit for bit from a checkpoint, evaluates, samples (KV cache, past the context
// too), and its exported model directory (Hugging Face LlamaForCausalLM layout) loads in
// `transformers` with the same logits, tied and untied.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "tessera/core/random.h"
#include "tessera/core/safetensors.h"
#include "tessera/kernels/ops.h"
#include "tessera/nn/llama.h"
#include "tests/cli/cli_harness.h"
#include "tests/nn/python_reference.h"

namespace fs = std::filesystem;
using namespace tessera_cli_test;

namespace {

// 4 query heads share 2 key/value heads; head size 8; rotary base 500; context 16.
const std::string kTinyLlama =
    " --arch llama --n-layer 2 --n-head 4 --n-kv-head 2 --n-embd 32 --intermediate-size 48"
    " --rope-theta 500 --seq 16 --batch 4 ";

std::vector<nlohmann::json> metrics_of(const fs::path& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir / "metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

nlohmann::json json_file(const fs::path& path) { return nlohmann::json::parse(slurp(path)); }

// Logits of `model_dir` from transformers' LlamaForCausalLM against Tessera's on one batch;
// false when transformers is not usable (the caller skips that part).
bool transformers_logits_match(const fs::path& model_dir, const std::string& label) {
  using namespace tessera;
  const fs::path work = model_dir.parent_path() / ("hf_check_" + label);
  fs::create_directories(work);
  Generator gen(3);
  const Tensor idx = randint(0, 250, {2, 16}, {.dtype = DType::i64}, &gen);
  const std::string batch = (work / "batch.safetensors").string();
  save_safetensors(batch, {{"idx", idx}, {"targets", idx}});
  const std::string ref = (work / "ref.safetensors").string();
  const std::string cmd = test::python_interpreter() + " " + TESSERA_SOURCE_DIR +
                          "/tests/nn/hf_llama_check.py --model " + model_dir.string() +
                          " --batch " + batch + " --out " + ref + " --steps 0";
  const int status = std::system(cmd.c_str());
  if (WIFEXITED(status) && WEXITSTATUS(status) == 3) return false;
  EXPECT_EQ(status, 0) << cmd;
  if (status != 0) return true;
  auto model = nn::Llama::from_pretrained(model_dir.string());
  const double err = ops::max_rel_error(model->forward(idx), load_safetensors(ref).at("logits"));
  std::printf("%s: transformers' logits vs Tessera's, max rel error %.3e\n", label.c_str(), err);
  EXPECT_LT(err, 1e-5) << label << ": max rel error " << err;
  return true;
}

TEST(CliLlama, TrainResumeEvalSampleAndLoadInTransformers) {
  const fs::path data = prepared("byte");
  const std::string common = "train --data " + (data / "train.bin").string() + kTinyLlama +
                             " --no-tie-word-embeddings --grad-accum 2 --warmup 2 --lr 3e-3"
                             " --eval-every 5 --eval-batches 2 --save-every 5 --steps 10";
  const fs::path straight = scratch() / "llama_straight";
  auto r = run(common + " --out " + straight.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("Llama: 2 layers, 4 heads (2 key/value)"), std::string::npos) << r.output;

  // The checkpoint and the export are Hugging Face LlamaForCausalLM directories.
  for (const fs::path& dir : {straight / "checkpoint-5", straight / "model"}) {
    const auto config = json_file(dir / "config.json");
    EXPECT_EQ(config["model_type"], "llama") << dir;
    EXPECT_EQ(config["num_key_value_heads"], 2) << dir;
    EXPECT_EQ(config["rope_theta"], 500.0) << dir;
    EXPECT_EQ(config["rope_parameters"]["rope_theta"], 500.0) << dir;
    EXPECT_EQ(config["tie_word_embeddings"], false) << dir;
    const auto weights = tessera::load_safetensors((dir / "model.safetensors").string());
    EXPECT_EQ(weights.at("model.layers.1.self_attn.k_proj.weight").shape(),
              (tessera::Shape{16, 32}));
    EXPECT_EQ(weights.at("model.layers.0.mlp.gate_proj.weight").shape(), (tessera::Shape{48, 32}));
    EXPECT_TRUE(weights.contains("lm_head.weight")) << dir;
  }

  // Resumed from checkpoint-5 in a fresh process and run folder: the same losses and weights.
  const fs::path resumed = scratch() / "llama_resumed";
  r = run(common + " --out " + resumed.string() + " --resume " +
          (straight / "checkpoint-5").string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
  auto after_5 = [](const fs::path& dir) {
    std::vector<std::string> lines;
    for (const auto& j : metrics_of(dir))
      if (j["step"].get<int64_t>() > 5)
        lines.push_back(j.contains("loss") ? j["loss"].dump() + "/" + j["grad_norm"].dump()
                                           : "val " + j["eval_loss"].dump());
    return lines;
  };
  ASSERT_EQ(after_5(straight).size(), 5u + 1u);  // steps 6..10 and the evaluation at 10
  EXPECT_EQ(after_5(straight), after_5(resumed));
  EXPECT_EQ(slurp(straight / "model" / "model.safetensors"),
            slurp(resumed / "model" / "model.safetensors"));

  // eval scores the trainer's last evaluation batches with the same loss.
  double last_val = 0;
  for (const auto& j : metrics_of(straight))
    if (j.contains("eval_loss")) last_val = j["eval_loss"];
  const fs::path val = fs::exists(data / "val.bin") ? data / "val.bin" : data / "train.bin";
  r = run("eval --model " + (straight / "model").string() + " --data " + val.string() +
          " --batch 4 --seq 16 --batches 2");
  ASSERT_EQ(r.rc, 0) << r.output;
  const auto eval = nlohmann::json::parse(r.output);
  EXPECT_EQ(eval["tokens"].get<int64_t>(), 4 * 16 * 2);
  EXPECT_NEAR(eval["loss"].get<double>(), last_val, 1e-6) << r.output;

  // Sampling: reproducible per seed, and 40 new tokens run past the 16-position context.
  const std::string sample =
      "sample --model " + (straight / "model").string() + " --prompt 'The ' --max-new-tokens 40 ";
  const auto s1 = run(sample + "--seed 1"), s2 = run(sample + "--seed 1"),
             s3 = run(sample + "--seed 2");
  ASSERT_EQ(s1.rc, 0) << s1.output;
  EXPECT_EQ(s1.output.rfind("The ", 0), 0u) << s1.output;
  EXPECT_GT(s1.output.size(), 20u);
  EXPECT_EQ(s1.output, s2.output);
  EXPECT_NE(s1.output, s3.output);

  // A tied model: no lm_head.weight in the files, and transformers reads both.
  const fs::path tied = scratch() / "llama_tied";
  r = run("train --data " + (data / "train.bin").string() + kTinyLlama +
          " --tie-word-embeddings --steps 3 --out " + tied.string());
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(json_file(tied / "model" / "config.json")["tie_word_embeddings"], true);
  EXPECT_FALSE(tessera::load_safetensors((tied / "model" / "model.safetensors").string())
                   .contains("lm_head.weight"));
  if (!transformers_logits_match(straight / "model", "untied") ||
      !transformers_logits_match(tied / "model", "tied"))
    GTEST_SKIP() << tessera::test::python_interpreter()
                 << " has no usable transformers LlamaForCausalLM; the rest passed";
}

TEST(CliLlama, LlamaSettingsAreCheckedBeforeTraining) {
  const fs::path data = prepared("byte");
  const std::string train =
      "train --data " + (data / "train.bin").string() +
      " --n-layer 1 --n-head 4 --n-embd 32 --seq 16 --batch 4 --steps 2 --out " +
      (scratch() / "llama_bad").string();
  const struct {
    std::string flags, needle;
  } cases[] = {
      {" --arch llama --n-kv-head 3", "n_kv_head"},
      {" --n-kv-head 2", "is a Llama setting; add --arch llama"},
      {" --rope-theta 500", "is a Llama setting"},
      {" --arch llama --rope-theta 0", "rope_theta"},
      {" --arch llama --dropout 0.1", "must be 0 for Llama"},
      {" --arch falcon", "must be gpt2 or llama"},
      {" --arch llama --n-head 32", "even head size"},
  };
  for (const auto& c : cases) {
    const auto r = run(train + c.flags);
    EXPECT_NE(r.rc, 0) << c.flags << "\n" << r.output;
    EXPECT_NE(r.output.find(c.needle), std::string::npos) << c.flags << "\n" << r.output;
  }
  // Resuming may not change the architecture's shape either.
  const fs::path run_dir = scratch() / "llama_shape";
  ASSERT_EQ(run("train --data " + (data / "train.bin").string() + kTinyLlama +
                " --steps 2 --save-every 2 --out " + run_dir.string())
                .rc,
            0);
  const auto r = run("train --resume " + run_dir.string() + " --n-kv-head 4 --steps 4");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("n_kv_head"), std::string::npos) << r.output;
}

}  // namespace
