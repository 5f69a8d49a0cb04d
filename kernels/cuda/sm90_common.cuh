// Hopper (sm_90a) building blocks shared by the warp-specialised kernels (gemm_sm90.cu,
// attention_sm90.cu): mbarriers, TMA copies, shared-memory matrix descriptors, warpgroup MMA
// bookkeeping, register reallocation, tensor-map encoding and the run-time check that a device
// runs a kernel's sm_90a code. Every device helper is one PTX instruction (or a wait loop) with
// a comment saying what the kernels rely on; the long explanation of the descriptor values is in
// benchmarks/cuda/NOTES.md ("Hopper GEMM: wgmma + TMA").
#pragma once
#include <cuda.h>  // CUtensorMap and its enums only: the driver is reached through the runtime
#include <cudaTypedefs.h>

#include "tessera/kernels/cuda/common.cuh"

namespace tessera::cuda::sm90 {

// ---------------- shared memory and mbarriers ----------------
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals));
}
// Makes barriers initialised by this thread visible to the TMA unit (the async proxy) and to the
// other threads; call once after the inits, then __syncthreads().
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Arrive (the producer's one arrival) and tell the barrier how many bytes the TMA will deliver;
// the phase completes when both the arrival and the bytes are in.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of parity `parity` has completed. A barrier starts in phase 0; each
// completion flips the phase, so the n-th completion (n = 0, 1, ...) is waited for with parity
// n & 1. try_wait suspends the thread for a while inside the instruction, so this loop does not
// hammer the barrier. Real waits last microseconds; after ~2^35 cycles (> 10 s) something is
// broken (a byte count or a phase that never completes) and a trap turns the hang into a launch
// error.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  constexpr long long kHangCycles = 1LL << 35;
  long long first_miss = 0;
  while (true) {
    uint32_t done = 0;
    asm volatile(
        "{\n .reg .pred complete;\n"
        " mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        " selp.u32 %0, 1, 0, complete;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    if (done) return;
    const long long now = clock64();
    if (first_miss == 0)
      first_miss = now;
    else if (now - first_miss > kHangCycles)
      __trap();
  }
}

// ---------------- TMA (cp.async.bulk.tensor) ----------------
// Copy the box at element coordinates (c0 innermost, c1, ...) of the tensor map into shared
// memory at `dst`, counting the bytes on mbarrier `bar`; elements outside the tensor arrive as
// zeros and still count. (A lone CTA is a cluster of one, hence ::cluster.)
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar,
                                            int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// ---------------- warpgroup MMA ----------------
// Shared-memory matrix descriptor (PTX "matrix descriptor format"): start address, leading and
// stride byte offsets (all >> 4), bits 62-63 = 1 for the 128-byte swizzle. With this swizzle the
// 16-byte chunk c of 128-byte row r sits at chunk c ^ (r % 8), relative to a 1024-byte-aligned
// block of 8 rows; TMA writes exactly that layout, so the base offset field stays 0.
//   K-major operand (rows of 64 k-elements = 128 bytes): stride = 1024 (the next 8 rows), leading
//     unused (16 by convention); a k-step of 16 elements moves the start 32 bytes inside the row.
//   MN-major operand (rows of 64 m/n-elements along k): stride = 1024 (the next 8 k-rows),
//     leading = the distance to the next 64 m/n columns (the next "panel").
__device__ __forceinline__ uint64_t swizzle128_descriptor(uint32_t start, uint32_t leading_bytes,
                                                          uint32_t stride_bytes) {
  return uint64_t((start & 0x3FFFF) >> 4) | (uint64_t(leading_bytes >> 4) << 16) |
         (uint64_t(stride_bytes >> 4) << 32) | (uint64_t(1) << 62);
}

// The accumulator registers are only ever named by wgmma; these empty asm statements stop the
// compiler from moving ordinary reads/writes of them across a fence or a wait.
template <int N>
__device__ __forceinline__ void pin_registers(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}
// Orders earlier register writes (accumulators, A fragments) before the next wgmma reads them.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most `Pending` committed groups of this warp's wgmmas are still running.
template <int Pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Pending) : "memory");
}

// Register reallocation between warpgroups (all 128 threads of a warpgroup execute it): the
// producer gives registers back to the CTA's pool, the consumers take them (inc blocks until the
// pool holds enough). Counts are multiples of 8 in [24, 256].
template <int Registers>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers));
}

// Eight consecutive f32 accumulators as "+f" asm operands (the wgmma wrappers list 32 to 128).
#define TESSERA_SM90_ACC8(acc, i)                                                       \
  "+f"(acc[i]), "+f"(acc[i + 1]), "+f"(acc[i + 2]), "+f"(acc[i + 3]), "+f"(acc[i + 4]), \
      "+f"(acc[i + 5]), "+f"(acc[i + 6]), "+f"(acc[i + 7])

// ---------------- host side ----------------
// cuTensorMapEncodeTiled comes from the driver through the runtime, so no -lcuda is needed.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    TESSERA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                        cudaEnableDefault, &found));
    TESSERA_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                  "the CUDA driver does not provide cuTensorMapEncodeTiled (needed by the sm_90 "
                  "kernels)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encoder;
}

// x as lane 0 of the warp holds it. For a value the same in every lane this changes nothing but
// what ptxas knows: it keeps values that depend on a loop-carried count (a ring's stage in a
// persistent kernel) in per-thread registers, and with them the shared-memory descriptors and
// addresses built from them (moved into uniform registers before every wgmma); the result of a
// broadcast it treats as warp-uniform, so those stay in uniform registers throughout. Every
// lane of the warp must run it (never inside a branch only some lanes take).
__device__ __forceinline__ int uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

inline CUtensorMapDataType tensor_map_type(DType t) {
  return t == DType::bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// True when `device` is an sm_90 (H100/H200) and `kernel` exists as sm_90a code in this
// library (compiled for any other architecture, its body is only a __trap() guard that the host
// never reaches, since this check fails there).
template <class Kernel>
bool device_runs_sm90a(int device, Kernel* kernel) {
  int major = 0, minor = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major != 9 || minor != 0) return false;
  cudaFuncAttributes attributes{};
  TESSERA_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
  return attributes.binaryVersion == 90;
}

}  // namespace tessera::cuda::sm90
