// `tessera eval`: mean loss of a model directory on a token file, as one JSON line.
#include <iostream>
#include <nlohmann/json.hpp>

#include "tessera/cli/command.h"
#include "tessera/cli/model_dir.h"
#include "tessera/core/error.h"

namespace tessera::cli {
namespace {

struct EvalArgs {
  std::string model, data, device = "cpu";
  int64_t batch = 8, seq = 0, batches = 0;
};

void run_eval(const EvalArgs& a) {
  const Device device = Device::parse(a.device);
  auto model = load_model(a.model, device);
  const data::TokenFile file(a.data);
  TESSERA_CHECK(file.max_token() < model->config().vocab_size, "tessera eval: '", a.data, "' holds token ",
                file.max_token(), " but the model's vocab_size is ", model->config().vocab_size);
  const int64_t seq = a.seq > 0 ? a.seq : std::min<int64_t>(model->config().block_size, 256);
  TESSERA_CHECK(a.batch > 0, "tessera eval: --batch must be positive, got ", a.batch);
  // Default: one pass over the file (at least one micro-batch).
  const int64_t batches = a.batches > 0 ? a.batches : std::max<int64_t>(1, (file.size() - 1) / (a.batch * seq));
  const EvalResult r = evaluate_loss(*model, file, a.batch, seq, batches, device);
  std::cout << nlohmann::json{{"loss", r.loss}, {"tokens", r.tokens}}.dump() << "\n";
}

const RegisterCommand reg("eval", "Print a model's mean loss on a token file as JSON", [](CLI::App& sub) {
  auto args = std::make_shared<EvalArgs>();
  sub.add_option("--model", args->model, "model directory (config.json + model.safetensors)")->required();
  sub.add_option("--data", args->data, "token file to score")->required();
  sub.add_option("--batch", args->batch, "rows per micro-batch (default 8)");
  sub.add_option("--seq", args->seq, "tokens per row (default: min(context, 256))");
  sub.add_option("--batches", args->batches, "micro-batches to score (default: one pass over the file)");
  sub.add_option("--device", args->device, "cpu|cuda|cuda:N (default cpu)");
  sub.callback([args] { run_eval(*args); });
});

}  // namespace
}  // namespace tessera::cli
