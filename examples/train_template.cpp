// The portable training template: the same program runs as one process, under
// `tessera launch --nproc-per-node N`, under mpirun or under SLURM.
//
//   example_train_template [--data train.bin] [--steps 40] [--accum 2] [--batch 4]
//                          [--seq 32] [--out checkpoints]
//
// Gradient accumulation, per-rank seeding, logging on the main process only and a
// checkpoint (Accelerator::save_state) at the end of every epoch. Without --data a
// small synthetic token file is written first, so the template runs anywhere.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "tessera/core/random.h"
#include "tessera/data/dataloader.h"
#include "tessera/data/token_file.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/gpt.h"
#include "tessera/optim/adamw.h"
#include "tessera/optim/schedule.h"

using namespace tessera;

int main(int argc, char** argv) {
  std::string data_path, out_dir = "checkpoints";
  int64_t steps = 40, accum = 2, batch = 4, seq = 32;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--data") data_path = value;
    else if (flag == "--steps") steps = std::stoll(value);
    else if (flag == "--accum") accum = std::stoll(value);
    else if (flag == "--batch") batch = std::stoll(value);
    else if (flag == "--seq") seq = std::stoll(value);
    else if (flag == "--out") out_dir = value;
  }

  dist::Accelerator acc({.gradient_accumulation_steps = static_cast<int>(accum)});
  if (data_path.empty()) {
    // A repeating pattern a small model can learn; the main process writes it, all wait.
    data_path = (std::filesystem::temp_directory_path() / "tessera_template_tokens.bin").string();
    if (acc.is_main_process()) {
      std::vector<uint32_t> tokens(20000);
      for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = (i * 7 + i / 5) % 64;
      data::write_token_file(data_path, tokens, 256);
    }
    acc.wait_for_everyone();
  }

  // Same weights everywhere come from DDP's broadcast; the per-rank seed is for whatever
  // each rank draws on its own (dropout).
  default_generator().manual_seed(42 + acc.process_index());
  nn::GPT model(nn::GPTConfig{.vocab_size = 256, .block_size = seq, .n_layer = 2, .n_head = 4,
                              .n_embd = 64},
                nullptr, {.device = acc.device()});
  optim::AdamW opt(model.parameters(), {.lr = 3e-3, .weight_decay = 0.1});
  data::DataLoader loader(data::TokenFile(data_path),
                          {.batch = batch, .seq = seq, .device = acc.device(),
                           .max_batches = steps * accum});
  optim::CosineSchedule sched(opt, {.warmup = std::min<int64_t>(5, steps / 2), .total = steps});
  acc.prepare(model, opt, loader, sched);

  // An epoch: the optimizer steps that read the whole file once.
  const int64_t tokens_per_step = loader.tokens_per_step() * accum;
  const int64_t steps_per_epoch =
      std::max<int64_t>(1, loader.file().size() / tokens_per_step);
  int64_t step = 0;
  double step_loss = 0;
  for (auto& [x, y] : loader) {
    auto micro = acc.accumulate(model);
    Tensor loss = model.loss(x, y);
    acc.backward(loss);
    step_loss += loss.item() / accum;
    // As this template writes it: on accumulating micro-steps the prepared
    // optimizer and schedule skip these calls (and clipping returns 0).
    double norm = acc.clip_grad_norm_(model.parameters(), 1.0);
    opt.step();
    sched.step();
    opt.zero_grad();
    if (!micro.sync_gradients()) continue;
    // Logged loss: this rank's share; the mean over ranks costs one small all_reduce.
    double mean_loss = acc.reduce(full({1}, step_loss, {.dtype = DType::f64}), "mean").item();
    if (step % 5 == 0) acc.print("step ", step, "  loss ", mean_loss, "  grad_norm ", norm, "  lr ", opt.lr());
    step_loss = 0;
    if (++step % steps_per_epoch == 0) {
      acc.save_state(out_dir + "/epoch_" + std::to_string(step / steps_per_epoch));
      acc.print("saved ", out_dir, "/epoch_", step / steps_per_epoch);
    }
  }
  acc.wait_for_everyone();
  acc.save_state(out_dir + "/last");
  acc.print("done: ", step, " optimizer steps on ", acc.num_processes(), " process(es)");
  acc.end_training();
  return 0;
}
