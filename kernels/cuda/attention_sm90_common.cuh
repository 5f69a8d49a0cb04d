// Pieces shared by the Hopper (sm_90a) attention kernels, forward (attention_sm90.cu) and
// backward (attention_sm90_backward.cu): the warpgroup MMAs in the two forms attention needs,
// the register layouts that let an accumulator become an A operand without moving data, and the
// host-side tensor maps of a [B, heads, T, D] view. The generic Hopper helpers (mbarriers, TMA,
// descriptors) are in sm90_common.cuh.
#pragma once
#include <type_traits>

#include "tessera/kernels/cuda/attention_common.cuh"
#include "tessera/kernels/cuda/sm90_common.cuh"

namespace tessera::cuda::attention_detail {

// ---------------- register layouts (PTX ISA, "wgmma ... register fragments") ----------------
// Warp w of a warpgroup owns rows 16w..16w+15 of the 64; lane l = 4g + t (g = l / 4, t = l % 4).
//   accumulator m64nN (f32): element i of the thread's N/2 registers is row 16w + g + 8 * ((i / 2)
//     % 2), column 8 * (i / 4) + 2t + i % 2 -- the mma.sync m16n8 C layout repeated over N.
//   A operand m64k16 in registers (4 x 32 bits, two 16-bit elements each, low half first):
//     a0 = (row g, k 2t..2t+1), a1 = (row g+8, k 2t..), a2 = (row g, k 2t+8..), a3 = (row g+8,
//     k 2t+8..) -- the mma.sync m16n8k16 A layout.
// So an accumulator's columns 16kk..16kk+15 (registers 8kk..8kk+7) are exactly the A operand of
// k-step kk: a0 = (acc[8kk], acc[8kk+1]), a1 = (acc[8kk+2], acc[8kk+3]), a2 = (acc[8kk+4],
// acc[8kk+5]), a3 = (acc[8kk+6], acc[8kk+7]): no data moves between threads.
// A-operand registers of KSteps k-steps (an accumulator of N = 16 KSteps columns, rounded).
template <int KSteps>
using AFragments = uint32_t[KSteps][4];

template <class T, int KSteps>
__device__ __forceinline__ void to_a_fragments(const float (&acc)[8 * KSteps],
                                               AFragments<KSteps>& a) {
#pragma unroll
  for (int kk = 0; kk < KSteps; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) a[kk][r] = pack2<T>(acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]);
}

// The MMAs read A fragments asynchronously: this keeps them unchanged and alive (their registers
// not reused) until after the wait that precedes it.
template <int KSteps>
__device__ __forceinline__ void pin_fragments(AFragments<KSteps>& a) {
#pragma unroll
  for (int kk = 0; kk < KSteps; ++kk)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[kk][r])::"memory");
}

// 2^x on the special-function unit (flushes results below 2^-126 to 0: probabilities are rounded
// to 16 bits anyway).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---------------- the two warpgroup MMA forms ----------------
#define TESSERA_OPERANDS_0_31                                                                  \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
  "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define TESSERA_OPERANDS_32_63                                                                 \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, " \
  "%50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define TESSERA_ACC32(acc, i)                                                               \
  TESSERA_SM90_ACC8(acc, i), TESSERA_SM90_ACC8(acc, i + 8), TESSERA_SM90_ACC8(acc, i + 16), \
      TESSERA_SM90_ACC8(acc, i + 24)

// acc (64 x N f32 per warpgroup) = A (desc_a: 64 rows x 16, K-major) * B^T (desc_b: N rows x 16,
// K-major), plus acc when `accumulate`. Immediates: scale-a = scale-b = 1, transpose-a = 0,
// transpose-b = 0 (both operands have their 16 k-elements contiguous per row).
#define TESSERA_WGMMA_SS_N128(ELEM)                                                            \
  asm volatile(                                                                                \
      "{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %66, 0;\n"                         \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." ELEM "." ELEM " {" TESSERA_OPERANDS_0_31 \
      ", " TESSERA_OPERANDS_32_63                                                              \
      "}, %64, %65,"                                                                           \
      " accumulate, 1, 1, 0, 0;\n}\n"                                                          \
      : TESSERA_ACC32(acc, 0), TESSERA_ACC32(acc, 32)                                          \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))
#define TESSERA_WGMMA_SS_N64(ELEM)                                                            \
  asm volatile(                                                                               \
      "{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %34, 0;\n"                        \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." ELEM "." ELEM " {" TESSERA_OPERANDS_0_31 \
      "}, %32, %33,"                                                                          \
      " accumulate, 1, 1, 0, 0;\n}\n"                                                         \
      : TESSERA_ACC32(acc, 0)                                                                 \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))
template <class T, int N>
__device__ __forceinline__ void wgmma_ss(float (&acc)[N / 2], uint64_t desc_a, uint64_t desc_b,
                                         int accumulate) {
  static_assert(N == 64 || N == 128, "wgmma_ss: N 64 or 128");
  constexpr bool bf16 = std::is_same_v<T, BFloat16>;
  if constexpr (N == 128) {
    if constexpr (bf16)
      TESSERA_WGMMA_SS_N128("bf16");
    else
      TESSERA_WGMMA_SS_N128("f16");
  } else {
    if constexpr (bf16)
      TESSERA_WGMMA_SS_N64("bf16");
    else
      TESSERA_WGMMA_SS_N64("f16");
  }
}
#undef TESSERA_WGMMA_SS_N128
#undef TESSERA_WGMMA_SS_N64

// acc (64 x N f32 per warpgroup) += A (registers a: 64 x 16, the layout above) * B (desc_b: 16
// k-rows x N, MN-major: each k-row holds N contiguous elements). The register form has no
// transpose-a; immediates scale-d (predicate, always 1 here), scale-a = scale-b = 1,
// transpose-b = 1.
#define TESSERA_WGMMA_RS_N128(ELEM)                                                            \
  asm volatile(                                                                                \
      "{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %69, 0;\n"                         \
      " wgmma.mma_async.sync.aligned.m64n128k16.f32." ELEM "." ELEM " {" TESSERA_OPERANDS_0_31 \
      ", " TESSERA_OPERANDS_32_63                                                              \
      "},"                                                                                     \
      " {%64, %65, %66, %67}, %68, accumulate, 1, 1, 1;\n}\n"                                  \
      : TESSERA_ACC32(acc, 0), TESSERA_ACC32(acc, 32)                                          \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
#define TESSERA_WGMMA_RS_N64(ELEM)                                                            \
  asm volatile(                                                                               \
      "{\n .reg .pred accumulate;\n setp.ne.b32 accumulate, %37, 0;\n"                        \
      " wgmma.mma_async.sync.aligned.m64n64k16.f32." ELEM "." ELEM " {" TESSERA_OPERANDS_0_31 \
      "}, {%32, %33, %34, %35}, %36, accumulate, 1, 1, 1;\n}\n"                               \
      : TESSERA_ACC32(acc, 0)                                                                 \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
template <class T, int N>
__device__ __forceinline__ void wgmma_rs(float (&acc)[N / 2], const uint32_t (&a)[4],
                                         uint64_t desc_b) {
  static_assert(N == 64 || N == 128, "wgmma_rs: N 64 or 128");
  constexpr bool bf16 = std::is_same_v<T, BFloat16>;
  if constexpr (N == 128) {
    if constexpr (bf16)
      TESSERA_WGMMA_RS_N128("bf16");
    else
      TESSERA_WGMMA_RS_N128("f16");
  } else {
    if constexpr (bf16)
      TESSERA_WGMMA_RS_N64("bf16");
    else
      TESSERA_WGMMA_RS_N64("f16");
  }
}
#undef TESSERA_WGMMA_RS_N128
#undef TESSERA_WGMMA_RS_N64
#undef TESSERA_ACC32
#undef TESSERA_OPERANDS_0_31
#undef TESSERA_OPERANDS_32_63

// ---------------- tensor maps of [B, heads, T, D] views ----------------
// Which tensor-map dimension (1, 2 or 3; 0 is the head dim) holds time, head and batch: the host
// orders a view's outer dimensions by stride (see encode_head_map).
struct MapSlots {
  int t, h, b;
};

// The box of 64 head dims from d0 x the map's rows from time t of (head h, batch b); rows past T
// arrive as zeros (and still count in the byte total).
__device__ __forceinline__ void load_head_box(uint32_t dst, const CUtensorMap* map, MapSlots slots,
                                              uint32_t bar, int d0, int t, int h, int b) {
  auto at = [&](int slot) { return slots.t == slot ? t : slots.h == slot ? h : b; };
  sm90::tma_load_4d(dst, map, bar, d0, at(1), at(2), at(3));
}

struct HeadMap {
  CUtensorMap map;
  MapSlots slots;
};

// A [B, heads, T, D] view as a 4-D tensor map read in boxes of 64 head dims x `rows` positions
// with the 128-byte swizzle; false when TMA cannot describe it (attention_sm90.cu).
bool encode_head_map(HeadMap& out, const Tensor& t, uint32_t rows);

// Whether `device` is an sm_90 GPU and this build holds the sm_90a attention kernels (asked once
// per device; attention_sm90.cu).
bool runs_sm90_kernels(int device);

}  // namespace tessera::cuda::attention_detail
