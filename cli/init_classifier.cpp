// `tessera init-classifier`: a freshly initialised BERT-shaped sequence classifier (seeded),
// saved as a Hugging Face model directory with the tokenizer beside it, to fine-tune with
// `tessera train --task classification --init DIR` (or transformers' from_pretrained).
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "tessera/cli/command.h"
#include "tessera/core/error.h"
#include "tessera/core/random.h"
#include "tessera/data/tokenizer.h"
#include "tessera/nn/bert.h"

namespace tessera::cli {
namespace {

namespace fs = std::filesystem;

struct InitArgs {
  std::string tokenizer, out;
  std::vector<std::string> labels;
  int64_t hidden_size = 128, num_layers = 2, num_heads = 2, intermediate_size = 256, max_positions = 128;
  double dropout = 0.1;
  uint64_t seed = 0;
};

void init_classifier(const InitArgs& a) {
  const auto tokenizer = data::load_tokenizer_from(a.tokenizer);
  TESSERA_CHECK(tokenizer != nullptr, "tessera init-classifier: --tokenizer '", a.tokenizer,
                "' holds no tokenizer (tokenizer.json, vocab.txt)");
  TESSERA_CHECK(a.labels.size() >= 2, "tessera init-classifier: --labels names ", a.labels.size(),
                " class(es); a classifier needs at least 2");
  nn::BertConfig cfg;
  cfg.vocab_size = tokenizer->vocab_size();
  cfg.hidden_size = a.hidden_size;
  cfg.num_hidden_layers = a.num_layers;
  cfg.num_attention_heads = a.num_heads;
  cfg.intermediate_size = a.intermediate_size;
  cfg.max_position_embeddings = a.max_positions;
  cfg.hidden_dropout_prob = cfg.attention_probs_dropout_prob = a.dropout;
  cfg.labels.num_labels = static_cast<int64_t>(a.labels.size());
  cfg.labels.id2label = a.labels;
  cfg.validate();
  Generator gen(a.seed);
  const nn::BertForSequenceClassification model(cfg, &gen);
  fs::create_directories(a.out);
  model.save_pretrained(a.out);
  tokenizer->save_files(a.out);
  std::cout << nlohmann::json{{"out", a.out},
                              {"parameters", model.num_parameters()},
                              {"vocab_size", cfg.vocab_size},
                              {"num_labels", cfg.labels.num_labels}}
                   .dump()
            << "\n";
}

const RegisterCommand reg(
    "init-classifier", "Write a freshly initialised (seeded) BERT-shaped classifier with its tokenizer",
    [](CLI::App& sub) {
      auto a = std::make_shared<InitArgs>();
      sub.add_option("--tokenizer", a->tokenizer, "tokenizer file or folder (vocab.txt, tokenizer.json)")->required();
      sub.add_option("--labels", a->labels, "class names, comma-separated, in id order (id2label)")
          ->delimiter(',')
          ->required();
      sub.add_option("--hidden-size", a->hidden_size, "hidden_size (default 128)");
      sub.add_option("--num-layers", a->num_layers, "num_hidden_layers (default 2)");
      sub.add_option("--num-heads", a->num_heads, "num_attention_heads (default 2)");
      sub.add_option("--intermediate-size", a->intermediate_size, "intermediate_size (default 256)");
      sub.add_option("--max-positions", a->max_positions, "max_position_embeddings (default 128)");
      sub.add_option("--dropout", a->dropout,
                     "hidden_dropout_prob and attention_probs_dropout_prob (default 0.1, BERT's)");
      sub.add_option("--seed", a->seed, "seed of the initialisation (default 0)");
      sub.add_option("--out", a->out, "model directory to write")->required();
      sub.callback([a] { init_classifier(*a); });
    });

}  // namespace
}  // namespace tessera::cli
