// Helper program for the sparse embedding-gradient tests of test_dist (run as 2- and 3-rank
// jobs): DDP with sparse embedding gradients against the same DDP with them off (the dense
// path), on small GPTs with tied and untied heads, f32, random tokens with repeated ids given
// as a non-contiguous view. Checks, on every rank:
//   - sparse path taken: the embedding weight's averaged gradient equals the dense path's
//     within 1e-6 (relative to its largest element) and is bitwise the same on every rank;
//     every other gradient is bitwise the dense path's; the weight's bucket was launched
//     before the lookup's backward ran, and its rows all-gathered before the last bucket;
//   - dense path taken, results bitwise the dense path's, for: world·N >= 2·V, mismatched N
//     across ranks (and from then on), a no_sync micro-step (its final gradient after the
//     synced one within 1e-6 of the dense path's), eval mode; ZeRO 1-3 install no sink.
// --model-first runs one check alone: a model prepared under DDP by an Accelerator, trained a
// step on the sparse path, then destroyed before the Accelerator (whose DDP and sparse sync go
// after it: they must not reach into the gone modules).
// Prints "sparse embedding checks passed" per rank, or FAILED lines.
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/dist/accelerator.h"
#include "tessera/dist/ddp.h"
#include "tessera/dist/zero.h"
#include "tessera/kernels/ops.h"
#include "tessera/nn/gpt.h"

using namespace tessera;

namespace {

int failures = 0;
int rank_ = 0;

void check(bool ok, const std::string& what) {
  if (ok) return;
  ++failures;
  std::cerr << ("rank " + std::to_string(rank_) + ": FAILED " + what + "\n") << std::flush;
}

constexpr int64_t kVocab = 97, kSeq = 8;

nn::GPTConfig gpt_config(bool tied, int64_t vocab = kVocab) {
  return {.vocab_size = vocab,
          .block_size = kSeq,
          .n_layer = 2,
          .n_head = 1,
          .n_embd = 11,
          .tie_word_embeddings = tied};
}

std::unique_ptr<nn::GPT> make_gpt(bool tied, int64_t vocab = kVocab) {
  Generator gen(2024);  // the same weights on every rank and for both paths
  return std::make_unique<nn::GPT>(gpt_config(tied, vocab), &gen);
}

// A model in pages of its own, unmapped when it goes: any later use of it (its modules
// included: the token embedding is a member) faults at once, where a read of freed heap memory
// would often go unnoticed.
struct UnmapOnDelete {
  size_t bytes = 0;
  void operator()(nn::GPT* model) const {
    model->~GPT();
    munmap(model, bytes);
  }
};
std::unique_ptr<nn::GPT, UnmapOnDelete> make_gpt_in_own_pages(bool tied) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t bytes = (sizeof(nn::GPT) + page - 1) / page * page;
  void* pages = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (pages == MAP_FAILED) throw std::runtime_error("mmap of the model's pages failed");
  Generator gen(2024);
  return {new (pages) nn::GPT(gpt_config(tied), &gen), UnmapOnDelete{bytes}};
}

// [rows, kSeq] token ids (and next-token targets) of this rank and `step`, mostly from a few
// ids so that rows repeat, as a column slice of a wider tensor (not contiguous).
std::pair<Tensor, Tensor> batch(int64_t rows, int64_t vocab, int step) {
  Generator gen(100 + 17 * rank_ + step);
  const Tensor few = randint(0, 6, {rows, kSeq + 3}, {.dtype = DType::i64}, &gen);
  const Tensor any = randint(0, vocab, {rows, kSeq + 3}, {.dtype = DType::i64}, &gen);
  const Tensor pick = randint(0, 3, {rows, kSeq + 3}, {.dtype = DType::i64}, &gen);
  std::vector<int64_t> ids = few.to_vector<int64_t>(), wide = any.to_vector<int64_t>(),
                       choose = pick.to_vector<int64_t>();
  for (size_t i = 0; i < ids.size(); ++i)
    if (choose[i] == 0) ids[i] = wide[i];
  const Tensor all = from_vector(ids, {rows, kSeq + 3}, {.dtype = DType::i64});
  return {all.narrow(1, 1, kSeq), all.narrow(1, 2, kSeq)};
}

std::map<std::string, std::vector<float>> gradients(const nn::Module& model) {
  std::map<std::string, std::vector<float>> out;
  for (auto& [name, p] : model.named_parameters())
    out[name] = p.grad().defined() ? ops::to(p.grad(), Device::cpu(), DType::f32).to_vector<float>()
                                   : std::vector<float>(p.numel(), 0.0f);
  return out;
}

double relative_difference(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, std::fabs(double(got[i]) - want[i]));
    scale = std::max(scale, std::fabs(double(want[i])));
  }
  return diff / scale;
}

// Every rank's copy of `values` is the same, bit for bit.
bool same_on_every_rank(dist::ProcessGroup& group, const std::vector<float>& values) {
  const int64_t n = static_cast<int64_t>(values.size());
  const Tensor mine = from_vector(values, {n});
  Tensor all = empty({group.size() * n});
  group.all_gather(all, mine)->wait();
  const std::vector<float> got = all.to_vector<float>();
  for (int r = 0; r < group.size(); ++r)
    if (std::memcmp(got.data() + r * n, values.data(), n * sizeof(float)) != 0) return false;
  return true;
}

// One DDP run: `micro_rows` holds the rows of each micro-step (all but the last under no_sync).
struct Run {
  std::map<std::string, std::vector<float>> grads;
  dist::SparseEmbeddingSync::Stats stats;
  size_t solo_buckets = 0;
};
Run run_ddp(bool tied, bool sparse, const std::vector<int64_t>& micro_rows,
            int64_t vocab = kVocab) {
  auto model = make_gpt(tied, vocab);
  dist::DistributedDataParallel ddp(*model, nullptr,
                                    {.bucket_bytes = 2000, .sparse_embedding_gradients = sparse});
  for (size_t k = 0; k < micro_rows.size(); ++k) {
    std::optional<dist::DataParallelStrategy::NoSyncGuard> no_sync;
    if (k + 1 < micro_rows.size()) no_sync.emplace(ddp.no_sync());
    auto [x, y] = batch(micro_rows[k], vocab, static_cast<int>(k));
    ddp.backward(model->loss(x, y));
  }
  Run r{gradients(*model), ddp.sparse_embedding_stats(), 0};
  for (const auto& b : ddp.buckets()) r.solo_buckets += b.solo;
  return r;
}

// The sparse run's gradients against the dense run's: the embedding weight within 1e-6 and the
// same on every rank, everything else bit for bit.
void compare(const Run& sparse, const Run& dense, const std::string& what) {
  for (auto& [name, want] : dense.grads) {
    const std::vector<float>& got = sparse.grads.at(name);
    if (name == "transformer.wte.weight") {
      const double d = relative_difference(got, want);
      check(d <= 1e-6, what + ": " + name + " differs from the dense path by " + std::to_string(d));
      check(same_on_every_rank(dist::world(), got), what + ": " + name + " differs between ranks");
    } else {
      check(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0,
            what + ": " + name + " is not bitwise the dense path's");
    }
  }
}

void check_sparse_path(bool tied) {
  const std::string what = tied ? "tied" : "untied";
  const Run sparse = run_ddp(tied, true, {2}), dense = run_ddp(tied, false, {2});
  compare(sparse, dense, what);
  check(sparse.stats.sparse_lookups == 1, what + ": the lookup did not go sparse");
  check(sparse.stats.launched_before_lookup_backward == 1,
        what + ": the weight's bucket was not launched before the lookup's backward");
  check(sparse.stats.gathered_before_last_bucket == 1,
        what + ": the lookup's rows were not all-gathered ahead of the last bucket");
  // wte and wpe (whose N = T gives world·N >= 2·T: dense) have buckets of their own.
  check(sparse.solo_buckets == 2 && dense.solo_buckets == 0, what + ": solo buckets");
  check(dense.stats.sparse_lookups == 0, what + ": dense run went sparse");
}

void check_dense_paths(bool tied) {
  const std::string what = tied ? "tied" : "untied";
  // world·N >= 2·V: 13 rows of 8 per rank against a vocabulary of 97.
  {
    const Run sparse = run_ddp(tied, true, {13}), dense = run_ddp(tied, false, {13});
    check(sparse.stats.sparse_lookups == 0 && sparse.stats.dense_lookups == 2,
          what + ": world*N >= 2V went sparse");
    compare(sparse, dense, what + " world*N >= 2V");
  }
  // Gradient accumulation: the no_sync micro-step scatters locally, the synced one goes sparse.
  {
    const Run sparse = run_ddp(tied, true, {2, 2}), dense = run_ddp(tied, false, {2, 2});
    check(sparse.stats.sparse_lookups == 1, what + ": accumulation: synced micro-step not sparse");
    compare(sparse, dense, what + " accumulation");
  }
  // Mismatched N (rank r has 1 + r rows): dense, and dense from then on for every size.
  {
    auto model = make_gpt(tied);
    auto reference = make_gpt(tied);
    dist::DistributedDataParallel ddp(*model, nullptr, {.bucket_bytes = 2000});
    dist::DistributedDataParallel plain(
        *reference, nullptr, {.bucket_bytes = 2000, .sparse_embedding_gradients = false});
    for (int step = 0; step < 2; ++step) {
      const int64_t rows = step == 0 ? 1 + rank_ : 2;
      auto [x, y] = batch(rows, kVocab, step);
      ddp.backward(model->loss(x, y));
      plain.backward(reference->loss(x, y));
      const auto got = gradients(*model), want = gradients(*reference);
      for (auto& [name, w] : want)
        check(std::memcmp(got.at(name).data(), w.data(), w.size() * sizeof(float)) == 0,
              what + ": mismatched N step " + std::to_string(step) + ": " + name);
    }
    check(ddp.sparse_embedding_stats().sparse_lookups == 0, what + ": mismatched N went sparse");
  }
  // Eval mode (whose forward may run on one rank alone): dense.
  {
    auto model = make_gpt(tied);
    dist::DistributedDataParallel ddp(*model, nullptr, {.bucket_bytes = 2000});
    model->eval();
    auto [x, y] = batch(2, kVocab, 0);
    ddp.backward(model->loss(x, y));
    check(ddp.sparse_embedding_stats().sparse_lookups == 0, what + ": eval mode went sparse");
  }
}

void check_sinks_installed_and_removed() {
  auto model = make_gpt(true);
  {
    dist::DistributedDataParallel ddp(*model);
    check(model->transformer.wte.grad_sink != nullptr, "DDP installed no sink on wte");
  }
  // The sink DDP left is detached: it accepts no lookup (the ordinary backward runs).
  const auto& left = model->transformer.wte.grad_sink;
  check(left == nullptr ||
            !left->accepts(model->transformer.wte.weight, zeros({3}, {.dtype = DType::i64})),
        "DDP left a sink on wte that still accepts lookups");
  for (int stage = 1; stage <= 3; ++stage) {
    auto zero_model = make_gpt(true);
    dist::ZeroStrategy zero(*zero_model, dist::world_ptr(), {.stage = stage, .bucket_bytes = 2000});
    check(zero_model->transformer.wte.grad_sink == nullptr,
          "ZeRO stage " + std::to_string(stage) + " installed a sink");
  }
}

// The model goes before its Accelerator: the Accelerator's DDP (and its sparse sync) are
// destroyed after the modules they were built on.
void check_model_destroyed_before_its_accelerator() {
  dist::Accelerator acc({.cpu = true});
  {
    auto model = make_gpt_in_own_pages(true);
    acc.prepare(*model);
    auto [x, y] = batch(2, kVocab, 0);
    {
      dist::AccumulateScope scope = acc.accumulate(*model);
      acc.backward(model->loss(x, y));
    }
    check(acc.ddp_of(*model)->sparse_embedding_stats().sparse_lookups > 0,
          "the prepared model's lookups did not take the sparse path");
  }  // the model is gone (its pages unmapped); its DDP is not
}

}  // namespace

int main(int argc, char** argv) {
  const bool model_first = argc > 1 && std::strcmp(argv[1], "--model-first") == 0;
  try {
    dist::init_process_group({.backend = "tcp"});
    rank_ = dist::world().rank();
    if (model_first) {
      check_model_destroyed_before_its_accelerator();
      dist::destroy_process_group();
      if (failures > 0) return 1;
      std::cout << ("rank " + std::to_string(rank_) + ": model destroyed first, no crash\n")
                << std::flush;
      return 0;
    }
    for (bool tied : {true, false}) {
      check_sparse_path(tied);
      check_dense_paths(tied);
    }
    check_sinks_installed_and_removed();
    dist::destroy_process_group();
  } catch (const std::exception& e) {
    std::cerr << ("rank " + std::to_string(rank_) + ": FAILED error: " + e.what() + "\n")
              << std::flush;
    return 1;
  }
  if (failures > 0) return 1;
  std::cout << ("rank " + std::to_string(rank_) + ": sparse embedding checks passed\n")
            << std::flush;
  return 0;
}
