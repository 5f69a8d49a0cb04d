// Model directories move between Tessera and Hugging Face `transformers`
// (tests/nn/hf_gpt2_check.py): transformers loads what Tessera saves and gives the
// same logits; Tessera loads what transformers saves and gives the same logits.
// Skips where the interpreter has no transformers (the development machines).
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>

#include "tessera/autograd/functions.h"
#include "tessera/core/safetensors.h"
#include "tessera/nn/nn.h"
#include "python_reference.h"

using namespace tessera;

TEST(HuggingFaceInterop, GPT2DirectoriesRoundTrip) {
  if (!test::python_can_import("transformers, torch, numpy"))
    GTEST_SKIP() << test::python_interpreter() << " cannot import transformers";
  const auto dir = std::filesystem::path(TESSERA_BINARY_DIR) / "test_scratch" / "hf_interop";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  Generator gen(77);
  nn::GPTConfig cfg{.vocab_size = 101, .block_size = 40, .n_layer = 3, .n_head = 3, .n_embd = 48};
  nn::GPT model(cfg, &gen);
  for (auto& [name, p] : model.named_parameters())
    if (p.dim() == 1) normal_(p, name.find("ln") != std::string::npos ? 1.0 : 0.0, 0.1, &gen);
  model.save_pretrained((dir / "tessera").string());
  Tensor idx = randint(0, 101, {2, 40}, {.dtype = DType::i64}, &gen);
  save_safetensors((dir / "batch.safetensors").string(), {{"idx", idx}});
  const std::string cmd = test::python_interpreter() + " " TESSERA_SOURCE_DIR "/tests/nn/hf_gpt2_check.py --tessera-dir " +
                          (dir / "tessera").string() + " --hf-dir " + (dir / "hf").string() +
                          " --batch " + (dir / "batch.safetensors").string() + " --out " +
                          (dir / "out.safetensors").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto out = load_safetensors((dir / "out.safetensors").string());
  NoGradGuard no_grad;
  EXPECT_LT(ops::max_rel_error(model.forward(idx), out.at("logits")), 1e-5);
  auto loaded = nn::GPT::from_pretrained((dir / "hf").string());
  EXPECT_LT(ops::max_rel_error(loaded->forward(idx), out.at("hf_logits")), 1e-5);
}
