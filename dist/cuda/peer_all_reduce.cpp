#include "tessera/dist/cuda/peer_all_reduce.h"

#include <cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "tessera/core/cuda/cuda_check.h"
#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/graph_capture.h"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {
namespace {

// The stream memory operations, from the driver (the runtime has none).
using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
struct MemOps {
  WaitValue32 wait = nullptr;
  WriteValue32 write = nullptr;
};
const MemOps& mem_ops() {
  static const MemOps ops = [] {
    MemOps m;
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      m.wait = reinterpret_cast<WaitValue32>(fn);
    if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue32", &fn, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      m.write = reinterpret_cast<WriteValue32>(fn);
    return m;
  }();
  return ops;
}

void write_flag(cudaStream_t stream, const char* address, uint32_t value) {
  CUresult rc = mem_ops().write(reinterpret_cast<CUstream>(stream),
                                reinterpret_cast<CUdeviceptr>(address), value, 0);
  TESSERA_CHECK(rc == CUDA_SUCCESS, "dist(peer all-reduce): cuStreamWriteValue32 failed (", int(rc),
                ")");
}
void wait_flag(cudaStream_t stream, const char* address, uint32_t value) {
  CUresult rc =
      mem_ops().wait(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(address),
                     value, CU_STREAM_WAIT_VALUE_EQ);
  TESSERA_CHECK(rc == CUDA_SUCCESS, "dist(peer all-reduce): cuStreamWaitValue32 failed (", int(rc),
                ")");
}

constexpr size_t kAlign = 256;
size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Rank 0 owns elements [0, split), rank 1 [split, numel): about half each, split a multiple of 8
// elements so that both halves start 16-byte aligned (the add reads and writes 16-byte packs).
int64_t split_of(int64_t numel) { return std::min(numel, ((numel + 1) / 2 + 7) / 8 * 8); }

std::string hostname() {
  char name[256] = {};
  gethostname(name, sizeof name - 1);
  return name;
}

// Publishes this rank's text under key/<rank> and returns the peer's.
std::string exchange(Store& store, const std::string& key, int rank, const std::string& mine) {
  store.set(key + "/" + std::to_string(rank), mine);
  return store.get(key + "/" + std::to_string(1 - rank));
}

}  // namespace

// [bucket: numel elements][staging: split_of(numel)][flags: arrived, reduced], each part
// 256-byte aligned, in one allocation of each rank; `peer` is the other rank's, mapped here.
struct PeerAllReduce::Buffer {
  char* local = nullptr;
  char* peer = nullptr;
  int64_t numel = 0;
  DType dtype = DType::f32;
  size_t staging = 0, flags = 0;  // byte offsets
};

PeerAllReduce::PeerAllReduce(Store& store, std::string prefix, int rank, int device)
    : store_(store), prefix_(std::move(prefix)), rank_(rank), device_(device) {}

std::unique_ptr<PeerAllReduce> PeerAllReduce::connect(Store& store, const std::string& prefix,
                                                      int rank, int device, std::string* why_not) {
  // Each rank says what it sees, then both decide on the same two answers.
  char bus[64] = {};
  TESSERA_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device));
  const std::string hello = hostname() + "\n" + bus;
  const std::string peer_hello = exchange(store, prefix + "/peer/hello", rank, hello);
  std::string reason;
  const size_t cut = peer_hello.find('\n');
  if (cut == std::string::npos || peer_hello.substr(0, cut) != hostname()) {
    reason = "the two ranks run on different hosts";
  } else if (!mem_ops().wait || !mem_ops().write) {
    reason = "the driver offers no stream memory operations";
  } else {
    int peer_device = -1, can_access = 0;
    if (cudaDeviceGetByPCIBusId(&peer_device, peer_hello.substr(cut + 1).c_str()) != cudaSuccess) {
      cudaGetLastError();
      reason = "the peer's GPU is not visible to this process";
    } else if (peer_device == device) {
      reason = "both ranks use the same GPU";
    } else {
      TESSERA_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_access, device, peer_device));
      if (!can_access) reason = "the GPUs cannot access each other's memory";
    }
  }
  const std::string peer_reason = exchange(store, prefix + "/peer/verdict", rank, reason);
  if (reason.empty()) reason = peer_reason.empty() ? "" : "on the other rank, " + peer_reason;
  if (!reason.empty()) {
    if (why_not) *why_not = reason;
    return nullptr;
  }
  return std::unique_ptr<PeerAllReduce>(new PeerAllReduce(store, prefix, rank, device));
}

Tensor PeerAllReduce::allocate(int64_t numel, DType dtype) {
  TESSERA_CHECK(!graph_capture_underway(),
                "dist(peer all-reduce): a communication buffer cannot be allocated while a "
                "device graph is recorded (the ranks exchange memory handles)");
  TESSERA_CHECK(numel >= 0, "dist(peer all-reduce): a buffer of ", numel, " elements");
  cuda::DeviceGuard guard(device_);
  auto b = std::make_shared<Buffer>();
  b->numel = numel;
  b->dtype = dtype;
  const size_t element = dtype_size(dtype);
  b->staging = aligned(size_t(numel) * element);
  b->flags = b->staging + aligned(size_t(split_of(numel)) * element);
  void* base = nullptr;
  TESSERA_CUDA_CHECK(cudaMalloc(&base, b->flags + kAlign));
  b->local = static_cast<char*>(base);
  // Flags start cleared before the peer can see the handle.
  TESSERA_CUDA_CHECK(cudaMemset(b->local + b->flags, 0, kAlign));
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t mine{}, theirs{};
  TESSERA_CUDA_CHECK(cudaIpcGetMemHandle(&mine, base));
  const std::string key = prefix_ + "/peer/buffer/" + std::to_string(allocated_++);
  const std::string peer =
      exchange(store_, key, rank_, std::string(reinterpret_cast<const char*>(&mine), sizeof mine));
  TESSERA_CHECK(peer.size() == sizeof theirs,
                "dist(peer all-reduce): corrupt memory handle in the store under ", key);
  std::memcpy(&theirs, peer.data(), sizeof theirs);
  void* mapped = nullptr;
  const cudaError_t cudaIpcOpenMemHandle_of_the_peer =
      cudaIpcOpenMemHandle(&mapped, theirs, cudaIpcMemLazyEnablePeerAccess);
  if (cudaIpcOpenMemHandle_of_the_peer != cudaSuccess) cudaFree(base);
  TESSERA_CUDA_CHECK(cudaIpcOpenMemHandle_of_the_peer);
  b->peer = static_cast<char*>(mapped);
  {
    std::lock_guard lock(registry_->mutex);
    registry_->buffers[base] = b;
  }
  // The deleter must not throw. Queued work (this rank's or the peer's copies) may still use
  // the memory: both finish every exchange before either can drop the buffer (each waits for
  // the other's last flag), so this rank's own queue is what is waited for.
  std::shared_ptr<void> owner(base, [registry = registry_, device = device_](void* p) {
    std::shared_ptr<Buffer> buffer;
    {
      std::lock_guard lock(registry->mutex);
      auto it = registry->buffers.find(p);
      if (it == registry->buffers.end()) return;
      buffer = std::move(it->second);
      registry->buffers.erase(it);
    }
    int previous = 0;
    if (cudaGetDevice(&previous) == cudaErrorCudartUnloading) return;
    cudaSetDevice(device);
    cudaDeviceSynchronize();
    cudaIpcCloseMemHandle(buffer->peer);
    cudaFree(p);
    cudaSetDevice(previous);
  });
  return from_blob(base, {numel}, dtype, Device::cuda(device_), std::move(owner));
}

std::shared_ptr<PeerAllReduce::Buffer> PeerAllReduce::buffer_at(const void* data, int64_t numel,
                                                                DType dtype) const {
  std::lock_guard lock(registry_->mutex);
  auto it = registry_->buffers.find(data);
  if (it == registry_->buffers.end() || it->second->numel != numel || it->second->dtype != dtype)
    return nullptr;
  return it->second;
}

std::shared_ptr<PeerAllReduce::Buffer> PeerAllReduce::buffer_of(const Tensor& t) const {
  return t.is_contiguous() ? buffer_at(t.raw_data(), t.numel(), t.dtype()) : nullptr;
}

bool PeerAllReduce::serves(const Tensor& t, ReduceOp op) const {
  if (op != ReduceOp::Sum && op != ReduceOp::Avg) return false;
  if (!is_floating(t.dtype()) || t.dtype() == DType::f64) return false;
  return buffer_of(t) != nullptr;
}

std::shared_ptr<PeerAllReduce::Buffer> PeerAllReduce::gather_buffer(
    const std::vector<Tensor>& outputs, const Tensor& input) const {
  if (outputs.size() != 2 || !input.is_contiguous()) return nullptr;
  const char* base = static_cast<const char*>(outputs[0].raw_data());
  for (int r = 0; r < 2; ++r)
    if (!outputs[r].is_contiguous() || outputs[r].numel() != input.numel() ||
        outputs[r].dtype() != input.dtype() ||
        static_cast<const char*>(outputs[r].raw_data()) != base + r * input.nbytes())
      return nullptr;
  return buffer_at(base, 2 * input.numel(), input.dtype());
}

bool PeerAllReduce::serves_all_gather(const std::vector<Tensor>& outputs,
                                      const Tensor& input) const {
  return gather_buffer(outputs, input) != nullptr;
}

void PeerAllReduce::enqueue(const Tensor& t, ReduceOp op, cudaStream_t stream) {
  const std::shared_ptr<Buffer> b = buffer_of(t);
  TESSERA_CHECK(b, "dist(peer all-reduce): not a communication buffer of this group");
  const size_t element = dtype_size(b->dtype);
  const int64_t split = split_of(b->numel);
  const int64_t mine = rank_ == 0 ? 0 : split, mine_len = rank_ == 0 ? split : b->numel - split;
  const int64_t theirs = rank_ == 0 ? split : 0, theirs_len = b->numel - mine_len;
  const char* arrived = b->local + b->flags;
  const char* reduced = arrived + sizeof(uint32_t);
  const char* peer_arrived = b->peer + b->flags;
  const char* peer_reduced = peer_arrived + sizeof(uint32_t);
  // 1-2: the peer's half of this bucket into its staging area, then its flag.
  if (theirs_len > 0)
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(b->peer + b->staging, b->local + theirs * element,
                                       theirs_len * element, cudaMemcpyDeviceToDevice, stream));
  write_flag(stream, peer_arrived, 1);
  wait_flag(stream, arrived, 1);
  write_flag(stream, arrived, 0);
  // 3: own half = (own half + the peer's contribution) [/ 2], in one pass, rounded once into
  // the buffer's dtype (the bits of NCCL's sum, then of a multiply by 1/2).
  if (mine_len > 0) {
    cuda::StreamGuard on(stream, device_);
    const Tensor own = ops::narrow(t, 0, mine, mine_len);
    const Tensor staged = from_blob(b->local + b->staging, {mine_len}, b->dtype, t.device());
    cuda::sum_scaled(own, staged, op == ReduceOp::Avg ? 0.5 : 1.0, own);
  }
  // 4-5: the reduced half into the peer's bucket, then its flag.
  if (mine_len > 0)
    TESSERA_CUDA_CHECK(cudaMemcpyAsync(b->peer + mine * element, b->local + mine * element,
                                       mine_len * element, cudaMemcpyDeviceToDevice, stream));
  write_flag(stream, peer_reduced, 1);
  wait_flag(stream, reduced, 1);
  write_flag(stream, reduced, 0);
}

void PeerAllReduce::enqueue_all_gather(const std::vector<Tensor>& outputs, const Tensor& input,
                                       cudaStream_t stream) {
  const std::shared_ptr<Buffer> b = gather_buffer(outputs, input);
  TESSERA_CHECK(b, "dist(peer all-gather): not a communication buffer of this group");
  const size_t slot = input.nbytes(), mine = rank_ * slot;
  const char* ready = b->local + b->flags + sizeof(uint32_t);  // the "reduced" flag
  const char* arrived = b->local + b->flags;
  const char* peer_ready = b->peer + b->flags + sizeof(uint32_t);
  const char* peer_arrived = b->peer + b->flags;
  // 1: both ranks are done with what the buffer held.
  write_flag(stream, peer_ready, 1);
  wait_flag(stream, ready, 1);
  write_flag(stream, ready, 0);
  // 2-3: this rank's part into the peer's buffer, the peer's flag, then into its own buffer
  // while the peer's part comes.
  if (slot > 0)
    TESSERA_CUDA_CHECK(
        cudaMemcpyAsync(b->peer + mine, input.raw_data(), slot, cudaMemcpyDeviceToDevice, stream));
  write_flag(stream, peer_arrived, 1);
  if (slot > 0 && input.raw_data() != b->local + mine)
    TESSERA_CUDA_CHECK(
        cudaMemcpyAsync(b->local + mine, input.raw_data(), slot, cudaMemcpyDeviceToDevice, stream));
  wait_flag(stream, arrived, 1);
  write_flag(stream, arrived, 0);
}

}  // namespace tessera::dist
