// One rank of a classification Trainer job (tests/train/test_classification_ranks.cpp launches
// it on 1, 2 and 3 processes): trains a tiny BERT a few steps with a global batch of 6, then
// writes what evaluate(), predict() and compute_metrics gave to OUT/rank<r>.json. With a ZeRO
// stage and "freeze" (or "train"), the word embeddings are frozen (or not) and the run saves
// OUT/run/checkpoint-3.
//   classify_ranks_check TRAIN.jsonl EVAL.jsonl OUT PER_RANK_BATCH [ZERO_STAGE freeze]
#include <cstdio>
#include <fstream>

#include "tessera/train/trainer.h"
#include "tests/train/classify_fixture.h"

using namespace tessera;
namespace fs = std::filesystem;

int main(int argc, char** argv) {
  if (argc != 5 && argc != 7) {
    std::fprintf(stderr, "usage: classify_ranks_check TRAIN EVAL OUT PER_RANK_BATCH [ZERO_STAGE freeze]\n");
    return 2;
  }
  try {
    const fs::path out = argv[3];
    train::TrainingArguments args;
    args.output_dir = (out / "run").string();
    args.per_device_train_batch_size = std::stoll(argv[4]);
    args.per_device_eval_batch_size = 2;
    args.learning_rate = 5e-3, args.weight_decay = 0, args.lr_scheduler_type = "constant";
    args.max_steps = 3, args.eval_strategy = "no", args.save_strategy = "no", args.report_to = {"none"};
    auto model = test::tiny_bert();
    if (argc == 7) {
      args.zero_stage = std::stoll(argv[5]);
      args.save_strategy = "steps";  // save_steps 0: at the end
      for (auto& [name, p] : model->named_parameters())
        if (name == "bert.embeddings.word_embeddings.weight" && std::string(argv[6]) == "freeze") p.requires_grad_(false);
    }
    std::vector<double> seen_logits;
    std::vector<int64_t> seen_labels;
    auto capture = [&](const train::EvalPrediction& p) {
      seen_logits = p.predictions_f64();
      seen_labels = p.label_ids_vector();
      return train::classification_metrics(p);
    };
    const data::ExampleDataset eval_set = test::load(argv[2]);
    train::Trainer trainer(args, *model, test::load(argv[1]), eval_set, test::padding_collator(), capture);
    trainer.train();
    nlohmann::json result;
    for (const auto& [name, value] : trainer.evaluate())
      if (!name.ends_with("_runtime") && !name.ends_with("_per_second")) result["metrics"][name] = value;
    result["compute_metrics_logits"] = seen_logits;
    result["compute_metrics_labels"] = seen_labels;
    const train::PredictionOutput p = trainer.predict(eval_set);
    result["predictions"] = p.predictions.to(DType::f64).to_vector<double>();
    result["predictions_shape"] = p.predictions.shape();
    result["label_ids"] = p.label_ids.to_vector<int64_t>();
    result["test_accuracy"] = p.metrics.at("test_accuracy");
    const int rank = trainer.accelerator().process_index();
    std::ofstream(out / ("rank" + std::to_string(rank) + ".json")) << result.dump();
    trainer.accelerator().end_training();
    std::printf("rank %d: checks passed\n", rank);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: %s\n", e.what());
    return 1;
  }
}
