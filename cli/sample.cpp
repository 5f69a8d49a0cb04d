// `tessera sample`: continue a prompt with a trained model (KV-cached decoding).
#include <cmath>
#include <iostream>

#include "tessera/autograd/autograd.h"
#include "tessera/cli/command.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/train/model_dir.h"

namespace tessera::cli {
namespace {

struct SampleArgs {
  std::string model, prompt = "\n", device = "cpu";
  int64_t max_new_tokens = 200, top_k = 0, seed = 1337, num_samples = 1;
  double temperature = 1.0;
};

// Recomputes, in one pass over the last context window, the logits the sampled tokens
// were drawn from. Non-finite logits make meaningless text (a NaN row samples one fixed
// token), so they are an error naming where they appeared, never printed output.
void check_logits_finite(nn::CausalLM& model, const std::vector<int64_t>& tokens, Device device,
                         const std::string& model_dir) {
  autograd::NoGradGuard no_grad;
  const int64_t length = static_cast<int64_t>(tokens.size());
  const int64_t window = std::min(length, model.context_length());
  const std::vector<int64_t> last(tokens.end() - window, tokens.end());
  const Tensor logits = model.forward(from_vector(last, {1, window}, {.dtype = DType::i64, .device = device}));
  const std::vector<float> values = logits.to(Device::cpu(), DType::f32).contiguous().to_vector<float>();
  const int64_t vocab = model.vocab_size();
  for (size_t i = 0; i < values.size(); ++i) {
    if (std::isfinite(values[i])) continue;
    const int64_t position = length - window + static_cast<int64_t>(i) / vocab;
    TESSERA_FAIL("tessera sample: the model's logits are not finite (", values[i], " at position ", position,
                 ", token id ", static_cast<int64_t>(i) % vocab, "): the model in '", model_dir,
                 "' has damaged or diverged weights");
  }
}

void run_sample(const SampleArgs& a) {
  TESSERA_CHECK(a.num_samples >= 1, "tessera sample: --num-samples must be at least 1, got ", a.num_samples);
  TESSERA_CHECK(a.max_new_tokens >= 0, "tessera sample: --max-new-tokens must not be negative, got ", a.max_new_tokens);
  TESSERA_CHECK(std::isfinite(a.temperature), "tessera sample: --temperature must be a finite number, got ",
                a.temperature);
  TESSERA_CHECK(a.temperature >= 0, "tessera sample: --temperature must not be negative, got ", a.temperature);
  TESSERA_CHECK(a.top_k >= 0, "tessera sample: --top-k must not be negative, got ", a.top_k);
  const Device device = Device::parse(a.device);
  auto model = train::load_model(a.model, device);
  model->eval();
  const auto tokenizer = train::find_tokenizer(a.model);
  TESSERA_CHECK(tokenizer != nullptr, "tessera sample: no tokenizer.json in '", a.model,
                "' or its parent folders; copy the one `tessera prepare` wrote");
  TESSERA_CHECK(!a.prompt.empty(), "tessera sample: --prompt must not be empty");
  const std::vector<uint32_t> ids = tokenizer->encode(a.prompt);
  std::vector<int64_t> prompt(ids.begin(), ids.end());
  for (int64_t id : prompt)
    TESSERA_CHECK(id < model->vocab_size(), "tessera sample: the prompt encodes to token ", id,
                  ", outside the model's vocabulary of ", model->vocab_size());
  // The prompt's logits first: the sampler itself refuses NaN probabilities with a message
  // that does not name the model.
  check_logits_finite(*model, prompt, device, a.model);
  Generator gen(static_cast<uint64_t>(a.seed));
  for (int64_t s = 0; s < a.num_samples; ++s) {
    const Tensor out = model->generate(from_vector(prompt, {1, static_cast<int64_t>(prompt.size())}, {.dtype = DType::i64}),
                                       a.max_new_tokens, {.temperature = a.temperature, .top_k = a.top_k, .gen = &gen});
    const std::vector<int64_t> all = out.to_vector<int64_t>();
    check_logits_finite(*model, all, device, a.model);
    std::cout << tokenizer->decode(std::vector<uint32_t>(all.begin(), all.end()));
    if (a.num_samples > 1) std::cout << "\n---";
    std::cout << "\n";
  }
}

const RegisterCommand reg("sample", "Generate text from a model directory", [](CLI::App& sub) {
  auto args = std::make_shared<SampleArgs>();
  sub.add_option("--model", args->model, "model directory (config.json + model.safetensors + tokenizer.json)")->required();
  sub.add_option("--prompt", args->prompt, "text to continue (default: a newline)");
  sub.add_option("--max-new-tokens", args->max_new_tokens, "tokens to generate (default 200)");
  sub.add_option("--temperature", args->temperature, "softmax temperature; 0 = greedy (default 1.0)");
  sub.add_option("--top-k", args->top_k, "sample among the k most likely tokens; 0 = all (default 0)");
  sub.add_option("--seed", args->seed, "sampling seed: same seed, same text (default 1337)");
  sub.add_option("--num-samples", args->num_samples, "independent samples to print (default 1)");
  sub.add_option("--device", args->device, "cpu|cuda|cuda:N (default cpu)");
  sub.callback([args] { run_sample(*args); });
});

}  // namespace
}  // namespace tessera::cli
