// The one harness every kernel ladder uses: device buffers, random inputs rounded to the
// storage type (so the float64 reference sees exactly what the kernels see), comparison with
// that reference, timing with CUDA events, and the two ceilings every rate is printed next to:
// the device's copy bandwidth and cuBLAS's bf16 GEMM rate, measured once per process.
//
// A ladder is one operation computed by several numbered kernels ("rungs"), from the naive
// version to the production one. For each problem shape the ladder file builds the inputs
// once, then for every rung: poisons the outputs (NaN), runs the rung once, compares with the
// reference (a mismatch or an unwritten element fails the program), and on the timed shape
// measures it. See ladders/README.md for what each rung teaches.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace ladders {

using bf16 = __nv_bfloat16;

// Throws std::runtime_error naming the call and the CUDA error; the program reports it and
// exits non-zero (a kernel that faults leaves the context unusable, so nothing runs after).
void check_cuda(cudaError_t err, const char* call, const char* file, int line);
#define LADDER_CUDA(call) ::ladders::check_cuda((call), #call, __FILE__, __LINE__)
// After a launch: a bad configuration shows up here, a fault at the next synchronisation.
#define LADDER_LAUNCHED() \
  ::ladders::check_cuda(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// ---------------- device memory ----------------
// An owning device array of n elements (cudaMalloc: 256-byte aligned, so 128-bit loads from
// the start of the array are legal; from the start of a row only when the row length allows).
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(size_t n) : n_(n) { LADDER_CUDA(cudaMalloc(&ptr_, n * sizeof(T))); }
  ~DeviceArray() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  DeviceArray(DeviceArray&& o) noexcept : ptr_(o.ptr_), n_(o.n_) { o.ptr_ = nullptr; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  void upload(const std::vector<T>& host) const {
    LADDER_CUDA(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    LADDER_CUDA(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  std::vector<T> download(size_t offset, size_t count) const {  // elements [offset, +count)
    std::vector<T> host(count);
    LADDER_CUDA(cudaMemcpy(host.data(), ptr_ + offset, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  void copy_from(const DeviceArray& src) const {
    LADDER_CUDA(cudaMemcpy(ptr_, src.ptr_, n_ * sizeof(T), cudaMemcpyDeviceToDevice));
  }
  // All bits set: NaN for f32 and bf16, so an element a kernel forgets to write stays wrong.
  void poison() const { LADDER_CUDA(cudaMemset(ptr_, 0xFF, n_ * sizeof(T))); }
  void zero() const { LADDER_CUDA(cudaMemset(ptr_, 0, n_ * sizeof(T))); }

 private:
  T* ptr_ = nullptr;
  size_t n_ = 0;
};

// ---------------- host data ----------------
// About normal(mean, std) values from a seeded counter-based generator, rounded to bf16.
std::vector<bf16> random_bf16(size_t n, uint64_t seed, float mean = 0.f, float std = 1.f);
std::vector<float> random_f32(size_t n, uint64_t seed, float lo, float hi);  // uniform
std::vector<double> widen(const std::vector<bf16>& v);
std::vector<double> widen(const std::vector<float>& v);
// `count` indices spread evenly over [0, n), always including the first and the last (every
// index when n <= count): the rows, entries or queries the float64 reference is computed for.
std::vector<int64_t> sample_indices(int64_t n, int count);
// printf into a std::string (shape descriptions).
std::string strf(const char* format, ...) __attribute__((format(printf, 1, 2)));

// ---------------- comparison with the float64 reference ----------------
// Accumulates |got - ref| for one output. Relative error is norm-style: the largest absolute
// error over the largest |ref| of that output, so tiny reference values do not dominate.
struct ErrorStats {
  std::string output;
  double max_abs = 0, max_ref = 0;
  int64_t unwritten = 0;  // NaN where the reference is finite
  int64_t worst = -1;     // index (as the caller numbers them) of the largest error
  double worst_got = 0, worst_ref = 0;

  explicit ErrorStats(std::string name) : output(std::move(name)) {}
  void add(double got, double ref, int64_t where);
  double relative() const { return max_abs / (max_ref > 0 ? max_ref : 1e-30); }
};
using Check = std::function<std::vector<ErrorStats>()>;

// ---------------- ceilings and timing ----------------
struct Ceilings {
  std::string device;
  double copy_gbs = 0;     // cudaMemcpy device to device, bytes read + written per second
  double gemm_tflops = 0;  // cuBLAS bf16 GEMM, 8192^3, f32 accumulation
};
const Ceilings& ceilings();  // measured on first use, printed once

// cuBLAS bf16 GEMM in the ladders' layout: c[M, N] = a[M, K] @ b[K, N], row-major, f32
// accumulation (the GEMM ceiling, and a rung of the GEMM ladder to compare with).
void cublas_gemm_bf16(const bf16* a, const bf16* b, bf16* c, int M, int N, int K);

// Milliseconds per call of `launch` (median), each call timed alone with CUDA events after
// L2 has been emptied, so memory-bound kernels are measured against DRAM, not the cache.
double time_ms(const std::function<void()>& launch);

// ---------------- one ladder at one shape ----------------
struct Workload {
  std::string shape;        // printed, e.g. "rows=16384 C=1024 bf16"
  double bytes = 0;         // minimum DRAM traffic of one call (for GB/s), 0 for compute-bound
  double flops = 0;         // floating-point operations of one call (for TFLOP/s), 0 if none
  bool timed = false;       // false: a check-only shape (odd sizes, bounds)
  double tolerance = 1e-2;  // largest relative error accepted
};

struct Rung {
  std::string name;   // "v2 block per row, shared-memory tree"
  std::string needs;  // empty when the rung runs at this shape; else why not ("C % 8 == 0")
  std::function<void()> run;
  std::function<void()> setup = nullptr;  // after the poisoning, before the checked run
};

class Ladder {
 public:
  // poison: resets inputs that rungs overwrite and fills outputs with NaN;
  // check: compares the outputs with the float64 reference.
  Ladder(std::string op, Workload workload, std::function<void()> poison, Check check);
  void climb(const Rung& rung);
  // A rung whose kernel is not written here (Tessera's production entry, cuBLAS, cuDNN):
  // checked and timed alike, left out under --own-kernels.
  void climb_library(const Rung& rung);
  int failures() const { return failures_; }

 private:
  std::string op_;
  Workload w_;
  std::function<void()> poison_;
  Check check_;
  int failures_ = 0;
};

// --check-only: only the small odd shapes, untimed (fast enough for compute-sanitizer).
void set_check_only(bool on);
bool check_only();
// --own-kernels: only the rungs written here (racecheck of the ladders' own shared-memory
// code; test_cuda's racecheck covers the production kernels).
void set_own_kernels_only(bool on);

// Markdown rows of every timed rung so far (printed at the end for ladders/README.md).
const std::vector<std::string>& table_rows();

// ---------------- device helpers shared by the rungs ----------------
struct SumOp {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// All 32 lanes end with the reduction of their 32 values (butterfly: log2(32) shuffles).
template <class Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// The v2 way: every thread writes its value to shared memory, then half the threads add the
// other half's values, log2(blockDim) times, with a barrier between steps. blockDim.x must be
// a power of two and `scratch` hold blockDim.x floats. Every thread returns the result.
template <class Op>
__device__ float tree_reduce(float v, float* scratch, Op op) {
  scratch[threadIdx.x] = v;
  __syncthreads();
  for (unsigned half = blockDim.x / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half)
      scratch[threadIdx.x] = op(scratch[threadIdx.x], scratch[threadIdx.x + half]);
    __syncthreads();
  }
  const float result = scratch[0];
  __syncthreads();  // everyone has read scratch[0] before the caller reuses it
  return result;
}

// Online softmax statistics of a set of values: their max and the sum of exp(value - max).
// Two partial results merge by rescaling the smaller max's sum; an empty set has max = -inf
// and sum 0 (guarded, since exp(-inf - -inf) would be NaN).
struct MaxSum {
  float max = -INFINITY;
  float sum = 0.f;
};
__device__ __forceinline__ void online_add(MaxSum& s, float x) {
  if (x > s.max) {
    s.sum = s.sum * __expf(s.max - x) + 1.f;
    s.max = x;
  } else {
    s.sum += __expf(x - s.max);
  }
}
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.max, b.max);
  if (m == -INFINITY) return a;
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}
__device__ __forceinline__ MaxSum warp_merge(MaxSum s) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, s.max, offset),
                 __shfl_xor_sync(0xffffffffu, s.sum, offset)};
    s = merge(s, other);
  }
  return s;
}

__device__ __forceinline__ float f32(bf16 v) { return __bfloat162float(v); }

// Eight bf16 in one 128-bit load or store; p must be 16-byte aligned.
__device__ __forceinline__ void load8(const bf16* p, float out[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void store8(bf16* p, const float in[8]) {
  uint4 raw;
  __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

inline unsigned blocks_for(int64_t work, int per_block) {
  return static_cast<unsigned>((work + per_block - 1) / per_block);
}
int sm_count();

}  // namespace ladders
