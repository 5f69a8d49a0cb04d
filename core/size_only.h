// A dry run of real code that allocates what it would allocate and computes nothing, for
// predicting memory (`tessera plan`). While a SizeOnlyMode lives:
//  - CPU storages come from a size-only allocator: addresses in a large reserved, never
//    committed region of virtual memory (reading one yields zeros, no memory is used unless
//    host code writes, as token batches do), so a model far larger than this machine fits;
//  - every CPU kernel entry (core/dispatch.h) and fused entry (core/fused_dispatch.h) does
//    nothing, so every op still validates shapes and allocates its outputs, as the
//    front-ends do before calling a kernel;
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

namespace tessera {

class SizeOnlyMode {
 public:
  explicit SizeOnlyMode(bool fused_routes = false);
  ~SizeOnlyMode();
  SizeOnlyMode(const SizeOnlyMode&) = delete;
  SizeOnlyMode& operator=(const SizeOnlyMode&) = delete;
  static bool active();
};

class Allocator;
// The CPU allocator's stand-in while set (null: the real one); used by SizeOnlyMode.
void set_cpu_allocator_override(Allocator* allocator);

}  // namespace tessera
