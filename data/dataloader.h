// DataLoader: micro-batches (x, y) of token windows from a TokenFile.
//
// Sequential mode is the data-order contract (docs/architecture.md, "Data order") (llm.c's order): micro-batch k
// of rank r in a world of W reads tokens [(k·W + r)·B·T, … + B·T + 1); row b of x is
// tokens [start + b·T, start + b·T + T) and y is the same shifted by one. Token positions
// wrap modulo the file length, so W ranks × B rows see exactly what one process with
// W·B rows sees.
//
// Shuffled mode cuts the file into M = (n - 1) / T windows of T + 1 tokens (window i starts
// at i·T) and visits them in a fresh random order each epoch; global row g (= (k·W + r)·B + b,
// the same numbering as above) is window perm_{g / M}[g % M]. The permutation of epoch e is a
// Fisher-Yates shuffle driven by Philox(seed, block e·2^32 + ...), so it is reproducible per
// seed and needs no state beyond the micro-batch counter.
//
// Random mode is nanoGPT's get_batch: every row starts at an offset drawn uniformly from
// [0, n - T - 1], so the row and its shifted target never wrap. The draw of global row g is
// Philox(seed, block 2^63 + g) alone; since g = k·(W·B) + (r·B + b) names the micro-batch
// step k and the row's place in the world's batch, the rows are the same at any world size
// (and with accumulation), and a resumed loader needs only its position to continue.
// Different windows every step keep a model from memorising a small corpus.
//
// x and y are [B, T] tensors of `dtype` (i64 by default, as PyTorch's embedding expects).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"
#include "tessera/data/token_file.h"

namespace tessera::data {

enum class Sampling {
  windows,  // consecutive windows (sequential, or shuffled when `shuffle` is set)
  random,   // random-offset windows (nanoGPT's get_batch)
};
// "windows" | "random"; anything else is an error naming the value.
Sampling parse_sampling(const std::string& name);
const char* sampling_name(Sampling sampling);

struct DataLoaderOptions {
  int64_t batch = 8;  // B: rows per micro-batch on this rank
  int64_t seq = 64;   // T: tokens per row
  int rank = 0;
  int world_size = 1;
  Sampling sampling = Sampling::windows;
  bool shuffle = false;  // windows sampling only
  uint64_t seed = 0;     // shuffled windows and random sampling
  DType dtype = DType::i64;
  Device device = Device::cpu();
  // Iteration (`for (auto& [x, y] : loader)`) stops once position() reaches this many
  // micro-batches; 0 = never. The bound is on the position, not on the loop, so a loop
  // started after a resume takes only the batches that remain.
  int64_t max_batches = 0;
};

struct Batch {
  Tensor x, y;
};

class DataLoader {
 public:
  DataLoader(TokenFile file, DataLoaderOptions options);

  // Micro-batch number position(), then advances the position by one.
  Batch next();
  // Micro-batch k of this rank, without touching the position.
  Batch batch_at(uint64_t k) const;
  // First token position of each row of micro-batch k (before wrapping modulo size()).
  std::vector<int64_t> row_starts(uint64_t k) const;

  // The position is the number of micro-batches this rank has taken: the whole state
  // to save with a checkpoint and restore on resume.
  uint64_t position() const { return position_; }
  // Refuses a position past max_position() (error names both).
  void set_position(uint64_t k);
  // The largest position whose token offsets fit in 64 bits (far past any real run; a
  // position restored from a file is checked against it).
  uint64_t max_position() const;
  // Accelerate's skip_first_batches: the first n micro-batches of this rank's stream count
  // as done, so the next one taken (and the first of a loop) is micro-batch n. A library
  // loop that restores its step count from a checkpoint calls this (Accelerator::load_state
  // restores the position itself).
  DataLoader& skip_first_batches(uint64_t n) {
    set_position(n);
    return *this;
  }

  const DataLoaderOptions& options() const { return options_; }
  const TokenFile& file() const { return file_; }
  // Tokens one micro-batch step of the whole world consumes: W·B·T.
  int64_t tokens_per_step() const { return options_.world_size * options_.batch * options_.seq; }

  // Iteration: begin() takes the next micro-batch; the loop ends when the position reaches
  // max_batches (never when max_batches is 0).
  class Iterator {
   public:
    Iterator(DataLoader* loader, int64_t remaining);
    Batch& operator*() { return current_; }
    Batch* operator->() { return &current_; }
    Iterator& operator++();
    bool operator==(std::default_sentinel_t) const { return remaining_ == 0; }

   private:
    DataLoader* loader_;
    int64_t remaining_;  // < 0: endless
    Batch current_;
  };
  Iterator begin();
  std::default_sentinel_t end() { return {}; }

 private:
  const std::vector<int64_t>& epoch_permutation(uint64_t epoch) const;
  int64_t random_start(uint64_t global_row) const;

  TokenFile file_;
  DataLoaderOptions options_;
  uint64_t position_ = 0;
  int64_t windows_ = 0;  // M, shuffled mode
  mutable uint64_t cached_epoch_ = UINT64_MAX;
  mutable std::vector<int64_t> cached_permutation_;
};

}  // namespace tessera::data
