// The Hopper (sm_90a) causal flash-attention backward: wgmma with operands fed by TMA.
// attention_backward.cu's flash_attention_backward sends bf16/f16, head size 64/128 here on an
// H100/H200 (see sm90_backward_unsupported) and keeps its mma.sync kernels everywhere else.
//
// The same split as the mma.sync backward into a dk/dv part and a dq part, so no atomics and
// bitwise-repeatable results (with P recomputed from the saved log-sum-exp and delta_i = sum_d
// dO_id O_id). Here both parts are roles of the blocks of one launch (flash_backward_sm90_kernel:
// the dk/dv blocks first, then the dq blocks, so the second fill the SMs as the first drain);
// below they are called the dkv and dq kernels:
//   dkv kernel: a block owns 128 keys of one key/value head (64 per consumer warpgroup) and walks
//     the query tiles from the diagonal on, of every query head of its GQA group:
//       S^T  = K Q^T       wgmma SS, A = K (block rows), B = Q (streamed), both K-major
//       dP^T = V dO^T      wgmma SS, A = V, B = dO
//       P^T  = exp2(S^T scale log2e - lse) (masked),  dS^T = P^T (dP^T - delta)
//       dV  += P^T dO      wgmma RS, A = P^T from registers, B = dO MN-major (transpose bit)
//       dK  += dS^T Q      wgmma RS, A = dS^T from registers, B = Q MN-major
//   dq kernel: a block owns 128 queries of one query head and walks the key tiles up to the
//     diagonal: S = Q K^T, dP = dO V^T (SS), P, dS as above, dQ += dS K (RS, B = K MN-major).
// With bias partials (GPT's c_attn: causal_attention_qkv_projection) each block also sums the
// rows it stores, per column, into one row of partials (store_acc_rows, backward_block's end).
// Both are one template (Sm90Backward<D, kDkv>): "rows" are the block's fixed 128 rows (keys or
// queries, loaded once), "columns" the streamed tiles of kCols positions (queries or keys).
// Because S^T / S are computed with the block's rows as wgmma's M, the probabilities land in the
// accumulator layout that is directly the A operand of the next MMA (attention_sm90_common.cuh).
//
// Block: 256 threads = 2 warpgroups, both consumers (no producer warpgroup: thread 0 issues the
// TMA copies). Pipeline: the row tiles (two [128, D] tiles) once, then a ring of 2 stages, each a
// pair of column tiles [kCols, D]; at the top of step i thread 0 loads the column tiles of step
// i + 1 into the other stage (freed by the __syncthreads that ended step i - 1), so the copy runs
// while step i computes. Every thread waits for every stage's barrier (even a warpgroup with
// nothing to compute there), so no copy can target a stage whose previous copy is still landing.
// mbarriers (phase n completes when the single arrive.expect_tx and all its bytes are in; waits
// name parity n & 1, see sm90::mbarrier_wait):
//   rows_full      the two row tiles; used once: parity 0.
//   col_full[s]    the column tiles of stage s; step i uses stage i % 2 for the (i / 2)-th time,
//                  so it waits for parity (i / 2) & 1.
// The dkv kernel also needs lse and delta of its columns (queries): every thread copies one of
// the 2 kCols values of step i + 1 into a 2-stage shared array at the top of step i (plain loads,
// read after the same __syncthreads).
//
// Shared memory, tiles as 128-byte-swizzled panels of 64 head dims (one 128-byte row per
// position; D = 128 has two panels per tile, one TMA box each), from a 1024-aligned base:
//   [R1][R2][C1 stage 0][C1 stage 1][C2 stage 0][C2 stage 1]
//   dkv: R1 = K, R2 = V, C1 = Q, C2 = dO;  dq: R1 = Q, R2 = dO, C1 = K, C2 = V.
//   D = 64:  kCols = 128: 2 x 16 KB + 4 x 16 KB = 96 KB;  D = 128: kCols = 64: 2 x 32 + 4 x 16 =
//   128 KB (+ 1 KB alignment slack, + 1 KB of lse/delta).
// Registers per consumer thread: S and dP tiles (kCols / 2 f32 each), the accumulators (D / 2
// f32 each; two in the dkv kernel), the A fragments of P and dS (kCols / 4 each): at most
// 2 x 64 + 2 x 32 = 192 live floats (dkv, D = 64) and 32 + 32 + 2 x 64 = 192 (dkv, D = 128).
#include <cmath>
#include <string>

#include "tessera/kernels/cuda/attention_sm90_common.cuh"

namespace tessera::cuda::attention_detail {
namespace {
using namespace sm90;

template <int D, bool kDkv>
struct Sm90Backward {
  static constexpr int kWarpgroups = 2;
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int kRows = 64 * kWarpgroups;    // the block's fixed rows (wgmma M = 64 each)
  static constexpr int kCols = D == 64 ? 128 : 64;  // positions per streamed tile (wgmma N of S)
  static constexpr int kColSteps = kCols / 16;      // k-steps of the register-A MMAs
  static constexpr int kStages = 2;
  static constexpr int kPanels = D / 64;  // 128-byte swizzle rows hold 64 16-bit elements
  static constexpr uint32_t kRowPanelBytes = kRows * 128, kRowBytes = kRowPanelBytes * kPanels;
  static constexpr uint32_t kColPanelBytes = kCols * 128, kColBytes = kColPanelBytes * kPanels;
  static constexpr size_t kSmemBytes =
      2 * size_t(kRowBytes) + 2 * kStages * size_t(kColBytes) + 1024;
  static_assert(D == 64 || D == 128, "head size 64 or 128");
  static_assert(kRows % kCols == 0, "a block's first column tile must start at a tile boundary");
  static_assert(kRowPanelBytes % 1024 == 0 && kColPanelBytes % 1024 == 0,
                "every panel must start on a 1024-byte swizzle block");
  static_assert(2 * kCols <= kThreads, "one thread per lse/delta value of a column tile");
  static_assert(kRows == kSm90BackwardRows, "the bias partials' rows (sm90_bias_partial_rows)");
};

template <int D, bool kDkv>
struct BackwardSmem {
  using C = Sm90Backward<D, kDkv>;
  uint32_t base, bars;  // shared addresses of the tiles and of the 3 barriers
  __device__ uint32_t r1() const { return base; }
  __device__ uint32_t r2() const { return base + C::kRowBytes; }
  __device__ uint32_t c1(int stage) const {
    return base + 2 * C::kRowBytes + uint32_t(stage) * C::kColBytes;
  }
  __device__ uint32_t c2(int stage) const {
    return base + 2 * C::kRowBytes + uint32_t(C::kStages + stage) * C::kColBytes;
  }
  __device__ uint32_t rows_full() const { return bars; }
  __device__ uint32_t col_full(int stage) const { return bars + 8 * (1 + stage); }
};
constexpr int kBackwardBarriers = 3;

struct BackwardSlots {
  MapSlots r1, r2, c1, c2;
};

// A block's work. dkv: rows = keys [row0, row0 + 128) of key/value head row_head; step i visits
// query head col_head0 + i / per_head, query tile first_col_tile + i % per_head (the tiles from
// the diagonal on, per query head of the group). dq: rows = queries of query head row_head;
// per_head = steps, so step i visits key tile i of key/value head col_head0.
template <int D, bool kDkv>
struct BackwardBlock {
  using C = Sm90Backward<D, kDkv>;
  int b, row_head, row0, col_head0, first_col_tile, per_head, steps, seq_len;
  // bx, by: the block's coordinates among the blocks of its kernel (see the launch).
  __device__ static BackwardBlock make(int H, int group, int seq_len, int bx, int by, int grid_x) {
    BackwardBlock blk;
    blk.seq_len = seq_len;
    const int col_tiles = (seq_len + C::kCols - 1) / C::kCols;
    if constexpr (kDkv) {
      const int H_kv = H / group;
      blk.b = by / H_kv;
      blk.row_head = by % H_kv;
      blk.row0 = bx * C::kRows;
      blk.col_head0 = blk.row_head * group;
      blk.first_col_tile = blk.row0 / C::kCols;  // queries before row0 see none of these keys
      blk.per_head = col_tiles - blk.first_col_tile;
      blk.steps = group * blk.per_head;
    } else {
      blk.b = by / H;
      blk.row_head = by % H;
      // The longest blocks (most key tiles) first.
      blk.row0 = (grid_x - 1 - bx) * C::kRows;
      blk.col_head0 = blk.row_head / group;
      blk.first_col_tile = 0;
      blk.per_head = (min(blk.row0 + C::kRows, seq_len) - 1) / C::kCols + 1;
      blk.steps = blk.per_head;
    }
    return blk;
  }
  __device__ int col_head(int i) const { return col_head0 + i / per_head; }
  __device__ int col0(int i) const { return (first_col_tile + i % per_head) * C::kCols; }
};

struct BackwardMaps {
  const CUtensorMap *r1, *r2, *c1, *c2;
};

// Thread 0: the column tiles of step i into stage i % 2 (its previous use, step i - 2, ended
// before the __syncthreads that precedes this call).
template <int D, bool kDkv>
__device__ __forceinline__ void load_columns(const BackwardSmem<D, kDkv>& sm,
                                             const BackwardBlock<D, kDkv>& blk,
                                             const BackwardMaps& maps, const BackwardSlots& slots,
                                             int i) {
  using C = Sm90Backward<D, kDkv>;
  const int stage = i % C::kStages, col0 = blk.col0(i), head = blk.col_head(i);
  mbarrier_arrive_expect_bytes(sm.col_full(stage), 2 * C::kColBytes);
  for (int p = 0; p < C::kPanels; ++p) {
    load_head_box(sm.c1(stage) + p * C::kColPanelBytes, maps.c1, slots.c1, sm.col_full(stage),
                  p * 64, col0, head, blk.b);
    load_head_box(sm.c2(stage) + p * C::kColPanelBytes, maps.c2, slots.c2, sm.col_full(stage),
                  p * 64, col0, head, blk.b);
  }
}

// dkv kernel: lse (times log2 e) and delta of step i's queries into stats[i % 2] ([lse | delta]);
// positions past T get 0 (their probabilities are masked to 0).
template <int D, bool kDkv>
__device__ __forceinline__ void load_column_stats(float (*stats)[2 * Sm90Backward<D, kDkv>::kCols],
                                                  const BackwardBlock<D, kDkv>& blk, int H,
                                                  const float* lse, const float* delta, int i) {
  using C = Sm90Backward<D, kDkv>;
  const int r = static_cast<int>(threadIdx.x);
  if (r >= 2 * C::kCols) return;
  const int t = blk.col0(i) + r % C::kCols;
  const int64_t at = (int64_t(blk.b) * H + blk.col_head(i)) * blk.seq_len + t;
  float value = 0.f;
  if (t < blk.seq_len) value = r < C::kCols ? lse[at] * kLog2e : delta[at];
  stats[i % C::kStages][r] = value;
}

// 128-byte-swizzle descriptors (sm90::swizzle128_descriptor; benchmarks/cuda/NOTES.md "Hopper
// GEMM: wgmma + TMA"). K-major k-step kk (head dims 16kk..16kk+15) of a tile whose first row is
// at `rows`: panel kk / 4, 32 bytes per step inside the 128-byte rows, 8-row groups 1024 apart.
__device__ __forceinline__ uint64_t k_major(uint32_t rows, uint32_t panel_bytes, int kk) {
  return swizzle128_descriptor(rows + uint32_t(kk / 4) * panel_bytes + uint32_t(kk % 4) * 32, 16,
                               1024);
}
// MN-major k-step kk of a [positions, D] tile used as B = [k = positions][n = head dims]: rows
// 16kk..16kk+15 (2048 bytes per step), the next 64 head dims one panel further (leading offset),
// 8-row groups 1024 bytes apart (stride offset).
__device__ __forceinline__ uint64_t mn_major(uint32_t tile, uint32_t panel_bytes, int kk) {
  return swizzle128_descriptor(tile + uint32_t(kk) * 16 * 128, panel_bytes, 1024);
}

// This thread's place in its warpgroup's 64 rows (register layout: attention_sm90_common.cuh).
struct ThreadRows {
  int r_lo;  // rows r_lo and r_lo + 8 (absolute positions)
  int t;     // lane % 4: columns 8j + 2t, 8j + 2t + 1
};

// x (S or S^T) becomes P in place: exp2(x scale log2e - lse log2e), 0 outside the causal triangle
// and past T. Element i is at row r_lo + 8 ((i / 2) % 2) and column col0 + 8 (i / 4) + 2t + i % 2.
// dkv: rows are keys, columns queries (lse per column, from shared memory); dq: rows are queries
// (lse per row, in registers). ex2.approx flushes values below 2^-126 to 0: P is rounded to 16
// bits anyway.
template <int N, bool kDkv>
__device__ __forceinline__ void probabilities(float (&x)[N / 2], ThreadRows tr, int col0,
                                              int seq_len, bool mask, float scale_log2,
                                              const float* stats, const float (&lse2)[2]) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const int half = (i / 2) % 2;
    const int col = 8 * (i / 4) + 2 * tr.t + i % 2;  // inside the tile
    const float l = kDkv ? stats[col] : lse2[half];
    float p = fast_exp2(fmaf(x[i], scale_log2, -l));
    if (mask) {  // uniform over the warpgroup: only tiles crossing the diagonal or T
      const int row = tr.r_lo + 8 * half, pos = col0 + col;
      const bool visible = kDkv ? pos >= row : pos <= row;
      if (!visible || pos >= seq_len) p = 0.f;
    }
    x[i] = p;
  }
}

// y (dP or dP^T) becomes dS = P (dP - delta) in place (delta per column from shared memory in the
// dkv kernel, per row in registers in the dq kernel).
template <int N, bool kDkv>
__device__ __forceinline__ void score_gradients(const float (&p)[N / 2], float (&y)[N / 2],
                                                ThreadRows tr, const float* stats,
                                                const float (&dlt)[2]) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const int col = 8 * (i / 4) + 2 * tr.t + i % 2;
    const float d = kDkv ? stats[N + col] : dlt[(i / 2) % 2];
    y[i] = p[i] * (y[i] - d);
  }
}

// One round of store_acc_rows' reduce-scatter: with lane bit kBit set this lane keeps the upper
// kKeep of its first 2 kKeep sums, else the lower, each plus the partner lane's same sum; the
// kept ones move to sum[0, kKeep) (compile-time indices: the array stays in registers).
template <int kKeep, int kBit, int V>
__device__ __forceinline__ void scatter_round(float (&sum)[V], int lane, int& first) {
  const bool upper = (lane & kBit) != 0;
#pragma unroll
  for (int k = 0; k < kKeep; ++k) {
    const float lo = sum[k], hi = sum[k + kKeep];
    const float theirs = __shfl_xor_sync(0xffffffffu, upper ? lo : hi, kBit);
    sum[k] = (upper ? hi : lo) + theirs;
  }
  if (upper) first += kKeep;
}

// Stores a warpgroup's 64 rows of acc * mul (rows r_lo and r_lo + 8 of this thread, registers
// 4j + 2 half and 4j + 2 half + 1 of 8-column block j) below T, nothing where !active. With
// warp_sums (shared memory, D floats for this warp) also the column sums of what this warp
// stored over its 16 rows, as the stored (rounded) values: each thread adds its two rows, then
// the 8 lanes sharing its columns reduce-scatter them (three shuffle rounds over lane bits 4, 3,
// 2, each halving what a lane holds), so every lane ends with D / 32 whole column sums. A fixed
// order: the sums repeat bitwise.
template <class T, int D>
__device__ __forceinline__ void store_acc_rows(const float (&acc)[D / 2], float mul, ThreadRows tr,
                                               int seq_len, bool active, T* dst, HeadLayout L,
                                               int b, int h, float* warp_sums) {
  constexpr int V = D / 4;  // this thread's columns 8j + 2t + e, as v = 2j + e
  float sum[V];
#pragma unroll
  for (int v = 0; v < V; ++v) sum[v] = 0.f;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = tr.r_lo + 8 * half;
    if (!active || row >= seq_len) continue;
    T* out = dst + L.row(b, h, row) + 2 * tr.t;
#pragma unroll
    for (int j = 0; j < D / 8; ++j) {
      const uint32_t packed = pack2<T>(acc[4 * j + 2 * half] * mul, acc[4 * j + 2 * half + 1] * mul);
      *reinterpret_cast<uint32_t*>(out + 8 * j) = packed;
      if (warp_sums != nullptr) {
        const float2 stored = unpack2<T>(packed);
        sum[2 * j] += stored.x;
        sum[2 * j + 1] += stored.y;
      }
    }
  }
  if (warp_sums == nullptr) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  int first = 0;  // the first v this lane keeps
  scatter_round<V / 2, 16>(sum, lane, first);
  scatter_round<V / 4, 8>(sum, lane, first);
  scatter_round<V / 8, 4>(sum, lane, first);
#pragma unroll
  for (int k = 0; k < V / 8; ++k) {
    const int v = first + k;
    warp_sums[8 * (v / 2) + 2 * tr.t + v % 2] = sum[k];
  }
}

// One step of one warpgroup: S and dP from shared memory, P and dS in registers, then
// acc1 += dS C1 (dK or dQ) and, in the dkv kernel, acc2 += P C2 (dV). Four commit groups,
// completing in order: S, dP, [dV,] dK/dQ. The exp2 of P runs while the tensor cores still
// compute dP (wait_group 1), and in the dkv kernel dS is computed while they accumulate dV.
// Registers an MMA in flight reads or writes are not touched until the wait that retires it:
// y after the second wait, acc1/acc2 and the fragments after the last (pin_* keep the compiler
// from moving accesses across the waits or reusing the fragments' registers early).
template <class T, int D, bool kDkv>
__device__ __forceinline__ void backward_step(const BackwardSmem<D, kDkv>& sm, int stage,
                                              uint32_t a1, uint32_t a2, ThreadRows tr, int col0,
                                              int seq_len, bool mask, float scale_log2,
                                              const float* stats, const float (&lse2)[2],
                                              const float (&dlt)[2], float (&acc1)[D / 2],
                                              float (&acc2)[D / 2]) {
  using C = Sm90Backward<D, kDkv>;
  float x[C::kCols / 2], y[C::kCols / 2];
  wgmma_fence();  // orders this thread's earlier register reads/writes before the MMAs
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, C::kCols>(x, k_major(a1, C::kRowPanelBytes, kk),
                          k_major(sm.c1(stage), C::kColPanelBytes, kk), kk > 0);
  wgmma_commit();
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    wgmma_ss<T, C::kCols>(y, k_major(a2, C::kRowPanelBytes, kk),
                          k_major(sm.c2(stage), C::kColPanelBytes, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<1>();  // S is in; dP may still run
  pin_registers(x);
  probabilities<C::kCols, kDkv>(x, tr, col0, seq_len, mask, scale_log2, stats, lse2);
  // Plain arithmetic may move across the (volatile) waits: this keeps the exp2 of P before the
  // next one, under the dP MMA.
  pin_registers(x);
  AFragments<C::kColSteps> p, ds;
  to_a_fragments<T, C::kColSteps>(x, p);
  if constexpr (kDkv) {
    wgmma_fence();  // the P fragments are written: visible to the MMAs
#pragma unroll
    for (int kk = 0; kk < C::kColSteps; ++kk)
      wgmma_rs<T, D>(acc2, p[kk], mn_major(sm.c2(stage), C::kColPanelBytes, kk));  // dV += P^T dO
    wgmma_commit();
    wgmma_wait<1>();  // dP is in; dV may still run
  } else {
    wgmma_wait<0>();  // dP is in
  }
  pin_registers(y);
  score_gradients<C::kCols, kDkv>(x, y, tr, stats, dlt);
  to_a_fragments<T, C::kColSteps>(y, ds);
  wgmma_fence();  // the dS fragments are written: visible to the MMAs
#pragma unroll
  for (int kk = 0; kk < C::kColSteps; ++kk)
    wgmma_rs<T, D>(acc1, ds[kk], mn_major(sm.c1(stage), C::kColPanelBytes, kk));  // dK / dQ
  wgmma_commit();
  wgmma_wait<0>();
  pin_registers(acc1);
  if constexpr (kDkv) pin_registers(acc2);
  pin_fragments(p);
  pin_fragments(ds);
}

// What a block of either role needs: the tensor maps (pointers to the kernel's __grid_constant__
// parameters: they stay in parameter space, where the TMA unit reads them by address) with the
// place of their time/head/batch dimensions, and its outputs: out1 = dK (dkv) or dQ, scaled by
// `scale`; out2 = dV (dkv only). Optionally (bias_part non-null, H = Hkv) the column sums of
// each output over the block's rows, into row (b, row tile) of bias_part [B ceil(T / 128),
// 3 H D] at columns (bias_section + 0 / 1) H D + head D: sections 0 | 1 | 2 = dQ | dK | dV.
template <class T>
struct RoleArgs {
  BackwardMaps maps;
  BackwardSlots slots;
  T* out1;
  HeadLayout L1;
  T* out2;
  HeadLayout L2;
  float* bias_part;
  int bias_section;
};

// One block of the dk/dv role (kDkv) or of the dq role: block (bx, by) of that role's grid.
template <class T, int D, bool kDkv>
__device__ __forceinline__ void backward_block(const RoleArgs<T>& args, uint32_t smem_base,
                                               uint32_t bars,
                                               float (*stats)[2 * Sm90Backward<D, kDkv>::kCols],
                                               const float* lse, const float* delta, int H,
                                               int group, int seq_len, float scale, int bx, int by,
                                               int grid_x, float* scratch) {
  using C = Sm90Backward<D, kDkv>;
  const BackwardSmem<D, kDkv> sm{smem_base, bars};
  const BackwardBlock<D, kDkv> blk =
      BackwardBlock<D, kDkv>::make(H, group, seq_len, bx, by, grid_x);
  const BackwardMaps& maps = args.maps;
  const BackwardSlots& slots = args.slots;
  // Thread 0 issues the first copies as soon as it has set up the barriers, so they are on their
  // way while the block loads lse/delta and meets at the __syncthreads (after which the other
  // threads may wait on the barriers).
  if (threadIdx.x == 0) {
    mbarrier_init(sm.rows_full(), 1);
    for (int s = 0; s < C::kStages; ++s) mbarrier_init(sm.col_full(s), 1);
    mbarrier_init_fence();
    mbarrier_arrive_expect_bytes(sm.rows_full(), 2 * C::kRowBytes);
    for (int p = 0; p < C::kPanels; ++p) {
      load_head_box(sm.r1() + p * C::kRowPanelBytes, maps.r1, slots.r1, sm.rows_full(), p * 64,
                    blk.row0, blk.row_head, blk.b);
      load_head_box(sm.r2() + p * C::kRowPanelBytes, maps.r2, slots.r2, sm.rows_full(), p * 64,
                    blk.row0, blk.row_head, blk.b);
    }
    load_columns<D, kDkv>(sm, blk, maps, slots, 0);
  }
  if constexpr (kDkv) load_column_stats<D, kDkv>(stats, blk, H, lse, delta, 0);
  __syncthreads();

  const int warpgroup = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int wg_row0 = blk.row0 + 64 * warpgroup;
  const ThreadRows tr{wg_row0 + 16 * warp + lane / 4, lane % 4};
  const bool active = wg_row0 < seq_len;  // else: nothing to compute or store, only the waits
  // This warpgroup's 64 rows in the first panel of R1 and R2 (64 rows x 128 bytes: 8 KB, a
  // multiple of the 1024-byte swizzle block); uniform(): the MMAs' descriptors built from them
  // stay in uniform registers.
  const uint32_t wg_offset = uint32_t(uniform(warpgroup)) * 64 * 128;
  const uint32_t a1 = sm.r1() + wg_offset, a2 = sm.r2() + wg_offset;
  const float scale_log2 = scale * kLog2e;
  // dq kernel: this thread's two rows' lse (times log2 e) and delta.
  float lse2[2] = {0.f, 0.f}, dlt[2] = {0.f, 0.f};
  if constexpr (!kDkv) {
    const int64_t base = (int64_t(blk.b) * H + blk.row_head) * seq_len;
    for (int half = 0; half < 2; ++half) {
      const int row = tr.r_lo + 8 * half;
      if (row < seq_len) {
        lse2[half] = lse[base + row] * kLog2e;
        dlt[half] = delta[base + row];
      }
    }
  }
  float acc1[D / 2], acc2[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) acc1[i] = acc2[i] = 0.f;
  mbarrier_wait(sm.rows_full(), 0);

#pragma unroll 1
  for (int i = 0; i < blk.steps; ++i) {
    if (i + 1 < blk.steps) {
      if (threadIdx.x == 0) load_columns<D, kDkv>(sm, blk, maps, slots, i + 1);
      if constexpr (kDkv) load_column_stats<D, kDkv>(stats, blk, H, lse, delta, i + 1);
    }
    const int stage = i % C::kStages, col0 = blk.col0(i);
    mbarrier_wait(sm.col_full(stage), uint32_t(i / C::kStages) & 1);
    // Tiles wholly outside the causal triangle of this warpgroup's rows are skipped (dkv: every
    // query before its first key; dq: every key after its last query); the mask is needed only
    // for tiles crossing the diagonal or T.
    const bool skip = kDkv ? col0 + C::kCols - 1 < wg_row0 : col0 > wg_row0 + 63;
    const bool mask =
        (kDkv ? col0 < wg_row0 + 63 : col0 + C::kCols - 1 > wg_row0) || col0 + C::kCols > seq_len;
    if (active && !skip)
      backward_step<T, D, kDkv>(sm, stage, a1, a2, tr, col0, seq_len, mask, scale_log2,
                                stats[stage], lse2, dlt, acc1, acc2);
    __syncthreads();  // stage i % 2 (tiles and stats) is free for step i + 2
  }
  // With bias sums: scratch [8 warps][kOuts D], then thread c < kOuts D adds output c / D's
  // column c % D over the 8 warps in order into the bias partials (uniform over the grid).
  constexpr int kOuts = kDkv ? 2 : 1;
  const bool sums = args.bias_part != nullptr;
  float* warp_sums = sums ? scratch + (threadIdx.x / 32) * kOuts * D : nullptr;
  store_acc_rows<T, D>(acc1, scale, tr, seq_len, active, args.out1, args.L1, blk.b, blk.row_head,
                       warp_sums);
  if constexpr (kDkv)
    store_acc_rows<T, D>(acc2, 1.f, tr, seq_len, active, args.out2, args.L2, blk.b, blk.row_head,
                         sums ? warp_sums + D : nullptr);
  if (!sums) return;
  __syncthreads();
  const int c = static_cast<int>(threadIdx.x);
  if (c >= kOuts * D) return;
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < C::kThreads / 32; ++w) total += scratch[w * kOuts * D + c];
  const int64_t row = int64_t(blk.b) * grid_x + blk.row0 / C::kRows;
  args.bias_part[row * 3 * int64_t(H) * D + int64_t(args.bias_section + c / D) * H * D +
                 int64_t(blk.row_head) * D + c % D] = total;
}

// Both roles in one launch (one launch and one tail instead of two): blocks with blockIdx.y <
// dkv_blocks_y (= B Hkv) are the dk/dv kernel's grid (ceil(T / 128), B Hkv), the rest the dq
// kernel's (ceil(T / 128), B H). Blocks start roughly in linear order, so the dq blocks fill the
// SMs as the dk/dv blocks drain. The roles share the block shape and the shared memory size.
// The maps: dkv_* = K, V (rows), Q, dO (columns); dq_* = Q, dO (rows), K, V (columns), each the
// [B, heads, T, D] view as a 4-D tensor map.
template <class T, int D>
__global__ void __launch_bounds__(Sm90Backward<D, true>::kThreads, 1) flash_backward_sm90_kernel(
    const __grid_constant__ CUtensorMap dkv_r1, const __grid_constant__ CUtensorMap dkv_r2,
    const __grid_constant__ CUtensorMap dkv_c1, const __grid_constant__ CUtensorMap dkv_c2,
    const __grid_constant__ CUtensorMap dq_r1, const __grid_constant__ CUtensorMap dq_r2,
    const __grid_constant__ CUtensorMap dq_c1, const __grid_constant__ CUtensorMap dq_c2,
    BackwardSlots dkv_slots, BackwardSlots dq_slots, const float* __restrict__ lse,
    const float* __restrict__ delta, T* __restrict__ dq, HeadLayout Ldq, T* __restrict__ dk,
    HeadLayout Ldk, T* __restrict__ dv, HeadLayout Ldv, int H, int group, int seq_len, float scale,
    int dkv_blocks_y, float* __restrict__ bias_part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Sm90Backward<D, true>;
  static_assert(C::kThreads == Sm90Backward<D, false>::kThreads &&
                    C::kSmemBytes == Sm90Backward<D, false>::kSmemBytes &&
                    C::kCols == Sm90Backward<D, false>::kCols,
                "both roles run in one launch: same block shape and shared memory");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t barriers[kBackwardBarriers];
  __shared__ float stats[C::kStages][2 * C::kCols];  // dkv: lse * log2 e | delta per column
  __shared__ float scratch[C::kThreads / 32 * 2 * D];  // each warp's bias sums (dkv: dK | dV)
  // The swizzle pattern repeats every 1024 bytes and TMA and the descriptors assume each panel
  // starts on such a boundary: round the dynamic buffer up (kSmemBytes has the slack).
  const uint32_t base = (smem_addr(smem_raw) + 1023u) & ~1023u, bars = smem_addr(barriers);
  const int bx = static_cast<int>(blockIdx.x), by = static_cast<int>(blockIdx.y);
  const int grid_x = static_cast<int>(gridDim.x);
  if (by < dkv_blocks_y) {
    const RoleArgs<T> args{{&dkv_r1, &dkv_r2, &dkv_c1, &dkv_c2}, dkv_slots, dk, Ldk, dv, Ldv,
                           bias_part, 1};
    backward_block<T, D, true>(args, base, bars, stats, lse, delta, H, group, seq_len, scale, bx,
                               by, grid_x, scratch);
  } else {
    const RoleArgs<T> args{{&dq_r1, &dq_r2, &dq_c1, &dq_c2}, dq_slots, dq, Ldq, nullptr, {},
                           bias_part, 0};
    backward_block<T, D, false>(args, base, bars, stats, lse, delta, H, group, seq_len, scale, bx,
                                by - dkv_blocks_y, grid_x, scratch);
  }
#else
  __trap();  // built without sm_90a code: the host side never launches this (runs_sm90_kernels)
#endif
}

// ---------------- host side ----------------
// The four tensor maps of one kernel: rows of kRows positions, columns of kCols.
struct KernelMaps {
  HeadMap r1, r2, c1, c2;
  BackwardSlots slots() const { return {r1.slots, r2.slots, c1.slots, c2.slots}; }
};
struct BackwardPlan {
  KernelMaps dkv, dq;
};

// Empty when the kernels apply to these (already checked) inputs, with the tensor maps in
// `plan`; otherwise the reason they do not.
template <int D>
std::string prepare_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                             BackwardPlan& plan) {
  using Dkv = Sm90Backward<D, true>;
  using Dq = Sm90Backward<D, false>;
  if (!runs_sm90_kernels(q.device().index))
    return "the device is not an sm_90 GPU (H100/H200) or this build holds no sm_90a code";
  if (q.size(2) > INT32_MAX - 2 * Dkv::kRows || q.size(0) * (q.size(1) + k.size(1)) > 65535)
    return "T must stay below 2^31 - 256 and B * (H + Hkv) at most 65535";
  if (!encode_head_map(plan.dkv.r1, k, Dkv::kRows) ||
      !encode_head_map(plan.dkv.r2, v, Dkv::kRows) ||
      !encode_head_map(plan.dkv.c1, q, Dkv::kCols) ||
      !encode_head_map(plan.dkv.c2, dout, Dkv::kCols) ||
      !encode_head_map(plan.dq.r1, q, Dq::kRows) || !encode_head_map(plan.dq.r2, dout, Dq::kRows) ||
      !encode_head_map(plan.dq.c1, k, Dq::kCols) || !encode_head_map(plan.dq.c2, v, Dq::kCols))
    return "the TMA unit cannot describe the q/k/v/dout views (strides must be positive multiples "
           "of 16 bytes, data 16-byte aligned)";
  return "";
}

template <class T, int D>
void launch_backward(const BackwardPlan& plan, const AttnShape& s, const Tensor& lse,
                     const Tensor& delta, double scale, const Tensor& dq, const Tensor& dk,
                     const Tensor& dv, const Tensor& bias_partials, cudaStream_t stream) {
  using C = Sm90Backward<D, true>;
  auto kernel = flash_backward_sm90_kernel<T, D>;
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(C::kSmemBytes)));
  const int dkv_blocks_y = static_cast<int>(s.B * s.Hkv);
  const dim3 grid(static_cast<unsigned>((s.T + C::kRows - 1) / C::kRows),
                  static_cast<unsigned>(s.B * s.Hkv + s.B * s.H));
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(
      plan.dkv.r1.map, plan.dkv.r2.map, plan.dkv.c1.map, plan.dkv.c2.map, plan.dq.r1.map,
      plan.dq.r2.map, plan.dq.c1.map, plan.dq.c2.map, plan.dkv.slots(), plan.dq.slots(),
      lse.data<float>(), delta.data<float>(), static_cast<T*>(dq.raw_data()), layout_of(dq),
      static_cast<T*>(dk.raw_data()), layout_of(dk), static_cast<T*>(dv.raw_data()), layout_of(dv),
      static_cast<int>(s.H), static_cast<int>(s.group()), static_cast<int>(s.T),
      static_cast<float>(scale), dkv_blocks_y,
      bias_partials.defined() ? bias_partials.data<float>() : nullptr);
  TESSERA_KERNEL_CHECK("flash_backward_sm90_kernel");
}

std::string prepare(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                    BackwardPlan& plan) {
  if (q.size(3) == 64) return prepare_backward<64>(q, k, v, dout, plan);
  if (q.size(3) == 128) return prepare_backward<128>(q, k, v, dout, plan);
  return "head size must be 64 or 128";
}

}  // namespace

std::string sm90_backward_unsupported(const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& dout) {
  BackwardPlan plan;
  return prepare(q, k, v, dout, plan);
}

bool launch_sm90_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                          const Tensor& lse, const Tensor& delta, double scale, const Tensor& dq,
                          const Tensor& dk, const Tensor& dv, const Tensor& bias_partials,
                          const AttnShape& s, cudaStream_t stream, std::string* why_not) {
  BackwardPlan plan;
  const std::string reason = prepare(q, k, v, dout, plan);
  if (!reason.empty()) {
    if (why_not) *why_not = reason;
    return false;
  }
  visit_attention(q.dtype(), s.D, [&](auto tag, auto dconst) {
    using T = decltype(tag);
    constexpr int D = decltype(dconst)::value;
    launch_backward<T, D>(plan, s, lse, delta, scale, dq, dk, dv, bias_partials, stream);
  });
  return true;
}

}  // namespace tessera::cuda::attention_detail
