// The Hopper (sm_90a) causal flash-attention forward: the FlashAttention-3 ideas written for this
// repository. attention.cu's flash_attention_forward sends bf16/f16, head size 64/128 here on an
// H100/H200 (see sm90_forward_unsupported) and keeps its mma.sync kernel everywhere else.
//
// Why a separate kernel: mma.sync reaches a fraction of Hopper's tensor-core rate (the kernel in
// attention.cu peaks near 85 TFLOP/s). The full rate needs warpgroup MMA (wgmma) reading its
// operands from shared memory through descriptors, fed by the TMA copy engine, with the loads
// running in a separate warpgroup so the tensor cores never wait for memory.
//
// Work: units of one (batch, head) and two query tiles of 128 (the longest and the shortest
// left, so that every unit does the same causal work; see ForwardSchedule). The grid is
// persistent: one block per SM walks over units blockIdx.x + k * gridDim.x (TileCursor), so the
// loads of the next unit overlap the end of the current one. 384 threads = 3 warpgroups.
//   warpgroup 0 (producer): gives most of its registers away (setmaxnreg) and one thread issues
//     the TMA copies: a query tile's Q once, then its K and V tiles of 128 keys into rings of
//     two or three stages (see kDeepRings), from the diagonal tile backwards
//     (the only tiles needing a mask come first); the ring runs on from one query tile to the next,
//     whose loads overlap the end of the current.
//   warpgroups 1, 2 (consumers): 64 queries each (wgmma's M). Per K/V tile:
//       S = Q K^T     wgmma m64n128k16, A = Q and B = K both from shared memory (K-major);
//       online softmax on the S registers (row max / sum across the 4 threads of a quad);
//       O += P V      wgmma m64nDk16 with A = P straight from registers (bf16/f16 pairs) and
//                     B = V from shared memory, MN-major (the transpose bit).
// Shared memory holds every tile as 128-byte-swizzled "panels" of 64 head dims (one 128-byte row
// per query or key); D = 128 uses two panels per tile, one TMA box each.
//
// Inside a consumer warpgroup the two MMAs of neighbouring tiles overlap the softmax
// (FlashAttention-3's intra-warpgroup pipelining): in the step for tile it it issues S(it) =
// Q K(it)^T and then O += P(it-1) V(it-1), waits only for S(it), runs the softmax of tile it
// while the tensor cores still accumulate O, then waits for O, rescales it and keeps P(it) for
// the next step. The two consumer warpgroups also take turns issuing their MMAs (ping-pong, see
// ConsumerState::await_turn), so one's softmax runs under the other's MMAs.
//
// mbarriers (a phase completes, and flips, when its expected arrivals and bytes are in; waits name
// the parity of the phase they wait for, see sm90::mbarrier_wait):
//   q_full[b]       1 arrival (the producer's expect_tx) + the bytes of a Q tile in buffer b;
//                   query tile j of the block (TileCursor::j) uses buffer j % 2, waited for
//                   with parity (j / 2) & 1.
//   q_empty[b]      one arrival per consumer warp once it no longer reads query tile j's Q (at
//                   its end); the producer waits for completion j / 2 - 1 before loading Q of
//                   tile j >= 2 into buffer j % 2.
//   k_full[s]       same for the K tile of stage s; v_full[s] for its V tile.
//   k_empty[s]      one arrival per consumer warp once its S(it) is complete (K is no longer
//                   read); v_empty[s] once its O += P V of that tile is complete. Separate, so
//                   the next K tile is loaded while the previous V tile is still being read.
//   turn[c]         the 4 warps of the other consumer warpgroup, once they issued their MMAs.
// Tile iteration `it` (0, 1, ... in processing order, counted over all query tiles of the block)
// uses K stage it % n for the (it / n)-th time, n = kKStages (V alike with kVStages):
// consumers wait for k_full with parity (it / n) & 1; the producer, before refilling a stage for
// use u = it / n >= 1, waits for completion number u - 1 of k_empty of that stage: parity
// (u - 1) & 1. Every consumer warp waits for both full barriers of every tile (even one it
// skips) before it arrives on the empties, so no copy into a stage can overlap a copy still
// landing there and no warp can arrive twice within one phase.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <string>

#include "tessera/kernels/cuda/attention_sm90_common.cuh"

namespace tessera::cuda::attention_detail {
namespace {
using namespace sm90;

template <int D>
struct Sm90Forward {
  // Two consumer warpgroups: while one runs its softmax the other's MMAs keep the tensor cores
  // busy. (A third, as FlashAttention-3 uses at D = 64, would leave 160 registers per thread:
  // S, two P register sets and O spill there.)
  static constexpr int kConsumers = 2;
  static constexpr int kRows = 64 * kConsumers;  // queries per block
  static constexpr int kKeys = 128;              // keys per K/V tile (wgmma N of S = Q K^T)
  // Deeper K/V rings (kDeepRings; false: 2 stages each, as first measured). With 2 stages a copy
  // gets about one step (one K/V tile of both warpgroups) between the release of its stage and
  // the MMA that reads it; one more stage adds a step. D = 64: 3 K and 3 V stages (2 x 16 + 6 x
  // 16 KiB). D = 128: 3 V stages but 2 K stages (2 x 32 + 5 x 32 = 224 KiB, the most one block
  // gets), V being the copy with less lead (its stage frees only after O += P V).
  static constexpr bool kDeepRings = true;
  static constexpr int kKStages = kDeepRings && D == 64 ? 3 : 2;
  static constexpr int kVStages = kDeepRings ? 3 : 2;
  static constexpr int kMaxStages = 3;  // barrier slots per ring
  // Consumer warpgroups take turns issuing their MMAs (see ConsumerState::await_turn).
  static constexpr bool kPingPong = true;
  // One block per SM walking over the units (see TileCursor), so that a unit's start (its Q and
  // first K/V copies) overlaps the end of the previous one; false: one block per unit, as
  // before (kept to compare the two on a GPU).
  static constexpr bool kPersistentGrid = true;
  // The producer issues its copies in the order their stages free up. With as many K as V
  // stages, K tile it + 1 goes before V tile it (FlashAttention-3's order): K(it + n) then waits
  // only for S(it), not also for O += P(it - 1) V(it - 1). With one V stage more, V(it) frees up
  // after K(it) and they go together. (kKeysAhead false: always together, as first measured.)
  static constexpr bool kKeysAhead = true;
  static constexpr int kValueLag = kKeysAhead && kVStages == kKStages ? 1 : 0;
  static constexpr int kThreads = 128 * (kConsumers + 1);
  static constexpr int kPanels = D / 64;  // 128-byte swizzle rows hold 64 16-bit elements
  static constexpr uint32_t kQPanelBytes = kRows * 128, kQBytes = kQPanelBytes * kPanels;
  static constexpr uint32_t kKvPanelBytes = kKeys * 128, kKvBytes = kKvPanelBytes * kPanels;
  // Two Q buffers (the next query tile's Q loads during the current one), the K and V rings, and
  // slack to align the start to 1024 bytes.
  static constexpr size_t kSmemBytes = 2 * kQBytes + size_t(kKStages + kVStages) * kKvBytes + 1024;
  // The launch gives every thread 65536 / 384 -> 168 registers; the producer keeps 24 and the
  // consumers take what it frees: 128 * 24 + 256 * 240 = 64512 <= 65536. (The consumers of
  // the D = 128 kernel use up to ~220.)
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static_assert(D == 64 || D == 128, "head size 64 or 128");
  static_assert(kQPanelBytes % 1024 == 0 && kKvPanelBytes % 1024 == 0,
                "every panel must start on a 1024-byte swizzle block");
};

// ---------------- the warpgroup MMAs (forms in attention_sm90_common.cuh) ----------------
// s (64 x 128 f32 per warpgroup) = Q (desc_q: 64 x 16, K-major) * K^T (desc_k: 128 keys x 16,
// K-major), plus s when `accumulate`.
template <class T>
__device__ __forceinline__ void wgmma_scores(float (&s)[64], uint64_t desc_q, uint64_t desc_k,
                                             int accumulate) {
  wgmma_ss<T, 128>(s, desc_q, desc_k, accumulate);
}

// o (64 x D f32 per warpgroup) += P (registers p: 64 x 16) * V (desc_v: 16 keys x D, MN-major).
template <class T, int D>
__device__ __forceinline__ void wgmma_pv(float (&o)[D / 2], const uint32_t (&p)[4],
                                         uint64_t desc_v) {
  wgmma_rs<T, D>(o, p, desc_v);
}

// ---------------- shared memory map ----------------
// 1024-aligned base: [Q buffer 0][Q buffer 1][K stages][V stages] (each tile kPanels panels);
// barriers apart.
template <int D>
struct ForwardSmem {
  using C = Sm90Forward<D>;
  uint32_t base, bars;  // shared addresses of the tiles and of the barriers
  __device__ uint32_t q(int buffer) const { return base + uint32_t(buffer) * C::kQBytes; }
  __device__ uint32_t k(int stage) const {
    return base + 2 * C::kQBytes + uint32_t(stage) * C::kKvBytes;
  }
  __device__ uint32_t v(int stage) const {
    return base + 2 * C::kQBytes + uint32_t(C::kKStages + stage) * C::kKvBytes;
  }
  __device__ uint32_t q_full(int buffer) const { return bars + 8 * buffer; }
  __device__ uint32_t q_empty(int buffer) const { return bars + 8 * (2 + buffer); }
  __device__ uint32_t turn(int consumer) const { return bars + 8 * (4 + consumer); }
  __device__ uint32_t k_full(int stage) const { return bars + 8 * (6 + stage); }
  __device__ uint32_t v_full(int stage) const { return bars + 8 * (6 + C::kMaxStages + stage); }
  __device__ uint32_t k_empty(int stage) const {
    return bars + 8 * (6 + 2 * C::kMaxStages + stage);
  }
  __device__ uint32_t v_empty(int stage) const {
    return bars + 8 * (6 + 3 * C::kMaxStages + stage);
  }
};
constexpr int kForwardBarriers = 6 + 4 * 3;

// The work of one launch: B * H heads, each split into units_per_head = ceil(q_tiles / 2) units
// of equal causal work: unit x of a head is query tile q_tiles - 1 - x (the longest) and then
// tile x (the middle tile of an odd q_tiles alone), together q_tiles + 1 K/V tiles. Kernel
// parameters, so that nothing of it takes a consumer register over the main loop.
struct ForwardSchedule {
  int H, group, seq_len, q_tiles, units_per_head, units;
};

// One query tile of a block: its first query, the K/V tiles it visits (its tile t = 0, 1, ...
// covers keys [(n_tiles - 1 - t) * 128, +128): the diagonal tile first) and the block-wide index
// of its first one (the K/V ring runs on from one query tile to the next).
struct WorkItem {
  int q0, n_tiles, first_it;
};

// A block's walk over its query tiles: units blockIdx.x, blockIdx.x + gridDim.x, ... (one unit
// per block when the grid has a block per unit, see kPersistentGrid), each unit's long tile and
// then its short one. Item j (counted over the whole walk) uses Q buffer j % 2; `ring` counts the
// K/V tiles of the items before it. Neighbouring blocks take neighbouring units, so the blocks
// running at any moment read the K/V of a few neighbouring heads (L2 keeps them).
struct TileCursor {
  int unit, second, j, ring;  // second: 0 the unit's long query tile, 1 its short one
  __device__ static TileCursor start() { return {int(blockIdx.x), 0, 0, 0}; }
  __device__ bool done(ForwardSchedule s) const { return unit >= s.units; }
  __device__ int head(ForwardSchedule s) const { return unit / s.units_per_head; }  // b H + h
  __device__ int q_tile(ForwardSchedule s) const {
    const int x = unit % s.units_per_head;
    return second ? x : s.q_tiles - 1 - x;
  }
  // Query tile q covers queries up to min(128 (q + 1), T) - 1: under the causal mask it visits
  // q + 1 K/V tiles of 128 keys (the last one only up to T).
  __device__ WorkItem item(ForwardSchedule s, int rows) const {
    const int q = q_tile(s);
    return {q * rows, q + 1, ring};
  }
  __device__ void advance(ForwardSchedule s) {
    const int x = unit % s.units_per_head;
    ring += q_tile(s) + 1;
    ++j;
    if (!second && x < s.q_tiles - 1 - x) {
      second = 1;
    } else {
      second = 0;
      unit += int(gridDim.x);
    }
  }
};

// ---------------- producer: one thread issues every copy ----------------
struct ForwardSlots {
  MapSlots q, k, v;
};

// The K (is_v false) or V tile `it` (block-wide count: stage it % n, used for the (it / n)-th
// time, n its ring's stages) of keys [key0, key0 + 128) of K/V head (b, h_kv), into its stage once
// the consumers released the stage's previous use.
template <int D>
__device__ __forceinline__ void produce_kv(const ForwardSmem<D>& sm, const CUtensorMap* map,
                                           MapSlots slots, bool is_v, int it, int key0, int h_kv,
                                           int b) {
  using C = Sm90Forward<D>;
  const int stages = is_v ? C::kVStages : C::kKStages;
  const int stage = it % stages, use = it / stages;
  const uint32_t full = is_v ? sm.v_full(stage) : sm.k_full(stage);
  const uint32_t tile = is_v ? sm.v(stage) : sm.k(stage);
  if (use > 0) mbarrier_wait(is_v ? sm.v_empty(stage) : sm.k_empty(stage), (use - 1) & 1);
  mbarrier_arrive_expect_bytes(full, C::kKvBytes);
  for (int p = 0; p < C::kPanels; ++p)
    load_head_box(tile + p * C::kKvPanelBytes, map, slots, full, p * 64, key0, h_kv, b);
}

// Each query tile's Q just before its K/V tiles, into Q buffer j % 2 once the consumers released
// that buffer's previous use (query tile j - 2): the producer runs up to two K/V tiles ahead of
// the consumers, so the next Q lands while they finish the current query tile -- and, with a
// persistent grid, the next unit's Q and first K/V tiles too. Within a query tile K may run one
// tile ahead of V (see kValueLag). `cur` lives in shared memory: the producer has 24 registers, and
// held there over the loop the cursor spilled to local memory.
template <int D>
__device__ __forceinline__ void produce_tiles(const ForwardSmem<D>& sm, ForwardSchedule s,
                                              TileCursor& cur, const CUtensorMap* q_map,
                                              const CUtensorMap* k_map, const CUtensorMap* v_map,
                                              const ForwardSlots& slots) {
  using C = Sm90Forward<D>;
  constexpr int lag = C::kValueLag;  // V tile t - lag follows K tile t
  for (cur = TileCursor::start(); !cur.done(s); cur.advance(s)) {
    const int buffer = cur.j % 2;
    if (cur.j >= 2) mbarrier_wait(sm.q_empty(buffer), (cur.j / 2 - 1) & 1);
    mbarrier_arrive_expect_bytes(sm.q_full(buffer), C::kQBytes);
    for (int p = 0; p < C::kPanels; ++p)
      load_head_box(sm.q(buffer) + p * C::kQPanelBytes, q_map, slots.q, sm.q_full(buffer), p * 64,
                    cur.item(s, C::kRows).q0, cur.head(s) % s.H, cur.head(s) / s.H);
    // Tile t of the query tile's q_tile + 1 holds keys [(q_tile - t) * 128, +128).
    for (int t = 0; t <= cur.q_tile(s) + lag; ++t) {
      if (t <= cur.q_tile(s))
        produce_kv(sm, k_map, slots.k, false, cur.ring + t, (cur.q_tile(s) - t) * C::kKeys,
                   cur.head(s) % s.H / s.group, cur.head(s) / s.H);
      if (t >= lag)
        produce_kv(sm, v_map, slots.v, true, cur.ring + t - lag,
                   (cur.q_tile(s) - t + lag) * C::kKeys, cur.head(s) % s.H / s.group,
                   cur.head(s) / s.H);
    }
  }
}

// ---------------- consumers ----------------
// Register layouts: see attention_sm90_common.cuh (S's registers are P's A operand in place).
struct SoftmaxRows {
  float m_lo = -INFINITY, m_hi = -INFINITY;  // running max of the scaled scores (log2 units)
  float l_lo = 0.f, l_hi = 0.f;              // this thread's part of the running sums
};

using Fragments = AFragments<8>;  // P of one tile: 8 k-steps of A-operand registers

// Issues S = Q K^T for this warpgroup's 64 queries (q_rows: their first row in Q's first panel);
// the caller fences, commits and waits.
template <class T, int D>
__device__ __forceinline__ void issue_scores(float (&s)[64], uint32_t q_rows, uint32_t k_tile) {
  using C = Sm90Forward<D>;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    // k-step kk = head dims 16kk..16kk+15: panel kk / 4, 32 bytes per step inside its rows.
    const uint32_t offset = uint32_t(kk % 4) * 32;
    const uint64_t desc_q =
        swizzle128_descriptor(q_rows + uint32_t(kk / 4) * C::kQPanelBytes + offset, 16, 1024);
    const uint64_t desc_k =
        swizzle128_descriptor(k_tile + uint32_t(kk / 4) * C::kKvPanelBytes + offset, 16, 1024);
    wgmma_scores<T>(s, desc_q, desc_k, kk > 0);
  }
}

// Issues O += P V; V's k-step kk is keys 16kk..16kk+15 = 16 rows of 128 bytes in each panel; the
// next 64 head dims are one panel further (leading offset), 8-row swizzle blocks 1024 bytes apart.
template <class T, int D>
__device__ __forceinline__ void issue_pv(float (&o)[D / 2], const Fragments& p, uint32_t v_tile) {
  using C = Sm90Forward<D>;
#pragma unroll
  for (int kk = 0; kk < C::kKeys / 16; ++kk)
    wgmma_pv<T, D>(o, p[kk],
                   swizzle128_descriptor(v_tile + uint32_t(kk) * 16 * 128, C::kKvPanelBytes, 1024));
}

// Masks the future (key > query) and keys past T, folds the tile into the running max and sums
// and leaves P = exp2(s * scale_log2 - new max) as 16-bit pairs in p (the A-operand layout
// above). The max is taken over the raw scores and scaled once, and the scaling is fused into the
// exponent's subtraction (one FFMA per score): this needs scale_log2 > 0, which the host checks.
// O is not touched (an MMA may still be accumulating it): corr_lo/hi return exp2(old max - new
// max), by which the caller rescales O once that MMA is done. A row's values live in the 4
// threads of a quad, so its max is reduced with two xor-shuffles.
template <class T>
__device__ __forceinline__ void softmax_tile(float (&s)[64], Fragments& p, SoftmaxRows& rows,
                                             bool mask, int key0, int r_lo, int seq_len,
                                             float scale_log2, float& corr_lo, float& corr_hi) {
  if (mask) {  // uniform over the warpgroup: only the diagonal tile and the one holding T
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int key = key0 + 8 * (i / 4) + 2 * t + i % 2;
      const int row = r_lo + 8 * ((i / 2) % 2);
      if (key > row || key >= seq_len) s[i] = -INFINITY;
    }
  }
  float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    if ((i / 2) % 2 == 0)
      mx_lo = fmaxf(mx_lo, s[i]);
    else
      mx_hi = fmaxf(mx_hi, s[i]);
  }
#pragma unroll
  for (int lane_mask = 1; lane_mask <= 2; lane_mask <<= 1) {
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, lane_mask));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, lane_mask));
  }
  // Running maxima in log2 units (scaled); -inf stays -inf.
  const float new_lo = fmaxf(rows.m_lo, mx_lo * scale_log2);
  const float new_hi = fmaxf(rows.m_hi, mx_hi * scale_log2);
  // A row with nothing visible yet keeps reference 0 so that no inf - inf appears.
  const float ref_lo = new_lo == -INFINITY ? 0.f : new_lo;
  const float ref_hi = new_hi == -INFINITY ? 0.f : new_hi;
  corr_lo = fast_exp2(rows.m_lo - ref_lo);
  corr_hi = fast_exp2(rows.m_hi - ref_hi);
  rows.m_lo = new_lo;
  rows.m_hi = new_hi;
  float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const bool lo = (i / 2) % 2 == 0;
    s[i] = fast_exp2(fmaf(s[i], scale_log2, -(lo ? ref_lo : ref_hi)));
    if (lo)
      sum_lo += s[i];
    else
      sum_hi += s[i];
  }
  rows.l_lo = rows.l_lo * corr_lo + sum_lo;
  rows.l_hi = rows.l_hi * corr_hi + sum_hi;
  to_a_fragments<T, 8>(s, p);
}

template <int N>
__device__ __forceinline__ void rescale_rows(float (&o)[N], float corr_lo, float corr_hi) {
#pragma unroll
  for (int i = 0; i < N; ++i) o[i] *= (i / 2) % 2 == 0 ? corr_lo : corr_hi;
}

// O / rowsum straight from registers (two elements per 32-bit store: row r_lo gets registers
// 4j, 4j+1 of each 8-column block j, row r_lo + 8 gets 4j+2, 4j+3) and the natural-log
// log-sum-exp of each row, as the mma.sync kernel writes them.
template <class T, int D>
__device__ __forceinline__ void store_rows(const float (&o)[D / 2], SoftmaxRows rows, int r_lo,
                                           int seq_len, T* out, const HeadLayout& Lo, int b, int h,
                                           float* lse_head) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int lane_mask = 1; lane_mask <= 2; lane_mask <<= 1) {
    rows.l_lo += __shfl_xor_sync(0xffffffffu, rows.l_lo, lane_mask);
    rows.l_hi += __shfl_xor_sync(0xffffffffu, rows.l_hi, lane_mask);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = r_lo + 8 * half;
    if (row >= seq_len) continue;
    const float l = half == 0 ? rows.l_lo : rows.l_hi, m = half == 0 ? rows.m_lo : rows.m_hi;
    const float inv = 1.f / l;
    T* dst = out + Lo.row(b, h, row) + 2 * t;
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
      *reinterpret_cast<uint32_t*>(dst + 8 * j) =
          pack2<T>(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
    if (t == 0) lse_head[row] = (m + log2f(l)) / kLog2e;
  }
}

// The state of one consumer warpgroup in one query tile: its queries, the running softmax and O.
template <int D>
struct ConsumerState {
  using C = Sm90Forward<D>;
  const ForwardSmem<D>& sm;
  WorkItem w;
  int turns;                // how many times the warpgroup waited for its turn, over all items
  int row0, r_lo, seq_len;  // the warpgroup's first query, this thread's rows r_lo and r_lo + 8
  uint32_t q_rows;          // the warpgroup's 64 rows of Q in shared memory
  float scale_log2;
  bool releases;  // lane 0 of its warp: arrives on the empties for the warp
  int consumer;   // 0 or 1
  bool pingpong;  // both warpgroups have queries below T and take turns
  float s[64], o[D / 2];
  SoftmaxRows rows;

  // Ping-pong (FlashAttention-3's inter-warpgroup schedule): a warpgroup issues its MMAs only
  // once the other has issued its previous ones, so the tensor cores alternate between them and
  // each one's softmax runs under the other's MMAs. turn(c) completes when the 4 warps of the
  // other warpgroup arrive; its k-th completion lets warpgroup c issue for the k-th time (parity
  // k & 1; the other cannot run two completions ahead, it needs this one's arrival in between).
  // In a query tile with ping-pong both warpgroups issue n_tiles + 1 times, so the alternation
  // runs on over the block's query tiles: warpgroup 1 arrives once when the block starts (see the
  // kernel), so that warpgroup 0 goes first, and both pass after every issue, the last of a query
  // tile included: warpgroup 0 starts the next query tile as soon as warpgroup 1 issued its last
  // O += P V, while warpgroup 1 still stores its rows. (The last arrivals of the block complete
  // phases nobody waits for.)
  __device__ void await_turn() {
    if (pingpong) mbarrier_wait(sm.turn(consumer), uint32_t(turns++) & 1);
  }
  __device__ void pass_turn() const {
    if (pingpong && releases) mbarrier_arrive(sm.turn(1 - consumer));
  }

  // Tile it of this query tile is block-wide tile w.first_it + it of the K/V ring.
  // Stage and phase parity of the K and V copies of tile it (the rings count over all query
  // tiles of the block).
  __device__ int k_stage(int it) const { return (w.first_it + it) % C::kKStages; }
  __device__ uint32_t k_parity(int it) const { return ((w.first_it + it) / C::kKStages) & 1; }
  __device__ int v_stage(int it) const { return (w.first_it + it) % C::kVStages; }
  __device__ uint32_t v_parity(int it) const { return ((w.first_it + it) / C::kVStages) & 1; }
  // The K and V tiles of tile it as the MMAs read them: their stage broadcast from lane 0
  // (sm90::uniform), so that the descriptors built from them stay in uniform registers. Only
  // where the whole warp runs (as the MMAs need anyway).
  __device__ uint32_t k_tile(int it) const { return sm.k(uniform(k_stage(it))); }
  __device__ uint32_t v_tile(int it) const { return sm.v(uniform(v_stage(it))); }
  __device__ int key0(int it) const { return (w.n_tiles - 1 - it) * C::kKeys; }
  __device__ bool needs_mask(int it) const {
    return key0(it) + C::kKeys - 1 > row0 || key0(it) + C::kKeys > seq_len;
  }
  __device__ void release_k(int it) const {
    if (releases) mbarrier_arrive(sm.k_empty(k_stage(it)));
  }
  __device__ void release_v(int it) const {
    if (releases) mbarrier_arrive(sm.v_empty(v_stage(it)));
  }
  // Once per query tile, after its q_full wait (so no warp arrives twice in one phase: the
  // producer refills the buffer, and a warp can pass the next q_full wait, only after all 8
  // arrived).
  __device__ void release_q(int buffer) const {
    if (releases) mbarrier_arrive(sm.q_empty(buffer));
  }
};

// The first tile the warpgroup reads: S, then its P into p (O is still zero).
template <class T, int D>
__device__ __forceinline__ void first_tile(ConsumerState<D>& c, int it, Fragments& p) {
  mbarrier_wait(c.sm.k_full(c.k_stage(it)), c.k_parity(it));
  c.await_turn();
  wgmma_fence();
  issue_scores<T, D>(c.s, c.q_rows, c.k_tile(it));
  wgmma_commit();
  c.pass_turn();
  wgmma_wait<0>();
  pin_registers(c.s);
  c.release_k(it);
  float corr_lo, corr_hi;  // 0: there is nothing to rescale yet
  softmax_tile<T>(c.s, p, c.rows, c.needs_mask(it), c.key0(it), c.r_lo, c.seq_len, c.scale_log2,
                  corr_lo, corr_hi);
}

// One pipelined step: S(it) and O += P(it-1) V(it-1) both issued; the softmax of tile it (into
// p_next) runs while the second still accumulates; then O is rescaled to the new max.
template <class T, int D>
__device__ __forceinline__ void next_tile(ConsumerState<D>& c, int it, Fragments& p,
                                          Fragments& p_next) {
  const int prev = it - 1;
  // Both waits first: no branch may separate the MMAs (ptxas would serialise them).
  mbarrier_wait(c.sm.k_full(c.k_stage(it)), c.k_parity(it));
  mbarrier_wait(c.sm.v_full(c.v_stage(prev)), c.v_parity(prev));
  c.await_turn();
  wgmma_fence();  // orders the register writes to o and p before both groups
  issue_scores<T, D>(c.s, c.q_rows, c.k_tile(it));
  wgmma_commit();
  issue_pv<T, D>(c.o, p, c.v_tile(prev));
  wgmma_commit();
  c.pass_turn();
  wgmma_wait<1>();  // groups complete in order: S(it) is in, O += P V may still run
  pin_registers(c.s);
  c.release_k(it);
  float corr_lo, corr_hi;
  softmax_tile<T>(c.s, p_next, c.rows, c.needs_mask(it), c.key0(it), c.r_lo, c.seq_len,
                  c.scale_log2, corr_lo, corr_hi);
  wgmma_wait<0>();
  pin_registers(c.o);
  pin_fragments(p);
  c.release_v(prev);
  rescale_rows(c.o, corr_lo, corr_hi);
}

// The last tile's O += P V.
template <class T, int D>
__device__ __forceinline__ void last_pv(ConsumerState<D>& c, int it, Fragments& p) {
  mbarrier_wait(c.sm.v_full(c.v_stage(it)), c.v_parity(it));
  c.await_turn();
  wgmma_fence();
  issue_pv<T, D>(c.o, p, c.v_tile(it));
  wgmma_commit();
  c.pass_turn();
  wgmma_wait<0>();
  pin_registers(c.o);
  pin_fragments(p);
  c.release_v(it);
}

// One consumer warpgroup in the block's current query tile (cur): 64 queries from
// w.q0 + 64 * consumer through every K/V tile of it. Returns the updated count of turn waits.
template <class T, int D>
__device__ __forceinline__ int consume_item(const ForwardSmem<D>& sm, ForwardSchedule sched,
                                            const TileCursor& cur, int consumer, int turns,
                                            float scale_log2, T* out, const HeadLayout& Lo,
                                            float* lse) {
  using C = Sm90Forward<D>;
  const WorkItem w = cur.item(sched, C::kRows);
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row0 = w.q0 + 64 * consumer, seq_len = sched.seq_len, buffer = uniform(cur.j % 2);
  ConsumerState<D> c{sm,
                     w,
                     turns,
                     row0,
                     row0 + 16 * warp + lane / 4,
                     seq_len,
                     sm.q(buffer) + uint32_t(consumer) * 64 * 128,
                     scale_log2,
                     lane == 0,
                     consumer,
                     C::kPingPong && w.q0 + 64 < seq_len};
#pragma unroll
  for (int i = 0; i < D / 2; ++i) c.o[i] = 0.f;
  // Tiles before `first` hold only keys after the warpgroup's last query (or it has no query
  // below T): waited for, so that their copies have landed, and released unread.
  const int n = w.n_tiles;
  const int first = row0 < seq_len ? max(0, n - 1 - (row0 + 63) / C::kKeys) : n;
  mbarrier_wait(sm.q_full(buffer), (cur.j / 2) & 1);
  for (int it = 0; it < first; ++it) {
    mbarrier_wait(sm.k_full(c.k_stage(it)), c.k_parity(it));
    mbarrier_wait(sm.v_full(c.v_stage(it)), c.v_parity(it));
    c.release_k(it);
    c.release_v(it);
  }
  if (first == n) {
    c.release_q(buffer);
    return c.turns;
  }
  // P alternates between two register sets (one is read by an MMA while the other is written),
  // so the loop runs two steps per trip.
  Fragments p_a, p_b;
  first_tile<T, D>(c, first, p_a);
  int it = first + 1;
  for (; it + 1 < n; it += 2) {
    next_tile<T, D>(c, it, p_a, p_b);
    next_tile<T, D>(c, it + 1, p_b, p_a);
  }
  if (it < n) {
    next_tile<T, D>(c, it, p_a, p_b);
    last_pv<T, D>(c, n - 1, p_b);
  } else {
    last_pv<T, D>(c, n - 1, p_a);
  }
  // Every S MMA of this query tile has completed (last_pv waited for all groups): Q's buffer
  // may take the query tile after next.
  c.release_q(buffer);
  const int bh = cur.head(sched);
  store_rows<T, D>(c.o, c.rows, c.r_lo, seq_len, out, Lo, bh / sched.H, bh % sched.H,
                   lse + int64_t(bh) * seq_len);
  return c.turns;
}

// q_map, k_map, v_map: the [B, heads, T, D] views as 4-D tensor maps (see encode_head_map), with
// the place of their time/head/batch dimensions in `slots`. __grid_constant__ keeps the maps in
// parameter space, where the TMA unit reads them by address.
template <class T, int D>
__global__ void __launch_bounds__(Sm90Forward<D>::kThreads, 1)
    flash_forward_sm90_kernel(const __grid_constant__ CUtensorMap q_map,
                              const __grid_constant__ CUtensorMap k_map,
                              const __grid_constant__ CUtensorMap v_map, ForwardSlots slots,
                              T* __restrict__ out, HeadLayout Lo, float* __restrict__ lse,
                              ForwardSchedule sched, float scale_log2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using C = Sm90Forward<D>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  __shared__ __align__(8) uint64_t barriers[kForwardBarriers];
  __shared__ TileCursor producer_cursor;
  // The swizzle pattern repeats every 1024 bytes and TMA and the descriptors assume each panel
  // starts on such a boundary: round the dynamic buffer up (kSmemBytes has the slack).
  const ForwardSmem<D> sm{(smem_addr(smem_raw) + 1023u) & ~1023u, smem_addr(barriers)};
  if (threadIdx.x == 0) {
    for (int j = 0; j < 2; ++j) {
      mbarrier_init(sm.q_full(j), 1);
      mbarrier_init(sm.q_empty(j), 4 * C::kConsumers);  // one arrival per consumer warp
    }
    for (int s = 0; s < C::kKStages; ++s) {
      mbarrier_init(sm.k_full(s), 1);
      mbarrier_init(sm.k_empty(s), 4 * C::kConsumers);
    }
    for (int s = 0; s < C::kVStages; ++s) {
      mbarrier_init(sm.v_full(s), 1);
      mbarrier_init(sm.v_empty(s), 4 * C::kConsumers);
    }
    for (int w = 0; w < C::kConsumers; ++w) mbarrier_init(sm.turn(w), 4);  // the other's 4 warps
    mbarrier_init_fence();
  }
  __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    release_registers<C::kProducerRegisters>();
    if (threadIdx.x == 0)
      produce_tiles<D>(sm, sched, producer_cursor, &q_map, &k_map, &v_map, slots);
    return;
  }
  claim_registers<C::kConsumerRegisters>();
  // Warpgroup 0 issues first (ConsumerState::await_turn): one arrival per warp of warpgroup 1.
  if (C::kPingPong && warpgroup == 2 && threadIdx.x % 32 == 0) mbarrier_arrive(sm.turn(0));
  int turns = 0;
#pragma unroll 1
  for (TileCursor cur = TileCursor::start(); !cur.done(sched); cur.advance(sched))
    turns =
        consume_item<T, D>(sm, sched, cur, uniform(warpgroup - 1), turns, scale_log2, out, Lo, lse);
#else
  __trap();  // built without sm_90a code: the host side never launches this (device_runs_sm90a)
#endif
}

// ---------------- host side ----------------
}  // namespace

// A [B, heads, T, D] view (unit D stride) as a 4-D tensor map read in boxes of 64 head dims x
// `rows` positions with the 128-byte swizzle (positions past T read as zeros). Dimension 0 is the
// head dim; time, head and batch follow in order of increasing stride (a head view of a fused
// [B, T, 3, H, D] projection steps over heads with a smaller stride than over time), so every
// stride spans the ones before it, as in the driver's description of a packed tensor. A
// dimension of size 1 is never stepped over and goes last. False when TMA cannot describe the
// view: strides must be positive multiples of 16 bytes below 2^40, the data 16-byte aligned.
bool encode_head_map(HeadMap& out, const Tensor& t, uint32_t rows) {
  struct Outer {
    int role;  // 0 time, 1 head, 2 batch
    int64_t size, stride;
  };
  Outer outer[3] = {
      {0, t.size(2), t.stride(2)}, {1, t.size(1), t.stride(1)}, {2, t.size(0), t.stride(0)}};
  int64_t span = t.size(3);  // elements spanned by the dims of size > 1
  for (const Outer& d : outer)
    if (d.size > 1) span = std::max(span, d.stride * d.size);
  for (Outer& d : outer)
    if (d.size == 1) d.stride = (span + 7) / 8 * 8;
  std::stable_sort(outer, outer + 3,
                   [](const Outer& a, const Outer& b) { return a.stride < b.stride; });

  cuuint64_t dims[4] = {cuuint64_t(t.size(3)), 0, 0, 0};
  cuuint64_t strides[3];
  cuuint32_t box[4] = {64, 1, 1, 1};
  int* slot_of[3] = {&out.slots.t, &out.slots.h, &out.slots.b};
  for (int i = 0; i < 3; ++i) {
    const Outer& d = outer[i];
    if (d.stride <= 0 || d.stride % 8 != 0 || d.stride >= (int64_t(1) << 39)) return false;
    dims[i + 1] = cuuint64_t(d.size);
    strides[i] = cuuint64_t(d.stride) * 2;
    if (d.role == 0) box[i + 1] = rows;
    *slot_of[d.role] = i + 1;
  }
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  if (reinterpret_cast<uintptr_t>(t.raw_data()) % 16 != 0) return false;
  return tensor_map_encoder()(&out.map, tensor_map_type(t.dtype()), 4,
                              const_cast<void*>(t.raw_data()), dims, strides, box, element_strides,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

namespace {
struct ForwardMaps {
  HeadMap q, k, v;
};

}  // namespace

// Whether `device` runs the sm_90a kernels, asked once per device (the answer cannot change).
bool runs_sm90_kernels(int device) {
  static std::array<std::atomic<int>, 64> known{};  // 0 not asked yet, 1 no, 2 yes
  if (device < 0 || device >= int(known.size()))
    return device_runs_sm90a(device, flash_forward_sm90_kernel<BFloat16, 128>);
  int answer = known[device].load(std::memory_order_relaxed);
  if (answer == 0) {
    answer = device_runs_sm90a(device, flash_forward_sm90_kernel<BFloat16, 128>) ? 2 : 1;
    known[device].store(answer, std::memory_order_relaxed);
  }
  return answer == 2;
}

namespace {

// Whether the D kernel's shared memory (static + dynamic) fits what `device` gives one block:
// with the deeper V ring the D = 128 kernel takes all 227 KiB of an H100. Asked once per device.
template <int D>
bool forward_smem_fits(int device) {
  static std::array<std::atomic<int>, 64> known{};  // 0 not asked yet, 1 no, 2 yes
  auto ask = [device] {
    cudaFuncAttributes attr{};
    int optin = 0;
    TESSERA_CUDA_CHECK(cudaFuncGetAttributes(&attr, flash_forward_sm90_kernel<BFloat16, D>));
    TESSERA_CUDA_CHECK(
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    return attr.sharedSizeBytes + Sm90Forward<D>::kSmemBytes <= size_t(optin);
  };
  if (device < 0 || device >= int(known.size())) return ask();
  int answer = known[device].load(std::memory_order_relaxed);
  if (answer == 0) {
    answer = ask() ? 2 : 1;
    known[device].store(answer, std::memory_order_relaxed);
  }
  return answer == 2;
}

// Empty when the kernel applies to these (already checked) inputs, with the tensor maps in
// `maps`; otherwise the reason it does not.
template <int D>
std::string prepare_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                            ForwardMaps& maps) {
  using C = Sm90Forward<D>;
  if (!runs_sm90_kernels(q.device().index))
    return "the device is not an sm_90 GPU (H100/H200) or this build holds no sm_90a code";
  if (!forward_smem_fits<D>(q.device().index))
    return "the kernel's " + std::to_string(C::kSmemBytes / 1024) +
           " KiB of shared memory exceed what this device gives one block";
  if (!(scale > 0.0) || !std::isfinite(scale))
    return "the scale must be positive and finite (the kernel takes the row max of the unscaled "
           "scores)";
  const int64_t units = q.size(0) * q.size(1) * ((q.size(2) + 2 * C::kRows - 1) / (2 * C::kRows));
  if (q.size(2) > INT32_MAX - C::kRows || units > INT32_MAX)
    return "T must stay below 2^31 - 128 and B * H * ceil(T / 256) below 2^31";
  if (!encode_head_map(maps.q, q, C::kRows) || !encode_head_map(maps.k, k, C::kKeys) ||
      !encode_head_map(maps.v, v, C::kKeys))
    return "the TMA unit cannot describe the q/k/v views (strides must be positive multiples of "
           "16 bytes, data 16-byte aligned)";
  return "";
}

template <class T, int D>
void launch_forward(const ForwardMaps& maps, const AttnShape& s, double scale, const Tensor& out,
                    const Tensor& lse, int device, cudaStream_t stream) {
  using C = Sm90Forward<D>;
  TESSERA_CUDA_CHECK(cudaFuncSetAttribute(flash_forward_sm90_kernel<T, D>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(C::kSmemBytes)));
  ForwardSchedule sched{};
  sched.H = static_cast<int>(s.H);
  sched.group = static_cast<int>(s.group());
  sched.seq_len = static_cast<int>(s.T);
  sched.q_tiles = static_cast<int>((s.T + C::kRows - 1) / C::kRows);
  sched.units_per_head = (sched.q_tiles + 1) / 2;
  sched.units = static_cast<int>(s.B * s.H) * sched.units_per_head;
  // Persistent: one block per SM (registers and shared memory allow no second one), each
  // walking over units blockIdx.x + k * gridDim.x.
  const int blocks =
      C::kPersistentGrid ? std::min(sched.units, multiprocessor_count(device)) : sched.units;
  flash_forward_sm90_kernel<T, D><<<blocks, C::kThreads, C::kSmemBytes, stream>>>(
      maps.q.map, maps.k.map, maps.v.map, ForwardSlots{maps.q.slots, maps.k.slots, maps.v.slots},
      static_cast<T*>(out.raw_data()), layout_of(out), lse.data<float>(), sched,
      static_cast<float>(scale) * kLog2e);
}

}  // namespace

std::string sm90_forward_unsupported(const Tensor& q, const Tensor& k, const Tensor& v,
                                     double scale) {
  ForwardMaps maps;
  if (q.size(3) == 64) return prepare_forward<64>(q, k, v, scale, maps);
  if (q.size(3) == 128) return prepare_forward<128>(q, k, v, scale, maps);
  return "head size must be 64 or 128";
}

bool launch_sm90_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                         const Tensor& out, const Tensor& lse, const AttnShape& s,
                         cudaStream_t stream, std::string* why_not) {
  ForwardMaps maps;
  std::string reason = "head size must be 64 or 128";
  if (s.D == 64 || s.D == 128)
    reason = s.D == 64 ? prepare_forward<64>(q, k, v, scale, maps)
                       : prepare_forward<128>(q, k, v, scale, maps);
  if (!reason.empty()) {
    if (why_not) *why_not = reason;
    return false;
  }
  visit_attention(q.dtype(), s.D, [&](auto tag, auto dconst) {
    launch_forward<decltype(tag), decltype(dconst)::value>(maps, s, scale, out, lse,
                                                           q.device().index, stream);
  });
  return true;
}

}  // namespace tessera::cuda::attention_detail
