#include "tessera/core/cuda/graph_copy_nodes.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "tessera/core/cuda/cuda_check.h"
#include "tessera/core/settings.h"

namespace tessera::cuda {
namespace {

constexpr int kThreads = 256;

// cudaMemsetParams' work: `height` rows of `width` elements of `element_size` bytes (1, 2 or
// 4), rows `pitch` bytes apart, each element set to the low bytes of `value`.
__global__ void memset_node_kernel(char* dst, size_t pitch, unsigned value, int element_size,
                                   size_t width, size_t height) {
  const size_t n = width * height;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    char* p = dst + (i / width) * pitch + (i % width) * element_size;
    if (element_size == 4)
      *reinterpret_cast<unsigned*>(p) = value;
    else if (element_size == 2)
      *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(value);
    else
      *p = static_cast<char>(value);
  }
}

// A 1-D copy of `bytes`; 16 bytes at a time when both ends and the size allow it.
__global__ void copy_node_kernel(char* dst, const char* src, size_t bytes, bool wide) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t first = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  if (wide) {
    for (size_t i = first; i < bytes / 16; i += stride)
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
  } else {
    for (size_t i = first; i < bytes; i += stride) dst[i] = src[i];
  }
}

unsigned blocks_for(size_t items) {
  const size_t blocks = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks));
}

std::atomic<int64_t> rewritten{0};

// The graph API with edge data: the plain names from CUDA 13 on, `_v2` in 12.3-12.9; older
// toolkits have none (and no rewrite).
#if CUDART_VERSION >= 12030
#if CUDART_VERSION >= 13000
#define TESSERA_GRAPH_EDGE_API(name) name
#else
#define TESSERA_GRAPH_EDGE_API(name) name##_v2
#endif
cudaError_t node_dependencies(cudaGraphNode_t node, cudaGraphNode_t* nodes,
                              cudaGraphEdgeData* edges, size_t* count) {
  return TESSERA_GRAPH_EDGE_API(cudaGraphNodeGetDependencies)(node, nodes, edges, count);
}
cudaError_t node_dependents(cudaGraphNode_t node, cudaGraphNode_t* nodes, cudaGraphEdgeData* edges,
                            size_t* count) {
  return TESSERA_GRAPH_EDGE_API(cudaGraphNodeGetDependentNodes)(node, nodes, edges, count);
}
cudaError_t add_dependencies(cudaGraph_t graph, const cudaGraphNode_t* from,
                             const cudaGraphNode_t* to, size_t count) {
  return TESSERA_GRAPH_EDGE_API(cudaGraphAddDependencies)(graph, from, to, nullptr, count);
}
#undef TESSERA_GRAPH_EDGE_API

bool plain(const std::vector<cudaGraphEdgeData>& edges) {
  for (const cudaGraphEdgeData& e : edges)
    if (e.type != cudaGraphDependencyTypeDefault || e.from_port != 0 || e.to_port != 0)
      return false;
  return true;
}

bool is_device_memory(const void* p) {
  cudaPointerAttributes a{};
  if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return a.type == cudaMemoryTypeDevice;
}

// The kernel launch that does a node's work. `params` points at the argument fields below,
// so a Launch stays where it was filled until the kernel node is made from it.
struct Launch {
  void* func = nullptr;
  unsigned blocks = 1;
  std::vector<void*> params;
  char* dst = nullptr;
  const char* src = nullptr;
  size_t pitch = 0, width = 0, height = 0, bytes = 0;
  unsigned value = 0;
  int element_size = 0;
  bool wide = false;
};

// Fill `l` for a memset / memcpy node; false when the node is not one to rewrite.
bool memset_launch(cudaGraphNode_t node, Launch& l) {
  cudaMemsetParams m{};
  TESSERA_CUDA_CHECK(cudaGraphMemsetNodeGetParams(node, &m));
  const size_t bytes = m.width * m.height * m.elementSize;
  if (bytes == 0 || bytes > kGraphCopyKernelMaxBytes) return false;
  if (m.elementSize != 1 && m.elementSize != 2 && m.elementSize != 4) return false;
  l.dst = static_cast<char*>(m.dst);
  l.pitch = m.height > 1 ? m.pitch : m.width * m.elementSize;
  l.value = m.value;
  l.element_size = static_cast<int>(m.elementSize);
  l.width = m.width;
  l.height = m.height;
  l.func = reinterpret_cast<void*>(&memset_node_kernel);
  l.blocks = blocks_for(m.width * m.height);
  l.params = {&l.dst, &l.pitch, &l.value, &l.element_size, &l.width, &l.height};
  return true;
}

bool memcpy_launch(cudaGraphNode_t node, Launch& l) {
  cudaMemcpy3DParms p{};
  TESSERA_CUDA_CHECK(cudaGraphMemcpyNodeGetParams(node, &p));
  if (p.srcArray || p.dstArray || p.extent.height != 1 || p.extent.depth != 1) return false;
  if (p.srcPos.y || p.srcPos.z || p.dstPos.y || p.dstPos.z) return false;
  const size_t bytes = p.extent.width;
  if (bytes == 0 || bytes > kGraphCopyKernelMaxBytes) return false;
  char* dst = static_cast<char*>(p.dstPtr.ptr) + p.dstPos.x;
  const char* src = static_cast<const char*>(p.srcPtr.ptr) + p.srcPos.x;
  if (p.kind != cudaMemcpyDeviceToDevice &&
      !(p.kind == cudaMemcpyDefault && is_device_memory(dst) && is_device_memory(src)))
    return false;
  l.dst = dst;
  l.src = src;
  l.bytes = bytes;
  l.wide = (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) % 16 == 0;
  l.func = reinterpret_cast<void*>(&copy_node_kernel);
  l.blocks = blocks_for(l.wide ? bytes / 16 : bytes);
  l.params = {&l.dst, &l.src, &l.bytes, &l.wide};
  return true;
}

// Replaces `node` by a kernel node with the same incoming and outgoing dependencies.
bool replace(cudaGraph_t graph, cudaGraphNode_t node, Launch& l) {
  size_t n_in = 0, n_out = 0;
  TESSERA_CUDA_CHECK(node_dependencies(node, nullptr, nullptr, &n_in));
  TESSERA_CUDA_CHECK(node_dependents(node, nullptr, nullptr, &n_out));
  std::vector<cudaGraphNode_t> in(n_in), out(n_out);
  std::vector<cudaGraphEdgeData> in_edges(n_in), out_edges(n_out);
  TESSERA_CUDA_CHECK(node_dependencies(node, in.data(), in_edges.data(), &n_in));
  TESSERA_CUDA_CHECK(node_dependents(node, out.data(), out_edges.data(), &n_out));
  if (!plain(in_edges) || !plain(out_edges)) return false;
  cudaKernelNodeParams k{};
  k.func = l.func;
  k.gridDim = dim3(l.blocks);
  k.blockDim = dim3(kThreads);
  k.kernelParams = l.params.data();
  cudaGraphNode_t kernel = nullptr;
  TESSERA_CUDA_CHECK(cudaGraphAddKernelNode(&kernel, graph, in.data(), in.size(), &k));
  if (!out.empty()) {
    const std::vector<cudaGraphNode_t> from(out.size(), kernel);
    TESSERA_CUDA_CHECK(add_dependencies(graph, from.data(), out.data(), out.size()));
  }
  TESSERA_CUDA_CHECK(cudaGraphDestroyNode(node));  // and its edges
  return true;
}

#endif  // CUDART_VERSION >= 12030

}  // namespace

bool graph_copy_kernels_enabled() {
  return setting_enabled(Setting::GraphCopyKernels);
}

int64_t replace_copy_nodes_with_kernels(cudaGraph_t graph) {
#if CUDART_VERSION < 12030
  (void)graph;
  return 0;
#else
  size_t count = 0;
  TESSERA_CUDA_CHECK(cudaGraphGetNodes(graph, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  TESSERA_CUDA_CHECK(cudaGraphGetNodes(graph, nodes.data(), &count));
  int64_t done = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    // The runtime names no type for some driver nodes (the stream memory operations of
    // dist/cuda/peer_all_reduce.h: cudaErrorUnknown); they are not copies either way.
    const cudaError_t rc = cudaGraphNodeGetType(node, &type);
    if (rc == cudaErrorUnknown) {
      cudaGetLastError();
      continue;
    }
    TESSERA_CUDA_CHECK(rc);
    Launch l;
    const bool candidate = (type == cudaGraphNodeTypeMemset && memset_launch(node, l)) ||
                           (type == cudaGraphNodeTypeMemcpy && memcpy_launch(node, l));
    if (candidate && replace(graph, node, l)) ++done;
  }
  rewritten += done;
  return done;
#endif
}

int64_t graph_copy_nodes_rewritten() { return rewritten.load(); }

}  // namespace tessera::cuda
