// A dry run of real code that allocates what it would allocate and computes nothing, for
// predicting memory (`tessera plan`). While a SizeOnlyMode lives:
//  - CPU storages come from a size-only allocator: addresses in a large reserved, never
//    committed region of virtual memory (reading one yields zeros, no memory is used unless
//    host code writes, as token batches do), so a model far larger than this machine fits;
//  - every CPU kernel entry (core/dispatch.h) and fused entry (kernels/fused_table.h, which
//    hands this mode its CPU row through register_size_only_table) does nothing, so every op
//    still validates shapes and allocates its outputs, as the front-ends do before calling a
//    kernel;
//  - with `fused_routes` the CPU also offers the fused entries a GPU has (flash attention,
//    the fused classifier, multi-tensor AdamW, ...), as no-ops, so the run takes the routes a
//    CUDA device takes and allocates what they allocate (O(T) attention, no score matrices).
//  - kernels that write a single element (fill, copy, unary, binary) do run, so scalars that
//    host code reads back and branches on (the backward's seed gradient, a loss scale) hold
//    what a real run holds, and the run takes the same branches.
// Other values are meaningless in the mode: only sizes (and the per-category counters of
// core/memory_category.h, which it turns on) are. One mode at a time, on one thread; modes
// may follow one another in a process.
#pragma once
#include <type_traits>

#include "tessera/core/tensor.h"

namespace tessera {

class SizeOnlyMode {
 public:
  explicit SizeOnlyMode(bool fused_routes = false);
  ~SizeOnlyMode();
  SizeOnlyMode(const SizeOnlyMode&) = delete;
  SizeOnlyMode& operator=(const SizeOnlyMode&) = delete;
  static bool active();
};

// A table of kernels above core (the fused-op table, kernels/fused_table.h) takes part in the
// mode through these: `silence(fused_routes)` saves its CPU row and makes its entries no-ops
// (offering the GPU's fused routes, as no-ops, when fused_routes is set) when a mode starts;
// `restore()` puts the saved row back when it ends. Registered once, at load time.
void register_size_only_table(void (*silence)(bool fused_routes), void (*restore)());

// Sets a function-pointer entry to a no-op of its own signature: what a silenced table entry
// becomes. A null entry stays null unless even_if_null (a null entry selects the composed
// route, which must stay what it is); a no-op returning a Tensor returns a 0-d f32 zero.
template <class R, class... A>
void make_size_only_noop(R (*&fn)(A...), bool even_if_null = false) {
  if (fn == nullptr && !even_if_null) return;
  fn = [](A...) -> R {
    if constexpr (std::is_same_v<R, Tensor>)
      return zeros({}, {.dtype = DType::f32});
    else if constexpr (!std::is_void_v<R>)
      return R{};
  };
}

class Allocator;
// The CPU allocator's stand-in while set (null: the real one); used by SizeOnlyMode.
void set_cpu_allocator_override(Allocator* allocator);

}  // namespace tessera
