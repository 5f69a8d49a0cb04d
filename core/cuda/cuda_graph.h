// CUDA graphs behind core's GraphBackend (core/graph_capture.h), internal to core/cuda.
//
// A capture runs on a stream of its own, made current for the thread while it lasts and
// ordered after the work queued before it on the stream that was current; allocations go
// to a private pool of the caching allocator (caching_allocator.h). Host-to-device copies
// made during the capture (small tables, constants) are staged in page-locked buffers that
// the graph keeps, so every replay copies the same bytes again.
#pragma once
#include <cstddef>

#include "tessera/core/cuda/cuda_runtime.h"

namespace tessera::cuda {

// True while this thread captures a graph on `device`.
bool capturing(int device);
// During a capture: a page-locked copy of `n` host bytes that lives as long as the graph
// (the source of a recorded host-to-device copy).
const void* stage_for_capture(int device, const void* host, size_t n);

}  // namespace tessera::cuda
