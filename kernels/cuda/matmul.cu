// Batched matrix multiply through cuBLASLt (f32, f16, bf16 with true f32 accumulation; no
// TF32) and cublasGemmStridedBatchedEx (f64, and whatever cuBLASLt refuses). Row-major
// tensors are handed to column-major cuBLAS as their transposes (C^T = B^T A^T), so a
// transposed view is just the other op flag and no copy is made unless an operand's batch
// dims cannot be described by one stride.
//
// cuBLASLt plans (matmul descriptor, matrix layouts, the algorithm from
// cublasLtMatmulAlgoGetHeuristic) are cached per (device, dtypes, ops, sizes, leading
// dims, batch strides, pointer alignment, epilogue), so the steady state does no
// heuristic query. The Linear helpers of linear.h live here too: the same plans with a
// bias (CUBLASLT_EPILOGUE_BIAS) or bias-gradient (CUBLASLT_EPILOGUE_BGRADA) epilogue.
// gemm_tuning.h says how a plan's algorithm is autotuned among the heuristic's bit-identical
// candidates.
#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/dispatch.h"
#include "tessera/core/graph_capture.h"
#include "tessera/core/settings.h"
#include "tessera/kernels/cuda/common.cuh"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/cuda/gemm_tuning.h"
#include "tessera/kernels/cuda/linear.h"
#include "tessera/kernels/ops.h"

namespace tessera::cuda {

// One cuBLAS handle per (thread, device): handles are cheap to keep and not meant to be
// shared between threads that set different streams.
cublasHandle_t cublas_handle() {
  thread_local cublasHandle_t handles[64] = {};
  const int d = current_device();
  if (!handles[d]) TESSERA_CUBLAS_CHECK(cublasCreate(&handles[d]));
  return handles[d];
}

namespace {

cublasLtHandle_t cublaslt_handle() {
  thread_local cublasLtHandle_t handles[64] = {};
  const int d = current_device();
  if (!handles[d]) TESSERA_CUBLAS_CHECK(cublasLtCreate(&handles[d]));
  return handles[d];
}

// ---- operands as column-major cuBLAS sees them ----

// One operand: a column-major matrix of the transposed logical matrix.
struct GemmOperand {
  Tensor t;                   // possibly a contiguous copy of the input
  cublasOperation_t op = CUBLAS_OP_N;
  int64_t ld = 1;
  int64_t batch_stride = 0;
};

// Single stride over the batch dims (all broadcast -> 0), or -1 when none describes them.
int64_t batch_stride_of(const Tensor& t, int64_t batch_dims) {
  int64_t stride = -1, expected_next = -1;
  for (int64_t d = batch_dims - 1; d >= 0; --d) {
    const int64_t n = t.size(d), s = t.stride(d);
    if (n == 1) continue;
    if (stride < 0) {
      stride = s;
      expected_next = s * n;
    } else if (s == expected_next || (s == 0 && stride == 0)) {
      expected_next = s * n;
    } else {
      return -1;
    }
  }
  return stride < 0 ? 0 : stride;
}

// The logical matrix is [rows, cols] (last two dims); cuBLAS gets its transpose [cols, rows].
GemmOperand describe(const Tensor& in, int64_t batch_dims) {
  GemmOperand g;
  g.t = in;
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int64_t rows = g.t.size(-2), cols = g.t.size(-1);
    const int64_t sr = g.t.stride(-2), sc = g.t.stride(-1);
    const int64_t bs = batch_stride_of(g.t, batch_dims);
    if (bs >= 0) {
      if (sc == 1 || cols == 1) {  // row-major: as column-major it is already the transpose
        g.op = CUBLAS_OP_N;
        g.ld = std::max<int64_t>({sr, cols, 1});
        if (rows == 1) g.ld = std::max<int64_t>(cols, 1);
        g.batch_stride = bs;
        return g;
      }
      if (sr == 1 || rows == 1) {  // column-major (a transposed view): transpose it back
        g.op = CUBLAS_OP_T;
        g.ld = std::max<int64_t>({sc, rows, 1});
        if (cols == 1) g.ld = std::max<int64_t>(rows, 1);
        g.batch_stride = bs;
        return g;
      }
    }
    g.t = raw::contiguous(g.t);
  }
  TESSERA_FAIL("matmul (cuda): could not describe operand ", shape_str(in.shape()));
}

struct GemmTypes {
  cudaDataType_t data;
  cublasComputeType_t compute;
};

GemmTypes gemm_types(DType t, const char* op) {
  switch (t) {
    case DType::f32: return {CUDA_R_32F, CUBLAS_COMPUTE_32F};  // true fp32, no TF32 rounding
    case DType::f16: return {CUDA_R_16F, CUBLAS_COMPUTE_32F};
    case DType::bf16: return {CUDA_R_16BF, CUBLAS_COMPUTE_32F};
    case DType::f64: return {CUDA_R_64F, CUBLAS_COMPUTE_64F};
    default:
      TESSERA_FAIL(op, " (cuda): dtype ", dtype_name(t),
                   " is not supported (float32, float16, bfloat16, float64)");
  }
}

// C[.., M, N] = A[.., M, K] @ B[.., K, N] in cuBLAS's column-major terms:
// D^T[N, M] = op(B)[N, K] * op(A)[K, M], i.e. cuBLAS's "A" is our b and its "B" our a.
struct GemmProblem {
  GemmOperand a, b;
  int64_t M = 0, N = 0, K = 0, batch = 1;
  GemmTypes types{};
  const Tensor* out = nullptr;
};

GemmProblem make_problem(const char* op, const Tensor& a, const Tensor& b, const Tensor& out) {
  TESSERA_CHECK(a.dim() >= 2 && b.dim() == a.dim() && out.dim() == a.dim(), op,
                " (cuda): operands must have equal rank >= 2, got ", shape_str(a.shape()), " @ ",
                shape_str(b.shape()), " -> ", shape_str(out.shape()));
  TESSERA_CHECK(a.dtype() == b.dtype() && a.dtype() == out.dtype(), op, " (cuda): dtypes ",
                dtype_name(a.dtype()), ", ", dtype_name(b.dtype()), " -> ",
                dtype_name(out.dtype()), " must be equal");
  TESSERA_CHECK(a.device() == out.device() && b.device() == out.device(), op,
                " (cuda): operands on ", a.device().str(), ", ", b.device().str(), " -> ",
                out.device().str(), " must share one device");
  TESSERA_CHECK(out.is_contiguous(), op, " (cuda): output must be contiguous");
  GemmProblem p;
  p.M = a.size(-2);
  p.K = a.size(-1);
  p.N = b.size(-1);
  TESSERA_CHECK(b.size(-2) == p.K && out.size(-2) == p.M && out.size(-1) == p.N, op,
                " (cuda): shapes ", shape_str(a.shape()), " @ ", shape_str(b.shape()), " -> ",
                shape_str(out.shape()), " do not agree");
  p.types = gemm_types(out.dtype(), op);
  p.out = &out;
  if (out.numel() == 0 || p.K == 0) return p;
  const int64_t batch_dims = a.dim() - 2;
  p.batch = out.numel() / (p.M * p.N);
  p.a = describe(a, batch_dims);
  p.b = describe(b, batch_dims);
  TESSERA_CHECK(p.M <= INT32_MAX && p.N <= INT32_MAX && p.K <= INT32_MAX && p.batch <= INT32_MAX,
                op, " (cuda): dimensions over 2^31 are not supported, got ",
                shape_str(a.shape()), " @ ", shape_str(b.shape()));
  return p;
}

// The plain cuBLAS path: f64, and the fallback for layouts cuBLASLt refuses.
void gemm_strided_batched(const GemmProblem& p, cudaStream_t stream) {
  cublasHandle_t h = cublas_handle();
  TESSERA_CUBLAS_CHECK(cublasSetStream(h, stream));
  const float alpha32 = 1.f, beta32 = 0.f;
  const double alpha64 = 1.0, beta64 = 0.0;
  const bool f64 = p.types.data == CUDA_R_64F;
  const void* alpha = f64 ? static_cast<const void*>(&alpha64) : &alpha32;
  const void* beta = f64 ? static_cast<const void*>(&beta64) : &beta32;
  TESSERA_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      h, p.b.op, p.a.op, static_cast<int>(p.N), static_cast<int>(p.M), static_cast<int>(p.K),
      alpha, p.b.t.raw_data(), p.types.data, static_cast<int>(p.b.ld), p.b.batch_stride,
      p.a.t.raw_data(), p.types.data, static_cast<int>(p.a.ld), p.a.batch_stride, beta,
      p.out->raw_data(), p.types.data, static_cast<int>(p.N), p.M * p.N,
      static_cast<int>(p.batch), p.types.compute, CUBLAS_GEMM_DEFAULT));
}

// ---- cuBLASLt plans ----

constexpr size_t kWorkspaceBytes = size_t(32) << 20;

// 32 MiB of scratch per (device, stream), taken once with cudaMalloc and kept for the
// process (outside the caching allocator so its statistics stay those of tensors). Work on
// one stream is ordered, so one workspace per stream is never used by two GEMMs at once.
// Without memory for it, cuBLASLt runs with no workspace.
std::pair<void*, size_t> workspace(int device, cudaStream_t stream) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, void*> buffers;
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, inserted] = buffers.try_emplace({device, stream}, nullptr);
  if (inserted && cudaMalloc(&it->second, kWorkspaceBytes) != cudaSuccess) {
    cudaGetLastError();  // clear the failed allocation; go on without workspace
    it->second = nullptr;
  }
  return {it->second, it->second ? kWorkspaceBytes : 0};
}

// Largest power of two dividing the address, capped at 256: the heuristic's algorithm may
// rely on the alignment of the pointers it was chosen for.
int64_t alignment_of(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  if (v == 0) return 256;
  return std::min<int64_t>(256, static_cast<int64_t>(v & (~v + 1)));
}

// The operands of an epilogue. bias: none, BIAS (read, length N), BGRADA (written, length
// N). aux: the GELU input matrix, written by GELU_AUX(_BIAS) and read by DGELU, laid out like
// the output (our row-major [M, N] with aux_ld elements per
// row; cuBLASLt wants aux_ld a multiple of 8 and at least N).
struct Epilogue {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  void* bias = nullptr;
  cudaDataType_t bias_type = CUDA_R_32F;
  void* aux = nullptr;
  int64_t aux_ld = 0;
};

using PlanKey = std::array<int64_t, 22>;

// How many of the heuristic's candidates an autotuned plan compares (cuBLASLt 13 returned 8
// for GPT-2's shapes when asked for 16).
constexpr int kTuneCandidates = 8;

// Descriptors and algorithm for one cached problem. Never destroyed: like the handles they
// live as long as the thread (destroying them at exit could run after the CUDA runtime).
struct LtPlan {
  bool supported = false;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t layout_a = nullptr, layout_b = nullptr, layout_d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  // The heuristic's candidates in its order (algo is the first until tuned). A fixed array:
  // nvcc 13.0's front end fails on a std::vector member here.
  std::array<cublasLtMatmulAlgo_t, kTuneCandidates> candidates{};
  int candidate_count = 0;
  bool tuned = false;
};

cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                                   int64_t batch, int64_t batch_stride) {
  cublasLtMatrixLayout_t layout = nullptr;
  TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout, type, static_cast<uint64_t>(rows),
                                                  static_cast<uint64_t>(cols), ld));
  const int32_t count = static_cast<int32_t>(batch);
  TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
      layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  TESSERA_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
      layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride, sizeof(batch_stride)));
  return layout;
}

void set_epilogue_pointers(cublasLtMatmulDesc_t desc, const Epilogue& e) {
  if (e.bias) {
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                        &e.bias, sizeof(e.bias)));
  }
  if (e.aux) {
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &e.aux, sizeof(e.aux)));
  }
}

// Builds the descriptors and asks the heuristic once; an unsupported problem is cached too,
// so callers fall back without asking again.
LtPlan build_plan(const GemmProblem& p, const Epilogue& e, size_t workspace_bytes) {
  LtPlan plan;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.desc, p.types.compute, CUDA_R_32F));
  // cuBLASLt's A is our b ([N, K] after op), its B our a ([K, M] after op).
  const int32_t op_a = p.b.op, op_b = p.a.op;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSA,
                                                      &op_a, sizeof(op_a)));
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_TRANSB,
                                                      &op_b, sizeof(op_b)));
  const uint32_t epilogue = e.kind;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                      &epilogue, sizeof(epilogue)));
  if (e.bias) {
    const int32_t bias_type = e.bias_type;
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  if (e.aux) {
    TESSERA_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &e.aux_ld, sizeof(e.aux_ld)));
  }
  // The heuristic looks at the pointers' alignment; the real ones are set before each call.
  set_epilogue_pointers(plan.desc, e);
  const bool a_n = p.b.op == CUBLAS_OP_N, b_n = p.a.op == CUBLAS_OP_N;
  plan.layout_a = make_layout(p.types.data, a_n ? p.N : p.K, a_n ? p.K : p.N, p.b.ld, p.batch,
                              p.b.batch_stride);
  plan.layout_b = make_layout(p.types.data, b_n ? p.K : p.M, b_n ? p.M : p.K, p.a.ld, p.batch,
                              p.a.batch_stride);
  plan.layout_d = make_layout(p.types.data, p.N, p.M, p.N, p.batch, p.M * p.N);

  cublasLtMatmulPreference_t pref = nullptr;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t max_workspace = workspace_bytes;
  TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_workspace, sizeof(max_workspace)));
  // The heuristic sees no data pointers and assumes 256-byte alignment unless told: views
  // (slices, batch offsets) can start anywhere, so name the real alignments (part of the key).
  const std::pair<cublasLtMatmulPreferenceAttributes_t, const void*> aligned[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.b.t.raw_data()},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.a.t.raw_data()},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.out->raw_data()},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.out->raw_data()}};
  for (const auto& [attribute, ptr] : aligned) {
    const uint32_t bytes = static_cast<uint32_t>(alignment_of(ptr));
    TESSERA_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attribute, &bytes, sizeof(bytes)));
  }
  std::array<cublasLtMatmulHeuristicResult_t, kTuneCandidates> results{};
  int count = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      cublaslt_handle(), plan.desc, plan.layout_a, plan.layout_b, plan.layout_d, plan.layout_d,
      pref, kTuneCandidates, results.data(), &count);
  cublasLtMatmulPreferenceDestroy(pref);
  // NOT_SUPPORTED / INVALID_VALUE: cuBLASLt has no kernel for this combination (epilogue,
  // dtype, alignment, layout); the caller takes the plain path.
  if (status != CUBLAS_STATUS_NOT_SUPPORTED && status != CUBLAS_STATUS_INVALID_VALUE)
    TESSERA_CUBLAS_CHECK(status);
  if (status != CUBLAS_STATUS_SUCCESS) return plan;
  for (int i = 0; i < count; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS && results[i].workspaceSize <= workspace_bytes)
      plan.candidates[plan.candidate_count++] = results[i].algo;
  }
  plan.supported = plan.candidate_count > 0;
  if (plan.supported) plan.algo = plan.candidates[0];
  return plan;
}

// ---- autotuning among bit-identical candidates (gemm_tuning.h) ----

// The switches are read at their first use, not while the backend loads: a bad value is then
// the first GEMM's error naming the variable (a static initialiser's would end the program),
// and a setter called before that use wins. -1: not read yet.
std::atomic<int> autotune_state{-1};
bool autotune_enabled() {
  if (autotune_state.load() < 0) {
    int unread = -1;
    autotune_state.compare_exchange_strong(unread, setting_enabled(Setting::GemmAutotune) ? 1 : 0);
  }
  return autotune_state.load() == 1;
}
bool autotune_log() {
  static const bool on = setting_enabled(Setting::GemmAutotuneLog);
  return on;
}
std::atomic<int64_t> plans_tuned{0}, plans_changed{0}, candidates_rejected{0};

// A position-sensitive 64-bit fingerprint of a buffer's 32-bit words: each word is mixed with
// its index (splitmix64's finaliser), and the mixes are summed (the sum is the same in any
// order, so the atomics do not make it vary). Two buffers with one differing bit differ here
// but with a chance of 2^-64.
__global__ void fingerprint_words(const uint32_t* words, int64_t n, unsigned long long* out) {
  unsigned long long h = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    unsigned long long x = words[i] ^ (static_cast<unsigned long long>(i) * 0x9E3779B97F4A7C15ull);
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    h += x;
  }
  for (int offset = 16; offset > 0; offset /= 2) h += __shfl_down_sync(0xffffffffu, h, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, h);
}

size_t data_type_bytes(cudaDataType_t t) { return t == CUDA_R_32F ? 4 : t == CUDA_R_64F ? 8 : 2; }

// The buffers a GEMM with this epilogue writes: the output, and the bias gradient or the
// GELU input where the epilogue writes one.
std::vector<std::pair<const void*, size_t>> written_buffers(const GemmProblem& p,
                                                            const Epilogue& e) {
  std::vector<std::pair<const void*, size_t>> out{{p.out->raw_data(), p.out->nbytes()}};
  if (e.kind == CUBLASLT_EPILOGUE_BGRADA || e.kind == CUBLASLT_EPILOGUE_BGRADB)
    out.emplace_back(e.bias, static_cast<size_t>(p.N) * data_type_bytes(e.bias_type));
  if (e.kind == CUBLASLT_EPILOGUE_GELU_AUX || e.kind == CUBLASLT_EPILOGUE_GELU_AUX_BIAS)
    out.emplace_back(e.aux,
                     static_cast<size_t>(p.M * e.aux_ld * p.batch) * data_type_bytes(p.types.data));
  return out;
}

// Runs the plan's candidates on the call's operands (nothing else is read or written: the
// real call that follows overwrites what they wrote) and keeps the fastest of those that
// write the first pick's bits. Host-synchronous; only outside captures.
void tune_plan(LtPlan& plan, const GemmProblem& p, const Epilogue& e, void* ws, size_t ws_bytes,
               cudaStream_t stream) {
  plan.tuned = true;
  const auto& candidates = plan.candidates;
  const size_t count = static_cast<size_t>(plan.candidate_count);
  const auto buffers = written_buffers(p, e);
  for (const auto& buffer : buffers)
    if (buffer.second % 4 != 0 || reinterpret_cast<uintptr_t>(buffer.first) % 4 != 0) return;
  const float alpha = 1.f, beta = 0.f;
  auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(cublaslt_handle(), plan.desc, &alpha, p.b.t.raw_data(), plan.layout_a,
                          p.a.t.raw_data(), plan.layout_b, &beta, p.out->raw_data(), plan.layout_d,
                          p.out->raw_data(), plan.layout_d, &algo, ws, ws_bytes, stream);
  };
  static thread_local unsigned long long* sums[64] = {};
  unsigned long long*& sum = sums[current_device()];
  if (!sum) TESSERA_CUDA_CHECK(cudaMalloc(&sum, sizeof(unsigned long long)));
  auto fingerprint = [&] {
    unsigned long long combined = 0;
    for (const auto& buffer : buffers) {
      unsigned long long h = 0;
      TESSERA_CUDA_CHECK(cudaMemsetAsync(sum, 0, sizeof h, stream));
      const int64_t words = static_cast<int64_t>(buffer.second / 4);
      const int blocks = static_cast<int>(std::min<int64_t>((words + 255) / 256, 1024));
      if (blocks > 0)
        fingerprint_words<<<blocks, 256, 0, stream>>>(static_cast<const uint32_t*>(buffer.first),
                                                      words, sum);
      TESSERA_CUDA_CHECK(cudaGetLastError());
      TESSERA_CUDA_CHECK(cudaMemcpyAsync(&h, sum, sizeof h, cudaMemcpyDeviceToHost, stream));
      TESSERA_CUDA_CHECK(cudaStreamSynchronize(stream));
      combined = combined * 0x100000001B3ull + h;
    }
    return combined;
  };
  // Candidates are timed on a quiet device: under data parallelism the first backward, where
  // most plans are tuned, runs gradient exchanges on other streams, which would otherwise run
  // beside the timings (the ranks of a 2-GPU run had kept other plans than a one-GPU run).
  TESSERA_CUDA_CHECK(cudaDeviceSynchronize());
  if (run(candidates[0]) != CUBLAS_STATUS_SUCCESS) return;  // the real call reports it
  const unsigned long long reference = fingerprint();
  std::vector<size_t> same{0};
  for (size_t i = 1; i < count; ++i) {
    if (run(candidates[i]) != CUBLAS_STATUS_SUCCESS) continue;
    if (fingerprint() != reference) {
      ++candidates_rejected;
      continue;
    }
    same.push_back(i);
  }
  ++plans_tuned;
  if (same.size() < 2) return;
  cudaEvent_t start, stop;
  TESSERA_CUDA_CHECK(cudaEventCreate(&start));
  TESSERA_CUDA_CHECK(cudaEventCreate(&stop));
  auto time_calls = [&](const cublasLtMatmulAlgo_t& algo, int calls) {
    TESSERA_CUDA_CHECK(cudaEventRecord(start, stream));
    for (int r = 0; r < calls; ++r) TESSERA_CUBLAS_CHECK(run(algo));
    TESSERA_CUDA_CHECK(cudaEventRecord(stop, stream));
    TESSERA_CUDA_CHECK(cudaEventSynchronize(stop));
    float elapsed = 0;
    TESSERA_CUDA_CHECK(cudaEventElapsedTime(&elapsed, start, stop));
    return elapsed;
  };
  // An idle GPU clocks down (an H100 to 345 of 1980 MHz) and takes a while to clock up: the
  // first tuning of a process on each device first runs the first pick for kWarmMs (or 32,767
  // calls, doubling their number until then), so the timings below are taken at working
  // clocks. (Without it and with 3 rounds, one-GPU runs on the two cards of one host kept
  // different candidates for 2 of GPT-2 124M's 15 tuned plans; with it and 5 rounds, the same
  // for all 15.)
  constexpr float kWarmMs = 200.f;
  static std::array<std::atomic<bool>, 64> warmed{};
  if (!warmed[current_device()].exchange(true)) {
    float warm = 0.f;
    for (int calls = 1; warm < kWarmMs && calls <= 16384; calls *= 2)
      warm += time_calls(candidates[0], calls);
  }
  // Each candidate's best of kRounds timings of kRepeats calls, the candidates taking turns
  // in each round, so a drift of the clocks during the tuning favours none of them.
  constexpr int kRepeats = 3, kRounds = 5;
  std::vector<float> ms(same.size(), INFINITY);
  for (int round = 0; round < kRounds; ++round) {
    for (size_t k = 0; k < same.size(); ++k) {
      const cublasLtMatmulAlgo_t& algo = candidates[same[k]];
      if (round == 0) TESSERA_CUBLAS_CHECK(run(algo));  // warm-up
      ms[k] = std::min(ms[k], time_calls(algo, kRepeats));
    }
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  size_t best = 0;
  for (size_t k = 1; k < same.size(); ++k)
    if (ms[k] < ms[best]) best = k;
  if (best != 0) {
    ++plans_changed;
    plan.algo = candidates[same[best]];
  }
  if (autotune_log()) {
    std::fprintf(stderr,
                 "tessera gemm autotune: M %lld N %lld K %lld batch %lld ops %d%d epilogue %d: "
                 "first pick %.1f us, best %.1f us (candidate %zu; %zu of %zu write the same "
                 "bits)\n",
                 static_cast<long long>(p.M), static_cast<long long>(p.N),
                 static_cast<long long>(p.K), static_cast<long long>(p.batch),
                 static_cast<int>(p.a.op), static_cast<int>(p.b.op), static_cast<int>(e.kind),
                 1e3 * ms[0] / kRepeats, 1e3 * ms[best] / kRepeats, same[best], same.size(), count);
  }
}

// Runs the problem through cuBLASLt with the epilogue; false (nothing written) when
// cuBLASLt does not support it.
bool lt_matmul(const GemmProblem& p, const Epilogue& e, cudaStream_t stream) {
  if (p.types.data == CUDA_R_64F) return false;
  const int device = current_device();
  const auto [ws, ws_bytes] = workspace(device, stream);
  const int64_t flops = 2 * p.M * p.N * p.K * p.batch;
  // Part of the key, so a plan made with autotuning off keeps the heuristic's first pick.
  const bool autotune = autotune_enabled();
  const PlanKey key{device,
                    p.types.data,
                    p.b.op,
                    p.a.op,
                    p.M,
                    p.N,
                    p.K,
                    p.batch,
                    p.a.ld,
                    p.b.ld,
                    p.a.batch_stride,
                    p.b.batch_stride,
                    alignment_of(p.a.t.raw_data()),
                    alignment_of(p.b.t.raw_data()),
                    alignment_of(p.out->raw_data()),
                    e.kind,
                    e.bias_type,
                    alignment_of(e.bias),
                    alignment_of(e.aux),
                    e.aux_ld,
                    static_cast<int64_t>(ws_bytes),
                    autotune};
  thread_local std::map<PlanKey, LtPlan> plans;
  auto it = plans.find(key);
  if (it == plans.end()) it = plans.emplace(key, build_plan(p, e, ws_bytes)).first;
  LtPlan& plan = it->second;
  if (!plan.supported) return false;
  set_epilogue_pointers(plan.desc, e);
  if (!plan.tuned && (!autotune || plan.candidate_count < 2 || flops < int64_t(1e9)))
    plan.tuned = true;
  if (!plan.tuned && !graph_capture_underway()) tune_plan(plan, p, e, ws, ws_bytes, stream);
  const float alpha = 1.f, beta = 0.f;
  const cublasStatus_t status = cublasLtMatmul(
      cublaslt_handle(), plan.desc, &alpha, p.b.t.raw_data(), plan.layout_a, p.a.t.raw_data(),
      plan.layout_b, &beta, p.out->raw_data(), plan.layout_d, p.out->raw_data(), plan.layout_d,
      &plan.algo, ws, ws_bytes, stream);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    plan.supported = false;  // don't ask again for this key
    return false;
  }
  TESSERA_CUBLAS_CHECK(status);
  return true;
}

void matmul(const Tensor& a, const Tensor& b, const Tensor& out) {
  const GemmProblem p = make_problem("matmul", a, b, out);
  if (out.numel() == 0) return;
  KernelContext ctx(out);
  if (p.K == 0) {
    TESSERA_CUDA_CHECK(cudaMemsetAsync(out.raw_data(), 0, out.nbytes(), ctx.stream));
    return;
  }
  if (!lt_matmul(p, Epilogue{}, ctx.stream)) gemm_strided_batched(p, ctx.stream);
}

const bool registered = [] {
  kernel_table(DeviceType::CUDA).matmul = matmul;
  return true;
}();

// ---- Linear epilogues ----

std::atomic<bool> epilogues_enabled{true};
// On an H100 cuBLASLt's GELU epilogues beat a plain GEMM and a separate GELU pass both ways:
// GELU_AUX_BIAS in the forward, DGELU in the backward with the bias gradient summed by a
// column-sum pass over dpre (its DGELU_BGRAD GEMM was slower than the plain GEMM and
// gelu_backward_with_bias_grad: benchmarks/cuda/NOTES.md).
GeluEpilogues gelu_epilogues_from_environment() {
  const std::string value = setting_text(Setting::GeluEpilogues);  // validated: 1, forward or 0
  if (value == "0") return GeluEpilogues::none;
  return value == "forward" ? GeluEpilogues::forward : GeluEpilogues::both;
}
std::atomic<int> gelu_state{-1};  // a GeluEpilogues, read at first use as the switches above
GeluEpilogues gelu_epilogues() {
  if (gelu_state.load() < 0) {
    int unread = -1;
    gelu_state.compare_exchange_strong(unread, static_cast<int>(gelu_epilogues_from_environment()));
  }
  return static_cast<GeluEpilogues>(gelu_state.load());
}
std::atomic<int64_t> fused_calls{0}, fallback_calls{0};
std::atomic<int64_t> gelu_fused_calls{0}, gelu_fallback_calls{0};

cudaDataType_t bias_data_type(DType t) { return gemm_types(t, "linear").data; }

// A bias added to out [M, N]: [N], out's dtype (or f32 for a 16-bit out, as under autocast).
void check_bias(const char* op, const Tensor& bias, const Tensor& out) {
  if (!bias.defined()) return;
  const bool half_out = out.dtype() == DType::f16 || out.dtype() == DType::bf16;
  TESSERA_CHECK(bias.shape() == Shape{out.size(-1)}, op, " (cuda): bias of shape ",
                shape_str(bias.shape()), " for output ", shape_str(out.shape()));
  TESSERA_CHECK(bias.dtype() == out.dtype() || (half_out && bias.dtype() == DType::f32), op,
                " (cuda): bias dtype ", dtype_name(bias.dtype()), " for output dtype ",
                dtype_name(out.dtype()),
                " (expected the output's, or float32 for a 16-bit output)");
  TESSERA_CHECK(bias.device() == out.device(), op, " (cuda): bias on ", bias.device().str(),
                ", output on ", out.device().str());
}

// A tensor written beside out (the GELU input, a bias gradient): contiguous, `shape`, out's
// dtype and device.
void check_companion(const char* op, const char* name, const Tensor& t, const Shape& shape,
                     const Tensor& out) {
  TESSERA_CHECK(t.defined() && t.shape() == shape && t.dtype() == out.dtype() &&
                    t.device() == out.device() && t.is_contiguous(),
                op, " (cuda): ", name, " ",
                t.defined()
                    ? shape_str(t.shape()) + " " + dtype_name(t.dtype()) + " on " + t.device().str()
                    : std::string("undefined"),
                " must be contiguous ", shape_str(shape), " ", dtype_name(out.dtype()), " on ",
                out.device().str());
}

// cuBLASLt takes a GELU input matrix only with a leading dimension divisible by 8.
bool aux_ld_supported(int64_t ld) { return ld % 8 == 0; }

}  // namespace

void set_gemm_autotune_enabled(bool enabled) { autotune_state = enabled ? 1 : 0; }
bool gemm_autotune_enabled() { return autotune_enabled(); }
GemmTuningCounts gemm_tuning_counts() {
  return {plans_tuned.load(), plans_changed.load(), candidates_rejected.load()};
}

void set_linear_epilogues_enabled(bool enabled) { epilogues_enabled = enabled; }
void set_gelu_epilogues(GeluEpilogues which) { gelu_state = static_cast<int>(which); }
void set_gelu_epilogues_enabled(bool enabled) {
  set_gelu_epilogues(enabled ? GeluEpilogues::both : GeluEpilogues::none);
}
bool linear_epilogues_enabled() { return epilogues_enabled; }
LinearPathCounts linear_path_counts() { return {fused_calls.load(), fallback_calls.load()}; }
LinearPathCounts linear_gelu_path_counts() {
  return {gelu_fused_calls.load(), gelu_fallback_calls.load()};
}

void linear_forward(const Tensor& x2d, const Tensor& w, const Tensor& bias, const Tensor& out) {
  TESSERA_CHECK(x2d.dim() == 2 && w.dim() == 2, "linear_forward (cuda): x2d ",
                shape_str(x2d.shape()), " and w ", shape_str(w.shape()), " must be matrices");
  const GemmProblem p = make_problem("linear_forward", x2d, w, out);
  check_bias("linear_forward", bias, out);
  if (out.numel() == 0) return;
  KernelContext ctx(out);
  if (bias.defined() && p.K > 0 && epilogues_enabled) {
    const Tensor b = raw::contiguous(bias);
    const Epilogue e{CUBLASLT_EPILOGUE_BIAS, b.raw_data(), bias_data_type(b.dtype())};
    if (lt_matmul(p, e, ctx.stream)) {
      ++fused_calls;
      return;
    }
  }
  matmul(x2d, w, out);
  if (bias.defined()) {
    ops::binary_(BinaryOp::Add, out, bias);
    ++fallback_calls;
  }
}

void linear_weight_grad(const Tensor& x2d, const Tensor& g, const Tensor& dw,
                        const Tensor& dbias) {
  TESSERA_CHECK(x2d.dim() == 2 && g.dim() == 2, "linear_weight_grad (cuda): x2d ",
                shape_str(x2d.shape()), " and g ", shape_str(g.shape()), " must be matrices");
  const Tensor xT = raw::transpose(x2d, 0, 1);
  const GemmProblem p = make_problem("linear_weight_grad", xT, g, dw);
  if (dbias.defined()) {
    TESSERA_CHECK(dbias.shape() == Shape{p.N} && dbias.dtype() == g.dtype() &&
                      dbias.device() == g.device() && dbias.is_contiguous(),
                  "linear_weight_grad (cuda): dbias ", shape_str(dbias.shape()), " ",
                  dtype_name(dbias.dtype()), " on ", dbias.device().str(),
                  " must be contiguous [", p.N, "] ", dtype_name(g.dtype()), " on ",
                  g.device().str());
  }
  KernelContext ctx(dw);
  // The bias gradient as a column-sum pass of our own beside the plain GEMM where g allows:
  // cuBLASLt's BGRADA epilogue also runs it as a kernel of its own, slower (GPT-2 124M's
  // c_attn, g [16384, 2304] bf16: 40 us, 1.9 TB/s).
  if (dbias.defined() && dw.numel() > 0 && p.K > 0 && column_sums(g, dbias)) {
    matmul(xT, g, dw);
    ++fallback_calls;
    return;
  }
  // p.K is the number of rows M of x2d and g: the GEMM's k, over which BGRADA reduces g.
  if (dbias.defined() && dw.numel() > 0 && p.K > 0 && epilogues_enabled) {
    const Epilogue e{CUBLASLT_EPILOGUE_BGRADA, dbias.raw_data(), bias_data_type(dbias.dtype())};
    if (lt_matmul(p, e, ctx.stream)) {
      ++fused_calls;
      return;
    }
  }
  matmul(xT, g, dw);
  if (dbias.defined()) {
    kernel_table(DeviceType::CUDA).copy(dbias, ops::sum(g, {0}));
    ++fallback_calls;
  }
}

void linear_gelu_forward(const Tensor& x2d, const Tensor& w, const Tensor& bias, const Tensor& out,
                         const Tensor& pre_activation) {
  const char* op = "linear_gelu_forward";
  TESSERA_CHECK(x2d.dim() == 2 && w.dim() == 2, op, " (cuda): x2d ", shape_str(x2d.shape()),
                " and w ", shape_str(w.shape()), " must be matrices");
  const GemmProblem p = make_problem(op, x2d, w, out);
  check_bias(op, bias, out);
  check_companion(op, "pre_activation", pre_activation, out.shape(), out);
  if (out.numel() == 0) return;
  KernelContext ctx(out);
  // The GEMM writes gelu(x2d @ w + bias) as its output and x2d @ w + bias as the aux matrix.
  if (p.K > 0 && epilogues_enabled && gelu_epilogues() != GeluEpilogues::none &&
      aux_ld_supported(p.N)) {
    const Tensor b = bias.defined() ? raw::contiguous(bias) : Tensor();
    const Epilogue e{b.defined() ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX,
                     b.defined() ? b.raw_data() : nullptr,
                     b.defined() ? bias_data_type(b.dtype()) : CUDA_R_32F,
                     pre_activation.raw_data(), p.N};
    if (lt_matmul(p, e, ctx.stream)) {
      ++gelu_fused_calls;
      return;
    }
  }
  linear_forward(x2d, w, bias, pre_activation);
  kernel_table(DeviceType::CUDA).unary(UnaryOp::Gelu, pre_activation, out);
  ++gelu_fallback_calls;
}

void linear_input_grad_dgelu(const Tensor& g, const Tensor& w, const Tensor& pre_activation,
                             const Tensor& dpre, const Tensor& dbias) {
  const char* op = "linear_input_grad_dgelu";
  TESSERA_CHECK(g.dim() == 2 && w.dim() == 2, op, " (cuda): g ", shape_str(g.shape()), " and w ",
                shape_str(w.shape()), " must be matrices");
  // dpre [M, H] = g [M, N] @ wᵀ [N, H]: as a transposed view, wᵀ costs no copy.
  const Tensor wT = raw::transpose(w, 0, 1);
  const GemmProblem p = make_problem(op, g, wT, dpre);
  check_companion(op, "pre_activation", pre_activation, dpre.shape(), dpre);
  if (dbias.defined()) check_companion(op, "dbias", dbias, Shape{p.N}, dpre);
  KernelContext ctx(dpre);
  if (dpre.numel() == 0) {
    if (dbias.defined() && dbias.numel() > 0)
      TESSERA_CUDA_CHECK(cudaMemsetAsync(dbias.raw_data(), 0, dbias.nbytes(), ctx.stream));
    return;
  }
  // In cuBLASLt's terms the output is dpreᵀ [H, M]: DGELU scales it by gelu' of the aux
  // matrix laid out alike (pre_activation, row-major [M, H]) before its one rounding; the bias
  // gradient is then a column-sum pass over dpre.
  if (p.K > 0 && epilogues_enabled && gelu_epilogues() == GeluEpilogues::both &&
      aux_ld_supported(p.N)) {
    const Epilogue e{CUBLASLT_EPILOGUE_DGELU, nullptr, bias_data_type(dpre.dtype()),
                     pre_activation.raw_data(), p.N};
    if (lt_matmul(p, e, ctx.stream)) {
      if (dbias.defined() && !column_sums(dpre, dbias))
        kernel_table(DeviceType::CUDA).copy(dbias, ops::sum(dpre, {0}));
      ++gelu_fused_calls;
      return;
    }
  }
  // The GEMM writes dL/d act into dpre, turned into dL/d pre in place; the bias gradient is
  // summed in the same pass when the layout allows.
  matmul(g, wT, dpre);
  if (!dbias.defined() || !gelu_backward_with_bias_grad(pre_activation, dpre, dbias)) {
    kernel_table(DeviceType::CUDA).binary(BinaryOp::GeluBackward, pre_activation, dpre, dpre);
    if (dbias.defined()) kernel_table(DeviceType::CUDA).copy(dbias, ops::sum(dpre, {0}));
  }
  ++gelu_fallback_calls;
}

}  // namespace tessera::cuda
