// Deferred initialisation: parameters built as shape-only placeholders that remember how
// they would have been filled, so a sharding strategy can fill only the part a rank keeps
// (DeepSpeed's zero.Init, FSDP's meta-device init; dist::Accelerator::sharded_init is the
// user's entry point, docs/distributed.md "Sharded construction").
//
// While a DeferredInitGuard lives on this thread, the parameter factories below
// (init_normal, init_constant: what nn's layers create their parameters with) return a
// placeholder instead of a filled tensor: its shape, dtype and device are real, its storage
// holds 0 bytes, and an InitRecipe records what the eager factory would have computed:
//   - normal/uniform: the Philox draw (seed, first block) the generator reserved for it.
//     The generator advances exactly as the eager call would, so every later draw (the next
//     parameter, dropout) is the same with and without the guard;
//   - constant: the value;
//   - copy: a source tensor (nn::Module::load_state_dict records one for a placeholder, e.g.
//     a memory-mapped safetensors entry: only the pages a rank copies are ever read).
// A recipe also keeps the dtypes the tensor was converted through (Module::to on a
// placeholder changes its dtype and device only), so materialising computes in the dtype
// the eager construction computed in and converts the same way: the same bits.
//
// materialize_deferred_range(t, begin, out) fills `out` with elements [begin, begin + n) of
// t's flattened eager value, computing only those: a Philox draw is a pure function of
// (seed, block), so the slice is generated at its own counters (the at most three elements
// before the first whole block of a draw come from one extra block). Nothing here is tied
// to a strategy: dist/zero.cpp fills each rank's slice, and materialize_deferred() fills a
// whole tensor (a frozen parameter, say).
//
// A placeholder is recognised by its storage: once anything repoints it (a strategy, or
// materialize_deferred), it is an ordinary tensor and its recipe is forgotten. Using one
// before that is refused by nn::Module's calls (check_not_deferred) and by the strategies
// that cannot shard it, naming the parameter.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/core/random.h"
#include "tessera/core/tensor.h"

namespace tessera {

struct InitRecipe {
  enum class Kind : uint8_t { Normal, Uniform, Constant, Copy };
  Kind kind = Kind::Constant;
  double a = 0, b = 0;            // normal: mean, std; uniform: low, high; constant: a
  uint64_t seed = 0, offset = 0;  // normal, uniform: the draw's key and first block
  Tensor source;                  // copy: numel() values in any dtype, on any device
  // The dtype the eager factory produced, then each dtype it was converted to.
  std::vector<DType> dtypes;
};

// Deferral on this thread while one lives (guards nest).
class DeferredInitGuard {
 public:
  DeferredInitGuard();
  ~DeferredInitGuard();
  DeferredInitGuard(const DeferredInitGuard&) = delete;
  DeferredInitGuard& operator=(const DeferredInitGuard&) = delete;
  static bool active();
};

// Parameter factories: filled tensors, or placeholders under the guard.
Tensor init_normal(const Shape& shape, double mean, double stddev, Generator* gen,
                   TensorOptions opts);
Tensor init_constant(const Shape& shape, double value, TensorOptions opts);

// True for a placeholder not yet materialised or repointed.
bool is_deferred(const Tensor& t);
// Whether any placeholder may still be alive in the process (cheap; a false answer is exact).
bool any_deferred();
// The recipe of a placeholder (an error naming `what` for any other tensor).
InitRecipe deferred_recipe(const Tensor& t, const std::string& what = "tensor");
// Replaces a placeholder's recipe (its dtypes are kept when the new one has none).
void set_deferred_recipe(const Tensor& t, InitRecipe recipe);
// A placeholder's future values become `source`'s (load_state_dict into a placeholder).
void set_deferred_source(const Tensor& t, const Tensor& source);
// Module::to on a placeholder: new device and dtype, still no storage.
void retarget_deferred(const Tensor& t, Device device, DType dtype);
// Fills `out` (1-D, contiguous, any dtype and device) with elements [begin, begin +
// out.numel()) of the flattened value t's eager construction would have held.
void materialize_deferred_range(const Tensor& t, int64_t begin, const Tensor& out);
// Gives a placeholder storage of its own holding its whole value (it stops being deferred).
void materialize_deferred(const Tensor& t);
// Drops a placeholder's recipe (the strategy repointed it).
void forget_deferred(const Tensor& t);
// An error naming `name` and `who` when t is a placeholder (used before values are read).
void check_not_deferred(const Tensor& t, const std::string& name, const std::string& who);

// Bytes this process has read from copy recipes' sources since it started (a test hook:
// a sharded load reads only its slices).
uint64_t deferred_bytes_read();

}  // namespace tessera
