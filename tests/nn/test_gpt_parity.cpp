// Tessera's GPT against an independent PyTorch implementation (tests/nn/reference_gpt.py):
// same weights (exchanged as HF-layout safetensors both ways), same tokens; logits, loss,
// every gradient, and the parameters after 10 AdamW steps with clipping and a schedule.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "python_reference.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/safetensors.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"

using namespace tessera;

namespace {

bool torch_available() { return test::python_can_import("torch, numpy"); }

std::filesystem::path scratch_dir(const std::string& name) {
  auto dir = std::filesystem::path(TESSERA_BINARY_DIR) / "test_scratch" / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

nn::GPTConfig parity_config(bool tied) {
  return nn::GPTConfig{.vocab_size = 101,
                       .block_size = 40,
                       .n_layer = 3,
                       .n_head = 3,
                       .n_embd = 48,
                       .tie_word_embeddings = tied};
}

// The learning-rate recipe both sides follow (see reference_gpt.py's defaults).
constexpr double kLr = 1e-3, kWeightDecay = 0.1, kMaxNorm = 0.5, kMinLrRatio = 0.1;
constexpr int kSteps = 10, kWarmup = 3;

// Tessera on `device` (fp32) against the PyTorch reference (on the CPU).
void run_parity(bool tied, Device device = Device::cpu()) {
  if (!torch_available()) GTEST_SKIP() << test::python_interpreter() << " cannot import torch";
  const std::string tag = std::string(tied ? "tied" : "untied") + (device.is_cuda() ? "_cuda" : "");
  const auto dir = scratch_dir("gpt_parity_" + tag);
  Generator gen(1234);
  nn::GPT model(parity_config(tied), &gen);
  // Non-zero biases and LayerNorm parameters so their paths are really checked.
  for (auto& [name, p] : model.named_parameters())
    if (p.dim() == 1) normal_(p, name.find("ln") != std::string::npos ? 1.0 : 0.0, 0.1, &gen);
  model.save_pretrained((dir / "model").string());

  const int64_t B = 4, T = 40;
  Tensor idx = randint(0, 101, {B, T}, {.dtype = DType::i64}, &gen);
  Tensor targets = randint(0, 101, {B, T}, {.dtype = DType::i64}, &gen);
  save_safetensors((dir / "batch.safetensors").string(), {{"idx", idx}, {"targets", targets}});

  const std::string cmd =
      test::python_interpreter() + " " TESSERA_SOURCE_DIR "/tests/nn/reference_gpt.py" +
      std::string(" --model ") + (dir / "model").string() + " --batch " +
      (dir / "batch.safetensors").string() + " --out " + (dir / "ref.safetensors").string() +
      " --weights-out " + (dir / "torch_weights.safetensors").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << "reference failed: " << cmd;
  SafetensorsContents ref = load_safetensors((dir / "ref.safetensors").string());
  // The comparisons run where Tessera computed.
  for (auto& [name, t] : ref.tensors) t = ops::to(t, device, t.dtype());
  model.to(device);
  idx = ops::to(idx, device, idx.dtype());
  targets = ops::to(targets, device, targets.dtype());

  // Forward, loss and gradients.
  Tensor logits = model.forward(idx);
  EXPECT_LT(ops::max_rel_error(logits, ref.at("logits")), 1e-5);
  Tensor loss = model.loss(idx, targets);
  EXPECT_LT(std::abs(loss.item() - ref.at("loss").item()) / std::abs(ref.at("loss").item()), 1e-5);
  loss.backward();
  const auto params = model.named_parameters();
  size_t ref_grads = 0;
  for (const auto& [name, t] : ref.tensors) ref_grads += name.rfind("grad/", 0) == 0;
  ASSERT_EQ(params.size(), ref_grads) << "the reference saw a different parameter set";
  double worst_grad = 0;
  for (const auto& [name, p] : params) {
    ASSERT_TRUE(p.grad().defined()) << name;
    const double err = ops::max_rel_error(p.grad(), ref.at("grad/" + name));
    worst_grad = std::max(worst_grad, err);
    EXPECT_LT(err, 1e-4) << name;
  }

  // Ten optimizer steps from the same starting point.
  optim::AdamW opt(
      model.parameters(),
      {.lr = kLr, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = kWeightDecay});
  optim::CosineSchedule sched(opt,
                              {.warmup = kWarmup, .total = kSteps, .min_lr = kMinLrRatio * kLr});
  const std::vector<double> ref_norms = ref.at("grad_norms").to_vector<double>();
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    model.loss(idx, targets).backward();
    const double norm = optim::clip_grad_norm_(model.parameters(), kMaxNorm);
    EXPECT_NEAR(norm, ref_norms[step], 1e-4 * ref_norms[step]) << "step " << step;
    opt.step();
    sched.step();
  }
  double worst_param = 0;
  for (const auto& [name, p] : params) {
    const double err = ops::max_rel_error(p, ref.at("param/" + name));
    worst_param = std::max(worst_param, err);
    EXPECT_LT(err, 1e-4) << name;
  }
  std::printf(
      "parity (%s): logits %.2e, loss %.2e, worst grad %.2e, worst param after %d steps %.2e\n",
      tag.c_str(), ops::max_rel_error(logits, ref.at("logits")),
      std::abs(loss.item() - ref.at("loss").item()) / std::abs(ref.at("loss").item()), worst_grad,
      kSteps, worst_param);

  // A file written by the PyTorch side loads into a fresh model with the trained values.
  nn::GPT reloaded(parity_config(tied), nullptr, {.device = device});
  reloaded.load_safetensors_weights((dir / "torch_weights.safetensors").string());
  for (const auto& [name, p] : reloaded.named_parameters())
    EXPECT_EQ(ops::max_rel_error(p, ref.at("param/" + name)), 0.0) << name;
}

}  // namespace

TEST(GPTParity, MatchesPyTorchTiedEmbeddings) { run_parity(true); }
TEST(GPTParity, MatchesPyTorchUntiedHead) { run_parity(false); }
// The CUDA path (fp32: cuBLAS without TF32, the composed attention) against the same reference.
TEST(GPTParity, MatchesPyTorchOnCuda) {
  if (!cuda_is_available()) GTEST_SKIP() << "no CUDA device";
  run_parity(false, Device::cuda(0));
}
