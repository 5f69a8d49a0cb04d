// Helper program for the ZeRO equivalence tests of test_dist: trains a small GPT (tied
// embeddings; n_embd 11 makes every block 1595 and the root 517 elements, so no stage-3
// unit divides evenly by 2 or 3 ranks) with AdamW
// through the Accelerator at a given zero_stage (0 = DDP), with gradient accumulation
// and global-norm clipping, on the sequential data order. The main process writes each
// optimizer step's loss and gradient norm, then the final weights (unwrap_model gathers
// them under stage 3), to --out; --memory makes every rank print its bytes by category.
//
// The rows come from a DataLoader over a token file the main process writes beside --out
// (sequential order: micro-step k of rank r reads rows (k·W + r)·B ...).
//
// --save DIR --save-at K writes the Accelerator's state (ZeRO: sharded optimizer) after
// step K and trains on; --resume DIR --start-step K continues from such a checkpoint through
// Accelerator::load_state, at this run's world size and stage (the optimizer state is
// re-sliced, the loader position re-counted), and trains steps K.. . --save-memory: every
// rank prints its allocator peak of the training steps before the save, the peak while
// save_state runs (a window starting at the bytes alive then), its largest ZeRO unit and the
// training steps' peak after the save (which the save's window leaves as it was).
// --layers N: blocks of the GPT (2). --n-embd N: its width (11; 192 gives MLP weights of
// 147,456 elements, whose slices the host AdamW splits over its threads).
//
// usage: dist_zero_check [--zero-stage N] --out FILE [--rows B] [--accum A] [--steps S]
//                        [--clip C] [--bucket-bytes N] [--backend auto|tcp|mpi]
//                        [--mixed-precision no|bf16] [--reduce-dtype fp32|bf16] [--memory]
//                        [--untied]
//                        [--save DIR --save-at K] [--resume DIR --start-step K]
//                        [--offload none|optimizer|param] [--offload-step-during-backward]
//                        [--prefetch ELEMENTS] [--cuda]
//                        [--sparse-embedding-gradients]
//                        [--zero-accumulation reduce_every_micro_batch|no_sync]
//                        [--max-buckets-in-flight N] [--layers N] [--n-embd N] [--save-memory]
//                        [--hybrid-shard-size S] [--fsdp HYBRID_SHARD|_HYBRID_SHARD_ZERO2|...]
// DDP averages the embedding gradients densely here (the arithmetic ZeRO's stages reproduce
// bit for bit); --sparse-embedding-gradients: all-gathers the looked-up rows instead
// (dist/sparse_embedding.h), which rounds differently.
// --cuda: the model and batches on this rank's GPU (the nccl backend under auto).
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>

#include "tessera/core/memory_category.h"
#include "tessera/core/random.h"
#include "tessera/data/dataloader.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/gpt.h"
#include "tessera/optim/adamw.h"
#include "tests/dist/dump_parameters.h"

using namespace tessera;

namespace {

constexpr int64_t kVocab = 37, kSeq = 8, kTokens = 4001;

// Runs of 17 tokens stepping by 3: learnable from the previous token.
uint32_t token(int64_t i) { return static_cast<uint32_t>(((i % 17) * 3 + (i / 17) % 5) % kVocab); }

std::string write_tokens(const std::string& path) {
  std::vector<uint32_t> tokens(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) tokens[i] = token(i);
  data::write_token_file(path, tokens, kVocab);
  return path;
}

// save_state, which measures itself in a peak window of its own (Accelerator::save_memory(),
// as --memory-report's save rows): the training steps' peak must be the same after it.
void save_reporting_memory(dist::Accelerator& acc, nn::Module& model, const std::string& dir) {
  const DeviceType type = acc.device().type;
  const int64_t training_peak = category_memory_stats(type).peak;
  const int64_t alive = category_memory_stats(type).total_in_use();
  int64_t unit = 0;
  if (auto* zero = dynamic_cast<dist::ZeroStrategy*>(acc.strategy_of(model)))
    for (const auto& bucket : zero->buckets().buckets())
      unit = std::max<int64_t>(
          unit, bucket.padded_numel * static_cast<int64_t>(dtype_size(bucket.dtype)));
  acc.save_state(dir);
  const CategoryMemoryStats during = acc.save_memory().value();
  std::cout << ("save memory rank " + std::to_string(acc.process_index()) + " training_peak " +
                std::to_string(training_peak) + " alive_before_save " + std::to_string(alive) +
                " save_peak " + std::to_string(during.peak) + " unit " + std::to_string(unit) +
                " parameters_at_save_peak " +
                std::to_string(during.at_peak_of(MemoryCategory::Parameters)) +
                " training_peak_after_save " + std::to_string(category_memory_stats(type).peak) +
                "\n")
            << std::flush;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t rows_per_rank = 2, accum = 2, steps = 10, zero_stage = -1, save_at = -1, start_step = 0;
  std::string save_dir, resume_dir;
  double clip = 0.2;           // below every step's gradient norm: clipping always acts
  size_t bucket_bytes = 3000;  // several buckets under stages 0-2
  std::string out_path, backend = "auto", precision = "no";
  bool memory = false, tied = true, on_cuda = false, sparse_embeddings = false, save_memory = false;
  int64_t layers = 2, n_embd = 11;
  std::string offload = "none", reduce_dtype;
  bool step_during_backward = false;
  int64_t prefetch = 0;
  std::string zero_accumulation = "reduce_every_micro_batch";
  size_t max_buckets_in_flight = dist::AcceleratorOptions{}.max_buckets_in_flight;
  int hybrid_shard_size = -1;
  std::string fsdp;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return std::string(argv[++i]); };
    if (a == "--zero-stage")
      zero_stage = std::stoll(next());
    else if (a == "--rows")
      rows_per_rank = std::stoll(next());
    else if (a == "--accum")
      accum = std::stoll(next());
    else if (a == "--steps")
      steps = std::stoll(next());
    else if (a == "--clip")
      clip = std::stod(next());
    else if (a == "--out")
      out_path = next();
    else if (a == "--bucket-bytes")
      bucket_bytes = std::stoull(next());
    else if (a == "--backend")
      backend = next();
    else if (a == "--mixed-precision")
      precision = next();
    else if (a == "--reduce-dtype")
      reduce_dtype = next();
    else if (a == "--memory")
      memory = true;
    else if (a == "--untied")
      tied = false;
    else if (a == "--save")
      save_dir = next();
    else if (a == "--save-at")
      save_at = std::stoll(next());
    else if (a == "--resume")
      resume_dir = next();
    else if (a == "--start-step")
      start_step = std::stoll(next());
    else if (a == "--cuda")
      on_cuda = true;
    else if (a == "--sparse-embedding-gradients")
      sparse_embeddings = true;
    else if (a == "--offload")
      offload = next();
    else if (a == "--offload-step-during-backward")
      step_during_backward = true;
    else if (a == "--prefetch")
      prefetch = std::stoll(next());
    else if (a == "--zero-accumulation")
      zero_accumulation = next();
    else if (a == "--max-buckets-in-flight")
      max_buckets_in_flight = std::stoull(next());
    else if (a == "--layers")
      layers = std::stoll(next());
    else if (a == "--n-embd")
      n_embd = std::stoll(next());
    else if (a == "--save-memory")
      save_memory = true;
    else if (a == "--hybrid-shard-size")
      hybrid_shard_size = std::stoi(next());
    else if (a == "--fsdp")
      fsdp = next();
  }
  if (offload != "none" && offload != "optimizer" && offload != "param") {
    std::cerr << "error: --offload must be none, optimizer or param; got '" << offload << "'\n";
    return 2;
  }
  int rank = -1;
  if (memory || save_memory) enable_memory_categories(true);  // before the model: every storage counted
  try {
    dist::Accelerator acc(
        {.mixed_precision = precision,
         .reduce_dtype = reduce_dtype,
         .gradient_accumulation_steps = static_cast<int>(accum),
         .backend = backend,
         .bucket_bytes = bucket_bytes,
         .sparse_embedding_gradients = sparse_embeddings,
         .cpu = !on_cuda,
         .zero_stage = static_cast<int>(zero_stage),
         .offload_optimizer = offload == "optimizer",
         .offload_param = offload == "param",
         .offload_step_during_backward = step_during_backward,
         .stage3_prefetch_bucket_size = prefetch,
         .zero_accumulation = dist::gradient_accumulation_from_name(zero_accumulation),
         .max_buckets_in_flight = max_buckets_in_flight,
         .fsdp_sharding_strategy = fsdp,
         .hybrid_shard_size = hybrid_shard_size});
    rank = acc.process_index();
    zero_stage = acc.zero_stage();  // without --zero-stage: TESSERA_ZERO_STAGE
    // Different seeds per rank: the strategy must start every rank from rank 0's weights.
    default_generator().manual_seed(77 + rank);
    nn::GPT model(nn::GPTConfig{.vocab_size = kVocab,
                                .block_size = kSeq,
                                .n_layer = layers,
                                .n_head = 1,
                                .n_embd = n_embd,
                                .tie_word_embeddings = tied});
    model.to(acc.device());
    optim::AdamW opt(model.parameters(), {.lr = 2e-2, .weight_decay = 0.1});
    const std::string tokens = out_path + ".tokens.bin";
    if (acc.is_main_process()) write_tokens(tokens);
    acc.wait_for_everyone();
    data::DataLoader loader(data::TokenFile(tokens),
                            {.batch = rows_per_rank, .seq = kSeq, .device = acc.device()});
    acc.prepare(model, opt, loader);
    if (!resume_dir.empty()) acc.load_state(resume_dir);
    if (save_memory) reset_category_peak(acc.device().type);  // the training steps' window

    std::ofstream out;
    if (acc.is_main_process()) out.open(out_path);
    for (int64_t step = start_step; step < steps; ++step) {
      double step_loss = 0, norm = 0;
      for (int64_t a = 0; a < accum; ++a) {
        auto scope = acc.accumulate(model);
        auto [x, y] = loader.next();  // on the accelerator's device
        Tensor loss = model.loss(x, y);
        acc.backward(loss);
        step_loss += acc.reduce(loss.detach().to(DType::f32), "mean").item() / accum;
        if (scope.sync_gradients()) norm = acc.clip_grad_norm_(model.parameters(), clip);
        // At the step's peak: gradients reduced, optimizer state allocated (after step 1).
        if (memory && scope.sync_gradients() && step + 1 == steps) {
          const dist::MemoryUsage m = acc.memory_usage(model);
          const CategoryMemoryStats counted = category_memory_stats(acc.device().type);
          using C = MemoryCategory;
          std::cout << ("memory rank " + std::to_string(rank) + " stage " +
                        std::to_string(zero_stage) + " parameters " + std::to_string(m.parameters) +
                        " gradients " + std::to_string(m.gradients) + " optimizer " +
                        std::to_string(m.optimizer) + " communication " +
                        std::to_string(m.communication) + "\n" + "allocator rank " +
                        std::to_string(rank) + " stage " + std::to_string(zero_stage) +
                        " parameters " + std::to_string(counted.of(C::Parameters)) + " gradients " +
                        std::to_string(counted.of(C::Gradients)) + " optimizer " +
                        std::to_string(counted.of(C::OptimizerState)) + " communication " +
                        std::to_string(counted.of(C::Communication)) + "\n")
                    << std::flush;
          const std::string report = acc.memory_report(model);
          if (!report.empty()) std::cout << report << std::flush;
        }
        opt.step();
        opt.zero_grad();
      }
      if (acc.is_main_process()) {
        char line[96];
        std::snprintf(line, sizeof line, "loss %lld %.9g\nnorm %lld %.9g\n",
                      static_cast<long long>(step), step_loss, static_cast<long long>(step), norm);
        out << line;
      }
      if (step + 1 == save_at && save_memory) {
        save_reporting_memory(acc, model, save_dir);
      } else if (step + 1 == save_at) {
        acc.save_state(save_dir);
      }
    }
    nn::Module& whole = acc.unwrap_model(model);
    if (acc.is_main_process()) dist_check::dump_parameters(whole, out);
    acc.end_training();
  } catch (const std::exception& e) {
    std::cerr << ("rank " + std::to_string(rank) + ": error: " + e.what() + "\n") << std::flush;
    return 1;
  }
  return 0;
}
