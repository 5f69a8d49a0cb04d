// Helper program for the sharded-construction tests (test_shard_init.cpp): builds a small
// GPT or Llama on every rank, eagerly or under Accelerator::sharded_init (ZeRO-3), from its
// constructor or from a model directory, prepares it with AdamW and trains a few steps.
//
// Every rank seeds the default generator differently (1000 + 7·rank): the eager model is
// then rank 0's (the strategy broadcasts its values), and a sharded one must be too (the
// strategy broadcasts rank 0's init recipes), which the run checks by itself:
//   - sharded: each slice this rank keeps (parameter_shards) equals, bit for bit, the same
//     elements of the model built eagerly here with rank 0's seed (or loaded eagerly);
//   - from a directory: the bytes read from model.safetensors are exactly this rank's slices;
//   - --memory: the allocator's peak from before construction to after prepare is at most
//     this rank's shard (parameters, gradients, buffers: memory_usage) plus one unit (its
//     largest flat bucket), the bound the test states; the eager construction's is printed.
// Then the main process writes each step's loss and the final parameters (gathered by
// unwrap_model) to --out, for the test to compare runs line for line.
//
// --heavy-gb X: instead, a GPT of at least X GB of f32 parameters built (--init sharded:
// under sharded_init), prepared at stage 3 and trained 2 AdamW steps, every rank printing its
// peak resident memory (ru_maxrss) and the allocator's peak; with --compare-eager instead of
// training, each slice the rank keeps against the same elements of the model built whole.
//
// usage: dist_shard_init_check --model gpt|llama --init eager|sharded --zero-stage N
//          --out FILE [--pretrained DIR] [--steps S] [--mixed-precision no|bf16] [--memory]
//          [--tied] [--offload-param] [--reference] [--checkpointing] [--hybrid-shard-size S]
// (--reference: the reference blocks instead of the fast ones; --checkpointing: gradient
// checkpointing, each layer's hooks running again for its recompute.)
//        dist_shard_init_check --heavy-gb X [--init eager|sharded]
//        dist_shard_init_check --refuse (one process: the refusals, named)
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include "tessera/core/deferred_init.h"
#include "tessera/core/memory_category.h"
#include "tessera/core/memory_stats.h"
#include "tessera/core/random.h"
#include "tessera/dist/accelerator.h"
#include "tessera/kernels/ops.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"
#include "tessera/optim/adamw.h"
#include "tests/dist/dump_parameters.h"

using namespace tessera;

namespace {

constexpr int64_t kVocab = 53, kSeq = 8, kRows = 2;

struct Args {
  std::string model = "gpt", init = "eager", out, pretrained, precision = "no";
  int stage = 3, steps = 2, hybrid_shard_size = -1;
  bool memory = false, refuse = false, tied = false, offload_param = false, reference = false,
       checkpointing = false;
  double heavy_gb = 0;
  bool compare_eager = false;  // --heavy-gb: the slices against an eager build, no training
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      TESSERA_CHECK(i + 1 < argc, "dist_shard_init_check: ", flag, " needs a value");
      return argv[++i];
    };
    if (flag == "--model")
      a.model = value();
    else if (flag == "--init")
      a.init = value();
    else if (flag == "--zero-stage")
      a.stage = std::stoi(value());
    else if (flag == "--out")
      a.out = value();
    else if (flag == "--pretrained")
      a.pretrained = value();
    else if (flag == "--steps")
      a.steps = std::stoi(value());
    else if (flag == "--mixed-precision")
      a.precision = value();
    else if (flag == "--memory")
      a.memory = true;
    else if (flag == "--tied")
      a.tied = true;
    else if (flag == "--offload-param")
      a.offload_param = true;
    else if (flag == "--reference")
      a.reference = true;
    else if (flag == "--checkpointing")
      a.checkpointing = true;
    else if (flag == "--refuse")
      a.refuse = true;
    else if (flag == "--heavy-gb")
      a.heavy_gb = std::stod(value());
    else if (flag == "--compare-eager")
      a.compare_eager = true;
    else if (flag == "--hybrid-shard-size")
      a.hybrid_shard_size = std::stoi(value());
    else
      TESSERA_FAIL("dist_shard_init_check: unknown flag ", flag);
  }
  return a;
}

// Sizes that shard unevenly on 2 and 3 ranks, an untied head (a root unit of three
// tensors; --tied: two), 2 blocks.
nn::GPTConfig gpt_config(bool memory, bool tied = false) {
  nn::GPTConfig cfg;
  cfg.vocab_size = kVocab;
  cfg.block_size = 16;
  cfg.n_layer = memory ? 4 : 2;
  cfg.n_head = memory ? 4 : 2;
  cfg.n_embd = memory ? 64 : 14;
  cfg.dropout = 0.0;
  cfg.tie_word_embeddings = tied;
  return cfg;
}

nn::LlamaConfig llama_config(bool tied) {
  nn::LlamaConfig cfg;
  cfg.vocab_size = kVocab;
  cfg.hidden_size = 12;
  cfg.intermediate_size = 22;
  cfg.num_hidden_layers = 2;
  cfg.num_attention_heads = 2;
  cfg.num_key_value_heads = 1;
  cfg.max_position_embeddings = 16;
  cfg.tie_word_embeddings = tied;
  return cfg;
}

std::unique_ptr<nn::CausalLM> construct(const Args& a) {
  if (!a.pretrained.empty()) {
    if (a.model == "gpt") return nn::GPT::from_pretrained(a.pretrained);
    return nn::Llama::from_pretrained(a.pretrained);
  }
  if (a.model == "gpt") return std::make_unique<nn::GPT>(gpt_config(a.memory, a.tied));
  return std::make_unique<nn::Llama>(llama_config(a.tied));
}

std::unique_ptr<nn::Module> build(const Args& a) {
  std::unique_ptr<nn::CausalLM> model = construct(a);
  if (a.reference) model->set_block_implementation(nn::BlockImplementation::reference);
  if (a.checkpointing) model->gradient_checkpointing_enable();
  return model;
}

Tensor model_loss(nn::Module& m, const Tensor& x, const Tensor& y) {
  if (auto* gpt = dynamic_cast<nn::GPT*>(&m)) return gpt->loss(x, y);
  return dynamic_cast<nn::Llama&>(m).loss(x, y);
}

int failures = 0;
void expect(bool ok, const std::string& what) {
  if (ok) return;
  ++failures;
  std::cout << "FAILED: " << what << "\n" << std::flush;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  const Tensor x = ops::contiguous(a), y = ops::contiguous(b);
  return x.dtype() == y.dtype() && x.numel() == y.numel() &&
         std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()) == 0;
}

// Every slice this rank keeps against the eager model's same elements; returns the bytes
// those slices hold in the file's dtype (f32).
int64_t check_slices(dist::DataParallelStrategy& strategy, const Args& a, int rank) {
  manual_seed(1000);  // rank 0's seed
  std::unique_ptr<nn::Module> eager = build(a);
  if (a.precision == "bf16") eager->to(DType::bf16);
  std::map<std::string, Tensor> want;
  for (auto& [name, p] : eager->named_parameters())
    want[name] = ops::reshape(p.detach(), {p.numel()});
  int64_t checked = 0, bytes = 0;
  for (const auto& shard : strategy.parameter_shards()) {
    expect(want.count(shard.name) == 1,
           "rank " + std::to_string(rank) + ": no eager parameter " + shard.name);
    if (!want.count(shard.name)) continue;
    const Tensor expected = ops::narrow(want[shard.name], 0, shard.begin, shard.numel);
    expect(same_bits(shard.values, expected),
           "rank " + std::to_string(rank) + ": slice [" + std::to_string(shard.begin) + ", +" +
               std::to_string(shard.numel) + ") of " + shard.name +
               " differs from the eager construction");
    checked += shard.numel;
    bytes += shard.numel * 4;
  }
  std::cout << "rank " << rank << ": " << checked
            << " elements of its slices equal the eager model's\n"
            << std::flush;
  return bytes;
}

int64_t largest_unit_bytes(dist::DataParallelStrategy& strategy) {
  int64_t unit = 0;
  if (auto* zero = dynamic_cast<dist::ZeroStrategy*>(&strategy))
    for (const auto& bucket : zero->buckets().buckets())
      unit = std::max<int64_t>(
          unit, bucket.padded_numel * static_cast<int64_t>(dtype_size(bucket.dtype)));
  return unit;
}

int run_training(const Args& a) {
  dist::Accelerator acc({.mixed_precision = a.precision,
                         .sparse_embedding_gradients = false,
                         .cpu = true,
                         .zero_stage = a.stage,
                         .offload_param = a.offload_param,
                         .hybrid_shard_size = a.hybrid_shard_size});
  const int rank = acc.process_index(), world = acc.num_processes();
  manual_seed(1000 + 7 * static_cast<uint64_t>(rank));
  const uint64_t read_before = deferred_bytes_read();
  reset_host_peak_memory();
  const size_t alive_before = host_memory_stats().in_use;
  std::unique_ptr<nn::Module> model =
      a.init == "sharded" ? acc.sharded_init([&] { return build(a); }) : build(a);
  optim::AdamW opt(model->parameters(), {.lr = 3e-2, .weight_decay = 0.1});
  acc.prepare(*model, opt);
  const int64_t construction_peak = static_cast<int64_t>(host_memory_stats().peak - alive_before);
  const uint64_t read = deferred_bytes_read() - read_before;
  dist::DataParallelStrategy& strategy = *acc.strategy_of(*model);
  if (a.memory) {
    const dist::MemoryUsage m = acc.memory_usage(*model);
    const int64_t shard = m.parameters + m.gradients + m.communication,
                  unit = largest_unit_bytes(strategy);
    int64_t full = 0;
    for (const Tensor& p : model->parameters()) full += p.numel() * 4;
    std::cout << "memory rank " << rank << " init " << a.init << " construction_peak "
              << construction_peak << " shard " << shard << " unit " << unit << " full_model "
              << full << "\n"
              << std::flush;
    if (a.init == "sharded")
      expect(construction_peak <= shard + unit,
             "rank " + std::to_string(rank) + ": construction peak " +
                 std::to_string(construction_peak) + " exceeds shard " + std::to_string(shard) +
                 " + one unit " + std::to_string(unit));
  }
  if (a.init == "sharded") {
    const int64_t slice_bytes = check_slices(strategy, a, rank);
    if (!a.pretrained.empty()) {
      std::cout << "rank " << rank << ": read " << read << " bytes of model.safetensors for "
                << slice_bytes << " bytes of slices\n"
                << std::flush;
      expect(static_cast<int64_t>(read) == slice_bytes,
             "rank " + std::to_string(rank) + " read " + std::to_string(read) +
                 " bytes, its slices hold " + std::to_string(slice_bytes));
    }
  }
  // The same rows whatever the world size: global rows (step·W + rank)·kRows ...
  Generator data(42);
  const Tensor tokens =
      randint(0, kVocab, {a.steps * world * kRows, kSeq + 1}, {.dtype = DType::i64}, &data);
  std::vector<double> losses;
  for (int step = 0; step < a.steps; ++step) {
    const Tensor rows = ops::narrow(tokens, 0, (step * world + rank) * kRows, kRows);
    const Tensor x = ops::contiguous(ops::narrow(rows, 1, 0, kSeq)),
                 y = ops::contiguous(ops::narrow(rows, 1, 1, kSeq));
    auto micro = acc.accumulate(*model);
    const Tensor loss = model_loss(*model, x, y);
    acc.backward(loss);
    opt.step();
    opt.zero_grad();
    losses.push_back(ops::to(loss.detach(), Device::cpu(), DType::f64).to_vector<double>()[0]);
  }
  nn::Module& whole = acc.unwrap_model(*model);
  if (acc.is_main_process() && !a.out.empty()) {
    std::ofstream out(a.out);
    for (double l : losses) {
      char num[40];
      std::snprintf(num, sizeof num, "loss %.17g\n", l);
      out << num;
    }
    dist_check::dump_parameters(whole, out);
  }
  acc.wait_for_everyone();
  std::cout << (failures == 0 ? "shard init checks passed" : "shard init checks FAILED")
            << " (rank " << rank << ")\n"
            << std::flush;
  return failures == 0 ? 0 : 1;
}

// A GPT of at least `gb` GB of f32 parameters, built under sharded_init and prepared; every
// rank prints its peak resident set (ru_maxrss) against the full model's bytes.
int run_heavy(double gb, bool sharded, bool compare_eager) {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  const int64_t rss_at_start = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  // No prefetch and 8 MiB buckets, one in flight: each unit is gathered when it runs, so a
  // step holds the shard's state (16 bytes per element over 8 ranks: half the f32 model) plus
  // about one block's parameters and gradients (12.6 MB at 512 channels; 78 blocks make 1 GB).
  dist::Accelerator acc({.bucket_bytes = size_t(8) << 20,
                         .cpu = true,
                         .zero_stage = 3,
                         .stage3_prefetch_bucket_size = 0,
                         .max_buckets_in_flight = 1});
  nn::GPTConfig cfg;
  cfg.vocab_size = 8192;
  cfg.block_size = 1024;
  cfg.n_embd = 512;
  cfg.n_head = 8;
  cfg.dropout = 0.0;
  const int64_t per_block = 12 * cfg.n_embd * cfg.n_embd + 13 * cfg.n_embd;
  const int64_t root = (cfg.vocab_size + cfg.block_size) * cfg.n_embd + 2 * cfg.n_embd;
  cfg.n_layer = std::max<int64_t>(1, static_cast<int64_t>((gb * 1e9 / 4 - root) / per_block) + 1);
  getrusage(RUSAGE_SELF, &usage);
  const int64_t rss_before = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  enable_memory_categories(true);
  manual_seed(1000);
  auto model = sharded ? acc.sharded_init([&] { return std::make_unique<nn::GPT>(cfg); })
                       : std::make_unique<nn::GPT>(cfg);
  optim::AdamW opt(model->parameters(), {.lr = 1e-4});
  acc.prepare(*model, opt);
  if (compare_eager) {  // every slice this rank keeps against the same elements built whole
    manual_seed(1000);
    const nn::GPT eager(cfg);
    std::map<std::string, Tensor> want;
    for (auto& [name, p] : eager.named_parameters())
      want[name] = ops::reshape(p.detach(), {p.numel()});
    int64_t checked = 0;
    for (const auto& shard : acc.strategy_of(*model)->parameter_shards()) {
      const bool same =
          want.count(shard.name) == 1 &&
          same_bits(shard.values, ops::narrow(want[shard.name], 0, shard.begin, shard.numel));
      expect(same, "rank " + std::to_string(acc.process_index()) + ": slice of " + shard.name +
                       " differs from the eager construction");
      checked += shard.numel;
    }
    std::cout << "heavy compare rank " << acc.process_index() << " layers " << cfg.n_layer
              << " elements " << checked
              << (failures == 0 ? " equal the eager model's bit for bit" : " DIFFER") << "\n"
              << std::flush;
    acc.wait_for_everyone();
    return failures == 0 ? 0 : 1;
  }
  getrusage(RUSAGE_SELF, &usage);
  const int64_t built_rss = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  Generator gen(7);
  std::vector<double> losses;
  for (int step = 0; step < 2; ++step) {
    const Tensor x = randint(0, cfg.vocab_size, {1, 16}, {.dtype = DType::i64}, &gen);
    const Tensor y = randint(0, cfg.vocab_size, {1, 16}, {.dtype = DType::i64}, &gen);
    auto scope = acc.accumulate(*model);
    const Tensor loss = model->loss(x, y);
    acc.backward(loss);
    opt.step();
    opt.zero_grad();
    losses.push_back(loss.item());
  }
  const int64_t allocator_peak = category_memory_stats(DeviceType::CPU).peak;
  getrusage(RUSAGE_SELF, &usage);
  const int64_t peak = static_cast<int64_t>(usage.ru_maxrss) * 1024;
  const int64_t full = model->num_parameters() * 4;
  const dist::MemoryUsage m = acc.memory_usage(*model);
  std::cout << "heavy rank " << acc.process_index() << " init " << (sharded ? "sharded" : "eager")
            << " layers " << cfg.n_layer << " full_model_bytes " << full << " rss_at_start "
            << rss_at_start << " rss_before_construction " << rss_before << " peak_rss " << peak
            << " shard_bytes " << m.parameters + m.gradients << " optimizer_bytes " << m.optimizer
            << " built_rss " << built_rss << " allocator_peak " << allocator_peak << " losses "
            << losses[0] << " " << losses[1] << "\n"
            << std::flush;
  acc.wait_for_everyone();
  return 0;
}

// One process: what is refused, with the message naming why.
int run_refusals() {
  auto refused = [](const std::string& what, const std::function<void()>& body,
                    const std::string& says) {
    try {
      body();
    } catch (const Error& e) {
      const std::string msg = e.what();
      expect(msg.find(says) != std::string::npos, what + ": message lacks '" + says + "': " + msg);
      std::cout << what << ": refused: " << msg.substr(0, 200) << "\n";
      return;
    }
    expect(false, what + " was not refused");
  };
  for (int stage : {0, 1, 2})
    refused(
        "sharded_init at stage " + std::to_string(stage),
        [stage] {
          dist::Accelerator acc({.cpu = true, .zero_stage = stage});
          bool built = false;
          acc.sharded_init([&] {
            built = true;
            return std::make_unique<nn::GPT>(gpt_config(false));
          });
          expect(!built, "the model was built before the refusal");
        },
        "needs ZeRO stage 3");
  // The guard on its own (no Accelerator): the placeholders are refused by name when used.
  refused(
      "a forward of a deferred model without an Accelerator",
      [] {
        std::unique_ptr<nn::GPT> model;
        {
          DeferredInitGuard deferred;
          model = std::make_unique<nn::GPT>(gpt_config(false));
        }
        model->loss(zeros({1, 4}, {.dtype = DType::i64}), zeros({1, 4}, {.dtype = DType::i64}));
      },
      "was built under sharded initialisation");
  // Built under the guard by hand, then prepared at a stage that needs whole parameters.
  for (int stage : {0, 1})
    refused(
        "a deferred model prepared at stage " + std::to_string(stage),
        [stage] {
          dist::Accelerator acc({.cpu = true, .zero_stage = stage});
          std::unique_ptr<nn::GPT> model;
          {
            DeferredInitGuard deferred;
            model = std::make_unique<nn::GPT>(gpt_config(false));
          }
          acc.prepare(*model);
        },
        "only ZeRO stage 3");
  std::cout << (failures == 0 ? "shard init refusals passed" : "shard init refusals FAILED")
            << "\n";
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    if (a.refuse) return run_refusals();
    if (a.heavy_gb > 0) return run_heavy(a.heavy_gb, a.init == "sharded", a.compare_eager);
    return run_training(a);
  } catch (const std::exception& e) {
    std::cout << "FAILED: " << e.what() << "\n" << std::flush;
    return 1;
  }
}
