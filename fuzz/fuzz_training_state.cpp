// libFuzzer target: the checkpoint-state readers, as `tessera train --resume` uses them:
// Accelerator::load_state (model.safetensors, optimizer.safetensors and
// accelerator_state.json, checked against the prepared model, optimizer, schedule and
// loader) and TrainerState::from_json (trainer_state.json). A tiny GPT is trained two steps
// and saved once; each input then replaces one of those files in a copy of that
// checkpoint, with checksums.json rewritten to match (so the input reaches the contents
// checks past the checksum gate, as a file with correct checksums but wrong contents
// would). A state that loads is trained on for one step, so a wrong shape or dtype that
// slipped through is caught where it is used. Bad contents must be a tessera::Error.
#include <filesystem>
#include <memory>
#include <string>

#include "fuzz/fuzz_input.h"
#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/data/dataloader.h"
#include "tessera/data/token_file.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/gpt.h"
#include "tessera/optim/optim.h"
#include "tessera/train/callbacks.h"
#include "tessera/train/checkpoint_files.h"

namespace fs = std::filesystem;
using namespace tessera;

namespace {

// The objects a resume loads into, prepared once, and the checkpoint they saved.
struct Run {
  fs::path saved;
  std::unique_ptr<data::TokenFile> tokens;
  std::unique_ptr<nn::GPT> model;
  std::unique_ptr<optim::AdamW> optimizer;
  std::unique_ptr<optim::LRSchedule> schedule;
  std::unique_ptr<data::DataLoader> loader;
  std::unique_ptr<dist::Accelerator> acc;

  void step() {
    const data::Batch b = loader->next();
    acc->backward(model->loss(b.x, b.y));
    optimizer->step();
    schedule->step();
    optimizer->zero_grad();
  }
};

Run& run() {
  static Run r = [] {
    Run r;
    const fs::path dir = fuzz::scratch_dir() / "run";
    fs::create_directories(dir);
    std::vector<uint32_t> tokens(512);
    for (size_t i = 0; i < tokens.size(); ++i)
      tokens[i] = static_cast<uint32_t>((i * 7 + i / 5) % 13);
    data::write_token_file(dir / "tokens.bin", tokens);
    r.tokens = std::make_unique<data::TokenFile>(dir / "tokens.bin");
    nn::GPTConfig g;
    g.vocab_size = 13, g.block_size = 4, g.n_layer = 1, g.n_head = 2, g.n_embd = 4;
    Generator gen(3);
    r.model = std::make_unique<nn::GPT>(g, &gen);
    r.optimizer = std::make_unique<optim::AdamW>(r.model->parameters(), optim::AdamWOptions{});
    r.schedule = std::make_unique<optim::LRSchedule>(
        *r.optimizer, optim::DecayShape::Cosine, optim::ScheduleOptions{.warmup = 1, .total = 10});
    r.loader = std::make_unique<data::DataLoader>(*r.tokens,
                                                  data::DataLoaderOptions{.batch = 2, .seq = 4});
    r.acc = std::make_unique<dist::Accelerator>(dist::AcceleratorOptions{.cpu = true});
    r.acc->prepare(*r.model, *r.optimizer, *r.schedule, *r.loader);
    r.step();
    r.step();
    r.saved = dir / "checkpoint-2";
    r.acc->save_state(r.saved.string());
    train::TrainerState state;
    state.global_step = 2, state.max_steps = 10, state.schedule_total = 10;
    state.log_history.push_back({{"step", 1}, {"loss", 2.5}, {"lr", 1e-3}});
    state.log_history.push_back({{"step", 2}, {"val_loss", 2.4}});
    state.best_metric = 2.4, state.best_step = 2, state.best_model_checkpoint = "checkpoint-2";
    tessera::write_file_atomically(r.saved / "trainer_state.json", state.to_text());
    tessera::write_folder_checksums(r.saved);
    return r;
  }();
  return r;
}

// A copy of the saved checkpoint with `file` replaced by the input and checksums to match.
fs::path checkpoint_with(const std::string& file, const uint8_t* data, size_t size) {
  const fs::path dir = fuzz::scratch_dir() / "checkpoint";
  fs::remove_all(dir);
  fs::copy(run().saved, dir);
  const fs::path input = fuzz::write_input(file, data, size);
  fs::rename(input, dir / file);
  tessera::write_folder_checksums(dir);
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Run& r = run();
  for (const char* file :
       {"optimizer.safetensors", "accelerator_state.json", "model.safetensors"}) {
    const fs::path dir = checkpoint_with(file, data, size);
    fuzz::expect_clean_error([&] {
      r.acc->load_state(dir.string());
      r.step();
    });
  }
  const fs::path dir = checkpoint_with(train::kTrainerStateFile, data, size);
  fuzz::expect_clean_error([&] {
    // As the Trainer reads it on resume: malformed JSON is an error naming the file.
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(tessera::read_file(dir / train::kTrainerStateFile));
    } catch (const nlohmann::json::exception& e) {
      TESSERA_FAIL(train::kTrainerStateFile, " is not valid JSON: ", e.what());
    }
    (void)train::TrainerState::from_json(j, train::kTrainerStateFile).to_text();
  });
  return 0;
}
