// `tessera eval`: mean loss of a model directory on a token file, as one JSON line. Under
// `tessera launch` every process scores its share of the batches (same result as one).
#include <cmath>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tessera/cli/classification.h"
#include "tessera/cli/command.h"
#include "tessera/core/error.h"
#include "tessera/dist/env.h"
#include "tessera/train/evaluate.h"
#include "tessera/train/model_dir.h"

namespace tessera::cli {
namespace {

struct EvalArgs {
  std::string model, data, device = "cpu", dtype = "fp32";
  int64_t batch = 8, seq = 0, batches = 0;
  // --seq and --batches have defaults computed from the model and the file; a value
  // given by the user must be valid (0 or -2 is an error, not "use the default").
  bool seq_given = false, batches_given = false;
};

void check_numbers(const EvalArgs& a) {
  TESSERA_CHECK(a.batch > 0, "tessera eval: --batch must be positive, got ", a.batch);
  TESSERA_CHECK(!a.seq_given || a.seq > 0, "tessera eval: --seq must be positive, got ", a.seq);
  TESSERA_CHECK(!a.batches_given || a.batches > 0, "tessera eval: --batches must be positive, got ", a.batches);
}

void run_eval(const EvalArgs& a) {
  check_numbers(a);
  std::optional<dist::Accelerator> acc;
  Device device = Device::parse(a.device);
  if (dist::read_dist_env().world_size > 1) {
    acc.emplace(dist::AcceleratorOptions{.cpu = device.is_cpu()});
    if (device.is_cuda()) device = acc->device();  // one GPU per local rank
  }
  auto model = train::load_model(a.model, device);
  // Scored with the weights (and so the arithmetic) in the dtype asked for: fp32 is the
  // stored model, bf16/fp16 what a forward with low-precision parameters computes.
  model->to(dtype_from_name(a.dtype));
  const data::TokenFile file(a.data);
  TESSERA_CHECK(file.max_token() < model->vocab_size(), "tessera eval: '", a.data, "' holds token ",
                file.max_token(), " but the model's vocab_size is ", model->vocab_size());
  const int64_t seq = a.seq_given ? a.seq : std::min<int64_t>(model->context_length(), 256);
  TESSERA_CHECK(a.batch <= (INT64_MAX - 1) / seq, "tessera eval: --batch ", a.batch, " x --seq ", seq,
                " tokens overflows a 64-bit count");
  // Each token is scored once: the batches the file holds, never a tiling that repeats it.
  const int64_t in_file = (file.size() - 1) / (a.batch * seq);
  TESSERA_CHECK(in_file >= 1, "tessera eval: '", a.data, "' holds ", file.size(),
                " tokens, fewer than one micro-batch of --batch ", a.batch, " x --seq ", seq,
                " + 1 = ", a.batch * seq + 1, "; use a smaller --batch or --seq");
  if (a.batches_given && a.batches > in_file && (!acc || acc->is_main_process()))
    std::cerr << "tessera eval: note: --batches " << a.batches << " but '" << a.data << "' holds "
              << file.size() << " tokens, " << in_file << " micro-batch(es) of " << a.batch << " x "
              << seq << "; scoring those " << in_file << " (each token once)\n";
  const int64_t batches = a.batches_given ? std::min(a.batches, in_file) : in_file;
  const train::EvalTotals r =
      train::evaluate_tokens(*model, file, a.batch, seq, batches, device, acc ? &*acc : nullptr);
  // NaN would print as null with exit status 0: a damaged or diverged model is an error.
  TESSERA_CHECK(std::isfinite(r.loss()), "tessera eval: the mean loss over ", r.tokens, " tokens of '", a.data,
                "' is ", r.loss(), " (not finite): the model in '", a.model,
                "' gives non-finite logits (damaged or diverged weights)");
  const auto metrics = train::language_model_metrics(r);
  if (!acc || acc->is_main_process())
    std::cout << nlohmann::json{{"loss", r.loss()}, {"tokens", r.tokens}, {"perplexity", metrics.at("perplexity")},
                                {"token_accuracy", metrics.at("accuracy")}}.dump()
              << "\n";
  if (acc) acc->end_training();
}

const RegisterCommand reg("eval", "Print a model's loss and metrics on a token file or labelled examples as JSON", [](CLI::App& sub) {
  auto args = std::make_shared<EvalArgs>();
  auto task = std::make_shared<std::string>("causal_lm");
  auto classify = std::make_shared<ClassifyRunArgs>();
  sub.add_option("--task", *task,
                 "causal_lm (a token file: loss, perplexity) | classification (a JSONL/CSV/TSV file of "
                 "labelled texts: eval_loss, eval_accuracy, eval_f1, ...) (default causal_lm)");
  sub.add_option("--model", args->model, "model directory (config.json + model.safetensors)")->required();
  sub.add_option("--data", args->data, "token file, or labelled examples for classification")->required();
  CLI::Option* batch = sub.add_option("--batch", args->batch, "rows per micro-batch (default 8; classification 32)");
  add_column_options(sub, classify->columns, /*with_labels=*/true);
  CLI::Option* seq = sub.add_option("--seq", args->seq, "tokens per row (default: min(context, 256))");
  CLI::Option* batches =
      sub.add_option("--batches", args->batches, "micro-batches to score (default: one pass over the file)");
  sub.add_option("--device", args->device, "cpu|cuda|cuda:N (default cpu)");
  sub.add_option("--dtype", args->dtype, "weights and compute dtype (default fp32)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  sub.callback([args, seq, batches, task, classify, batch] {
    if (parse_task(*task, "tessera eval") == Task::Classification) {
      classify->model = args->model;
      classify->data = args->data;
      classify->device = args->device;
      if (batch->count() > 0) classify->batch = args->batch;
      run_classification_eval(*classify);
      return;
    }
    args->seq_given = seq->count() > 0;
    args->batches_given = batches->count() > 0;
    run_eval(*args);
  });
});

}  // namespace
}  // namespace tessera::cli
