// The shared harness of the kernel ladders (see ladder_harness.cuh).
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <stdexcept>

#include "ladder_harness.cuh"

namespace ladders {

void check_cuda(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return;
  char text[512];
  std::snprintf(text, sizeof text, "%s failed at %s:%d: %s (%s)", call, file, line,
                cudaGetErrorString(err), cudaGetErrorName(err));
  throw std::runtime_error(text);
}

static void check_cublas(cublasStatus_t status, const char* call) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(call) + " failed: cuBLAS status " +
                             std::to_string(status));
}

// Counter-based (element i of a stream depends only on seed and i) and cheap: the timed shapes
// need up to 4e8 values and a std::normal_distribution would take tens of seconds.
static uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
static uint64_t stream_bits(uint64_t seed, size_t i) {
  return splitmix64(seed * 0x100000001B3ull + i);
}

std::vector<bf16> random_bf16(size_t n, uint64_t seed, float mean, float std) {
  // Approximately normal: the sum of four 16-bit uniforms from one hash, centred and scaled to
  // unit variance (Irwin-Hall; the tails end at +-3.46 standard deviations).
  const float unit = std::sqrt(3.f) / 65536.f;
  std::vector<bf16> v(n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t h = stream_bits(seed, i);
    const float sum =
        float(h & 0xFFFF) + float((h >> 16) & 0xFFFF) + float((h >> 32) & 0xFFFF) + float(h >> 48);
    v[i] = __float2bfloat16_rn(mean + std * (sum - 2.f * 65535.f) * unit);
  }
  return v;
}

std::vector<float> random_f32(size_t n, uint64_t seed, float lo, float hi) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = lo + (hi - lo) * float(stream_bits(seed, i) >> 40) / float(1 << 24);
  return v;
}

std::vector<double> widen(const std::vector<bf16>& v) {
  std::vector<double> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = __bfloat162float(v[i]);
  return out;
}
std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

std::vector<int64_t> sample_indices(int64_t n, int count) {
  std::vector<int64_t> out;
  if (n <= count) {
    for (int64_t i = 0; i < n; ++i) out.push_back(i);
    return out;
  }
  for (int i = 0; i < count; ++i) out.push_back(i * (n - 1) / (count - 1));
  return out;
}

std::string strf(const char* format, ...) {
  char text[256];
  va_list args;
  va_start(args, format);
  std::vsnprintf(text, sizeof text, format, args);
  va_end(args);
  return text;
}

void ErrorStats::add(double got, double ref, int64_t where) {
  if (std::isnan(got) && !std::isnan(ref)) {
    if (unwritten++ == 0) worst = where, worst_got = got, worst_ref = ref;
    return;
  }
  max_ref = std::max(max_ref, std::fabs(ref));
  const double err = std::fabs(got - ref);
  if (!(err <= max_abs)) {  // also catches inf and NaN where the reference is NaN-free
    max_abs = std::isnan(err) ? INFINITY : err;
    if (unwritten == 0) worst = where, worst_got = got, worst_ref = ref;
  }
}

int sm_count() {
  static const int count = [] {
    int device = 0, n = 0;
    LADDER_CUDA(cudaGetDevice(&device));
    LADDER_CUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  }();
  return count;
}

// ---------------- ceilings and timing ----------------
static cublasHandle_t cublas() {
  static cublasHandle_t handle = [] {
    cublasHandle_t h = nullptr;
    check_cublas(cublasCreate(&h), "cublasCreate");
    return h;  // kept for the life of the process
  }();
  return handle;
}

void cublas_gemm_bf16(const bf16* a, const bf16* b, bf16* c, int M, int N, int K) {
  // cuBLAS is column-major: a row-major C = A B is the column-major C^T = B^T A^T, i.e. the
  // same memory with the operands swapped and no transposes.
  const float one = 1.f, zero = 0.f;
  check_cublas(cublasGemmEx(cublas(), CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &one, b, CUDA_R_16BF, N, a,
                            CUDA_R_16BF, K, &zero, c, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                            CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

__global__ void fill_hash_kernel(bf16* out, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    out[i] = __float2bfloat16_rn(float(h & 0xFFFF) / 65536.f - 0.5f);
  }
}

// Reads a buffer larger than L2 so that nothing of the previous call stays cached. Reading,
// not writing (cudaMemset), leaves clean lines: the timed call then does not pay for writing
// 50 MB of someone else's dirty lines back to memory. The buffer holds zeros, so the store
// never happens, but the compiler cannot drop the loads.
__global__ void evict_l2_kernel(const uint4* buffer, size_t n, unsigned* sink) {
  unsigned acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    acc ^= buffer[i].x ^ buffer[i].w;
  if (acc == 0x9E3779B9u) *sink = acc;
}

double time_ms(const std::function<void()>& launch) {
  // Larger than any L2 (H100: 50 MB).
  constexpr size_t kEvictBytes = size_t(256) << 20;
  static uint4* evict = [] {
    void* p = nullptr;
    LADDER_CUDA(cudaMalloc(&p, kEvictBytes + sizeof(uint4)));  // + room for the sink
    LADDER_CUDA(cudaMemset(p, 0, kEvictBytes + sizeof(uint4)));
    return static_cast<uint4*>(p);  // kept for the life of the process
  }();
  constexpr size_t kEvictWords = kEvictBytes / sizeof(uint4);
  cudaEvent_t start, stop;
  LADDER_CUDA(cudaEventCreate(&start));
  LADDER_CUDA(cudaEventCreate(&stop));
  auto once = [&] {
    evict_l2_kernel<<<4 * sm_count(), 256>>>(evict, kEvictWords,
                                             reinterpret_cast<unsigned*>(evict + kEvictWords));
    LADDER_CUDA(cudaEventRecord(start));
    launch();
    LADDER_CUDA(cudaEventRecord(stop));
    LADDER_CUDA(cudaEventSynchronize(stop));
    LADDER_LAUNCHED();
    float ms = 0;
    LADDER_CUDA(cudaEventElapsedTime(&ms, start, stop));
    return double(ms);
  };
  once();  // warm-up: module load, cuBLAS/cuDNN plans, caches of the production entries
  const double first = once();
  // About 150 ms of timed calls, at least 3 and at most 25.
  const int reps = std::clamp(int(150.0 / std::max(first, 1e-3)), 3, 25);
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) times.push_back(once());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::nth_element(times.begin(), times.begin() + reps / 2, times.end());
  return times[reps / 2];
}

const Ceilings& ceilings() {
  static const Ceilings c = [] {
    Ceilings r;
    int device = 0;
    cudaDeviceProp prop{};
    LADDER_CUDA(cudaGetDevice(&device));
    LADDER_CUDA(cudaGetDeviceProperties(&prop, device));
    r.device = prop.name;
    {
      const size_t bytes = size_t(1) << 30;
      DeviceArray<char> src(bytes), dst(bytes);
      src.zero();
      const double ms = time_ms([&] {
        LADDER_CUDA(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice));
      });
      r.copy_gbs = 2.0 * bytes / (ms * 1e-3) / 1e9;
    }
    {
      const int n = 8192;
      DeviceArray<bf16> a(size_t(n) * n), b(size_t(n) * n), out(size_t(n) * n);
      fill_hash_kernel<<<1024, 256>>>(a.get(), a.size(), 1u);
      fill_hash_kernel<<<1024, 256>>>(b.get(), b.size(), 2u);
      LADDER_LAUNCHED();
      const double ms = time_ms([&] { cublas_gemm_bf16(a.get(), b.get(), out.get(), n, n, n); });
      r.gemm_tflops = 2.0 * n * n * n / (ms * 1e-3) / 1e12;
    }
    std::printf(
        "ceilings on %s: device copy %.0f GB/s (read + write), cuBLAS bf16 GEMM 8192^3 "
        "%.1f TFLOP/s\n",
        r.device.c_str(), r.copy_gbs, r.gemm_tflops);
    return r;
  }();
  return c;
}

// ---------------- the ladder ----------------
static bool check_only_flag = false, own_kernels_only = false;
void set_check_only(bool on) { check_only_flag = on; }
bool check_only() { return check_only_flag; }
void set_own_kernels_only(bool on) { own_kernels_only = on; }

static std::vector<std::string>& mutable_rows() {
  static std::vector<std::string> rows;
  return rows;
}
const std::vector<std::string>& table_rows() { return mutable_rows(); }

Ladder::Ladder(std::string op, Workload workload, std::function<void()> poison, Check check)
    : op_(std::move(op)),
      w_(std::move(workload)),
      poison_(std::move(poison)),
      check_(std::move(check)) {
  std::printf("\n== %s  %s%s\n", op_.c_str(), w_.shape.c_str(),
              w_.timed ? "" : "  (check only: odd sizes, bounds)");
}

void Ladder::climb_library(const Rung& rung) {
  if (own_kernels_only) {
    std::printf("  %-48s left out (--own-kernels)\n", rung.name.c_str());
    return;
  }
  climb(rung);
}

void Ladder::climb(const Rung& rung) {
  if (!rung.needs.empty()) {
    std::printf("  %-48s n/a at this shape: needs %s\n", rung.name.c_str(), rung.needs.c_str());
    return;
  }
  poison_();
  if (rung.setup) rung.setup();
  rung.run();
  LADDER_LAUNCHED();
  LADDER_CUDA(cudaDeviceSynchronize());
  const std::vector<ErrorStats> stats = check_();
  const ErrorStats* worst = &stats.front();
  bool ok = true;
  for (const ErrorStats& s : stats) {
    if (s.unwritten > 0 || !(s.relative() <= w_.tolerance)) ok = false;
    if (s.unwritten > worst->unwritten || s.relative() > worst->relative()) worst = &s;
  }
  std::string rate = "checked";
  if (w_.timed) {
    const Ceilings& c = ceilings();
    const double ms = time_ms(rung.run);
    const bool compute = w_.flops > 0;
    const double value = compute ? w_.flops / (ms * 1e-3) / 1e12 : w_.bytes / (ms * 1e-3) / 1e9;
    const double fraction = value / (compute ? c.gemm_tflops : c.copy_gbs);
    char text[160];
    std::snprintf(text, sizeof text, "%9.3f ms %8.1f %-7s %5.1f%% of %s", ms, value,
                  compute ? "TFLOP/s" : "GB/s", 100 * fraction, compute ? "cuBLAS" : "copy");
    rate = text;
    std::snprintf(text, sizeof text, " | %.3f | %.1f %s | %.0f%% |", ms, value,
                  compute ? "TFLOP/s" : "GB/s", 100 * fraction);
    mutable_rows().push_back("| " + op_ + " | " + w_.shape + " | " + rung.name + text);
  }
  std::printf("  %-48s %s   abs err %.1e rel %.1e  %s\n", rung.name.c_str(), rate.c_str(),
              worst->max_abs, worst->relative(), ok ? "ok" : "MISMATCH");
  if (!ok) {
    ++failures_;
    for (const ErrorStats& s : stats)
      std::printf(
          "    %s: %lld unwritten, rel err %.2e (tolerance %.0e), worst at %lld: got %.6g "
          "expected %.6g\n",
          s.output.c_str(), static_cast<long long>(s.unwritten), s.relative(), w_.tolerance,
          static_cast<long long>(s.worst), s.worst_got, s.worst_ref);
  }
}

}  // namespace ladders
