// Small memset and device-to-device copy nodes of a recorded graph, run as kernels.
//
// Inside a replayed graph one kernel follows another within about a microsecond, but a
// memset or memcpy node is handed to a different engine: the kernel before it must drain,
// the node runs, and the kernel after it starts 3-6 us after the previous one ended. A
// training step records ~150 of them (cuBLASLt clears a 4-byte semaphore before each of its
// cooperative GEMM kernels; small gradients are copied into place), so before instantiating
// a graph its small memset and 1-D device-to-device memcpy nodes are replaced by kernel
// nodes doing the same bytes, with the same dependencies. Large ones stay on the copy
// engines, where they may overlap kernels. TESSERA_GRAPH_COPY_KERNELS=0 turns it off.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace tessera::cuda {

// Nodes of at most this many bytes are rewritten.
constexpr size_t kGraphCopyKernelMaxBytes = size_t(1) << 20;

// Rewrites `graph`'s small memset and device-to-device memcpy nodes (device: current);
// returns how many. Nodes joined by other than plain dependencies are left alone.
int64_t replace_copy_nodes_with_kernels(cudaGraph_t graph);
// Whether TESSERA_GRAPH_COPY_KERNELS leaves the rewrite on (default on).
bool graph_copy_kernels_enabled();
// Nodes rewritten so far in this process (for tests).
int64_t graph_copy_nodes_rewritten();

}  // namespace tessera::cuda
