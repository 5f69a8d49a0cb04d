// CUDA kernel benchmarks. Each reports its achieved rate (GB/s for memory-bound kernels,
// TFLOP/s for matrix work) and the fraction of the device ceiling measured at start-up in
// the same run: device-to-device copy bandwidth (bytes read + written) and the cuBLAS bf16
// GEMM rate at 8192^3. Timed with CUDA events, median of the repetitions.
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/dispatch.h"
#include "tessera/core/graph_capture.h"
#include "tessera/core/random.h"
#include "tessera/kernels/cuda/cudnn_attention.h"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/cuda/linear.h"
#include "tessera/kernels/fused_table.h"
#include "tessera/kernels/ops.h"

namespace tessera {
namespace {

KernelTable& gpu() { return kernel_table(DeviceType::CUDA); }
Tensor dev_randn(const Shape& s, DType t, double std = 1.0) {
  return normal(s, 0.0, std, {.dtype = t, .device = Device::cuda(0)});
}

// Milliseconds per call of fn, from events around `reps` back-to-back calls.
// The warm-up runs fn for at least 50 ms, so that the clocks have left their idle state and
// both sides of a comparison are timed on a busy GPU.
double time_ms(const std::function<void()>& fn, int reps = 20) {
  fn();  // handles, module load, allocator cache
  cuda::synchronize(0);
  for (auto t0 = std::chrono::steady_clock::now();
       std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(50);) {
    fn();
    cuda::synchronize(0);
  }
  cuda::Event start, stop;
  start.record(cuda::current_stream(0));
  for (int i = 0; i < reps; ++i) fn();
  stop.record(cuda::current_stream(0));
  stop.synchronize();
  return start.elapsed_ms(stop) / reps;
}

struct Ceilings {
  double copy_gbs = 0;       // bytes read + written per second, GB/s
  double gemm_tflops = 0;    // cuBLAS bf16
};

const Ceilings& ceilings() {
  static const Ceilings c = [] {
    Ceilings r;
    const int64_t n = int64_t{1} << 28;  // 1 GiB of f32
    Tensor a = dev_randn({n}, DType::f32), b = empty({n}, {.device = Device::cuda(0)});
    const double ms = time_ms([&] { gpu().copy(b, a); }, 10);
    r.copy_gbs = 2.0 * n * 4 / (ms * 1e-3) / 1e9;
    const int64_t m = 8192;
    Tensor x = dev_randn({m, m}, DType::bf16), y = dev_randn({m, m}, DType::bf16);
    Tensor z = empty({m, m}, {.dtype = DType::bf16, .device = Device::cuda(0)});
    const double gms = time_ms([&] { gpu().matmul(x, y, z); }, 10);
    r.gemm_tflops = 2.0 * m * m * m / (gms * 1e-3) / 1e12;
    std::printf("ceilings on %s: device copy %.0f GB/s, cuBLAS bf16 GEMM 8192^3 %.1f TFLOP/s\n",
                cuda::device_name(0).c_str(), r.copy_gbs, r.gemm_tflops);
    return r;
  }();
  return c;
}

// Runs fn under manual timing and reports GB/s (bytes moved) or TFLOP/s (flops) counters.
void run(benchmark::State& state, const std::function<void()>& fn, double bytes, double flops) {
  if (cuda_device_count() == 0) {
    state.SkipWithError("no CUDA device");
    return;
  }
  const Ceilings& c = ceilings();
  double ms = 0;
  for (auto _ : state) {
    ms = time_ms(fn, 10);
    state.SetIterationTime(ms * 1e-3);
  }
  state.counters["ms"] = ms;
  if (bytes > 0) {
    const double gbs = bytes / (ms * 1e-3) / 1e9;
    state.counters["GB/s"] = gbs;
    state.counters["of_copy_bw"] = gbs / c.copy_gbs;
  }
  if (flops > 0) {
    const double tf = flops / (ms * 1e-3) / 1e12;
    state.counters["TFLOP/s"] = tf;
    state.counters["of_cublas"] = tf / c.gemm_tflops;
  }
}

#define TESSERA_CUDA_BENCH(name) BENCHMARK(name)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond)

// ---- memory-bound kernels at GPT-2 124M training sizes (B*T = 16384 rows, C = 768) ----
constexpr int64_t kRows = 16384, kC = 768, kV = 50304;

void BM_copy_d2d(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t n = int64_t{1} << 27;
  Tensor a = dev_randn({n}, DType::f32), b = empty({n}, {.device = Device::cuda(0)});
  run(s, [&] { gpu().copy(b, a); }, 2.0 * n * 4, 0);
}
TESSERA_CUDA_BENCH(BM_copy_d2d);

void BM_cast_f32_to_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t n = int64_t{1} << 27;
  Tensor a = dev_randn({n}, DType::f32);
  Tensor b = empty({n}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  run(s, [&] { gpu().copy(b, a); }, n * 6.0, 0);
}
TESSERA_CUDA_BENCH(BM_cast_f32_to_bf16);

void BM_gelu_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t n = kRows * 4 * kC;
  Tensor a = dev_randn({n}, DType::bf16), b = empty({n}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  run(s, [&] { gpu().unary(UnaryOp::Gelu, a, b); }, n * 4.0, 0);
}
TESSERA_CUDA_BENCH(BM_gelu_bf16);

void BM_add_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t n = kRows * kC * 4;
  Tensor a = dev_randn({n}, DType::bf16), b = dev_randn({n}, DType::bf16);
  Tensor c = empty({n}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  run(s, [&] { gpu().binary(BinaryOp::Add, a, b, c); }, n * 6.0, 0);
}
TESSERA_CUDA_BENCH(BM_add_bf16);

// Layer norm at the GPT-2 size (16384 x 768: partly launch/latency-bound) and a large one.
// Bytes are the minimum traffic: x read and out written (forward), dy and x read and dx
// written (backward), plus the per-row statistics; the [C] parameters are negligible.
#define TESSERA_LN_SIZES ->Args({kRows, kC})->Args({65536, 1024})->ArgNames({"rows", "C"}) \
    ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond)

void BM_layer_norm_fwd_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t rows = s.range(0), C = s.range(1);
  Tensor x = dev_randn({rows, C}, DType::bf16), w = dev_randn({C}, DType::bf16), b = dev_randn({C}, DType::bf16);
  Tensor out = empty({rows, C}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  Tensor mean = empty({rows}, {.device = Device::cuda(0)}), rstd = empty({rows}, {.device = Device::cuda(0)});
  run(s, [&] { gpu().layer_norm(x, w, b, 1e-5, out, mean, rstd); }, rows * C * 4.0 + rows * 8.0, 0);
}
BENCHMARK(BM_layer_norm_fwd_bf16) TESSERA_LN_SIZES;

void BM_layer_norm_bwd_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t rows = s.range(0), C = s.range(1);
  Tensor x = dev_randn({rows, C}, DType::bf16), w = dev_randn({C}, DType::bf16), b = dev_randn({C}, DType::bf16);
  Tensor out = empty({rows, C}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  Tensor mean = empty({rows}, {.device = Device::cuda(0)}), rstd = empty({rows}, {.device = Device::cuda(0)});
  gpu().layer_norm(x, w, b, 1e-5, out, mean, rstd);
  Tensor dy = dev_randn({rows, C}, DType::bf16), dx = empty_like(x);
  Tensor dw = zeros({C}, {.dtype = DType::bf16, .device = Device::cuda(0)}), db = zeros_like(dw);
  run(s, [&] { gpu().layer_norm_backward(dy, x, w, mean, rstd, dx, dw, db); },
      rows * C * 2.0 * 3 + rows * 8.0, 0);
}
BENCHMARK(BM_layer_norm_bwd_bf16) TESSERA_LN_SIZES;

// The residual add of a pre-norm block and the layer norm after it (GPT-2's ln_1/ln_2/ln_f),
// fused (one kernel each way: FusedKernelTable::residual_layer_norm and
// layer_norm_backward_residual) and composed (the add, then the norm; the norm's backward, then
// the gradient of the residual stream added). Both report the fused form's minimum traffic
// (forward: x and residual read, sum and out written; backward: dy, the sum and dresidual read,
// dx written), so their GB/s compare as their speeds do. bias 1: the fused forms with a
// projection's deferred bias (x_bias forward, its gradient, dx's column sums, backward).
void BM_residual_layer_norm_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t rows = s.range(0), C = s.range(1);
  const bool fused = s.range(2) != 0, backward = s.range(3) != 0, with_bias = s.range(4) != 0;
  const TensorOptions like{.dtype = DType::bf16, .device = Device::cuda(0)};
  Tensor x = dev_randn({rows, C}, DType::bf16), r = dev_randn({rows, C}, DType::bf16);
  Tensor w = dev_randn({C}, DType::bf16), b = dev_randn({C}, DType::bf16);
  Tensor sum = empty({rows, C}, like), out = empty({rows, C}, like);
  Tensor mean = empty({rows}, {.device = Device::cuda(0)}), rstd = empty_like(mean);
  const Tensor xb = with_bias ? dev_randn({C}, DType::bf16) : Tensor();
  const FusedKernelTable& f = fused_kernel_table(DeviceType::CUDA);
  f.residual_layer_norm(x, r, xb, w, b, 1e-5, sum, out, mean, rstd);
  Tensor dy = dev_randn({rows, C}, DType::bf16), dres = dev_randn({rows, C}, DType::bf16);
  Tensor dx = empty({rows, C}, like), dw = zeros({C}, like), db = zeros_like(dw);
  const Tensor dxb = with_bias ? zeros({C}, like) : Tensor();
  std::function<void()> fn;
  if (!backward && fused)
    fn = [&] { f.residual_layer_norm(x, r, xb, w, b, 1e-5, sum, out, mean, rstd); };
  if (!backward && !fused)
    fn = [&] {
      gpu().binary(BinaryOp::Add, x, r, sum);
      gpu().layer_norm(sum, w, b, 1e-5, out, mean, rstd);
    };
  if (backward && fused)
    fn = [&] { f.layer_norm_backward_residual(dy, sum, w, mean, rstd, dres, dx, dw, db, dxb); };
  if (backward && !fused)
    fn = [&] {
      gpu().layer_norm_backward(dy, sum, w, mean, rstd, dx, dw, db);
      gpu().binary(BinaryOp::Add, dx, dres, dx);
    };
  run(s, fn, rows * C * 2.0 * 4 + rows * 8.0, 0);
}
BENCHMARK(BM_residual_layer_norm_bf16)
    ->ArgsProduct({{kRows}, {kC, 1280}, {1, 0}, {0, 1}, {0}})
    ->Args({kRows, kC, 1, 0, 1})
    ->Args({kRows, kC, 1, 1, 1})
    ->Args({kRows, 1280, 1, 1, 1})
    ->Args({65536, 1024, 1, 0, 0})
    ->Args({65536, 1024, 0, 0, 0})
    ->Args({65536, 1024, 1, 1, 0})
    ->Args({65536, 1024, 0, 1, 0})
    ->ArgNames({"rows", "C", "fused", "backward", "bias"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

// Softmax over rows of range(1): x read once, y written once.
template <DType kType>
void BM_softmax(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t rows = s.range(0), len = s.range(1);
  Tensor x = dev_randn({rows, len}, kType), y = empty_like(x);
  run(s, [&] { gpu().softmax(x, 1, false, y); }, rows * len * 2.0 * dtype_size(kType), 0);
}
// f32 rows of 1024: 12 * 1024 * 8 rows (attention-sized) and 262144 rows (1 GiB).
BENCHMARK(BM_softmax<DType::f32>)->Name("BM_softmax_f32")->Args({12 * 1024 * 8, 1024})
    ->Args({262144, 1024})->ArgNames({"rows", "len"})->UseManualTime()->Iterations(3)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_softmax<DType::bf16>)->Name("BM_softmax_bf16")->Args({65536, 4096})
    ->ArgNames({"rows", "len"})->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

void BM_cross_entropy_fwd_bwd_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t rows = 8192;
  Tensor logits = dev_randn({rows, kV}, DType::bf16);
  Tensor targets = randint(0, kV, {rows}, {.dtype = DType::i64, .device = Device::cuda(0)});
  Tensor loss = empty({}, {.device = Device::cuda(0)}), count = empty({}, {.dtype = DType::i64, .device = Device::cuda(0)});
  Tensor dl = empty_like(logits);
  run(s, [&] {
        gpu().cross_entropy(logits, targets, -100, loss, count);
        gpu().cross_entropy_backward(logits, targets, -100, 1.0 / rows, dl);
      },
      rows * kV * 2.0 * 3, 0);
}
TESSERA_CUDA_BENCH(BM_cross_entropy_fwd_bwd_bf16);

void BM_fused_classifier_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t rows = 8192;
  Tensor logits = dev_randn({rows, kV}, DType::bf16);
  Tensor targets = randint(0, kV, {rows}, {.dtype = DType::i64, .device = Device::cuda(0)});
  Tensor losses = empty({rows}, {.device = Device::cuda(0)});
  // In place: the first call turns logits into dlogits; later calls see other (finite) values.
  run(s, [&] { cuda::fused_classifier(logits, targets, -100, 1.0 / rows, losses); },
      rows * kV * 2.0 * 2, 0);
}
TESSERA_CUDA_BENCH(BM_fused_classifier_bf16);

void BM_adamw_124M(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  // 124M parameters as a few dozen tensors, f32 params and moments.
  std::vector<Tensor> p, g, m, v;
  std::vector<bool> decay;
  int64_t total = 0;
  for (int i = 0; i < 12 * 4 + 2; ++i) {
    const int64_t n = i < 2 ? kV * kC / 2 : 1769472;
    p.push_back(dev_randn({n}, DType::f32));
    g.push_back(dev_randn({n}, DType::f32, 1e-3));
    m.push_back(zeros({n}, {.device = Device::cuda(0)}));
    v.push_back(zeros({n}, {.device = Device::cuda(0)}));
    decay.push_back(true);
    total += n;
  }
  cuda::AdamWConfig cfg;
  cfg.lr = 3e-4f;
  cfg.weight_decay = 0.1f;
  run(s, [&] { cuda::multi_tensor_adamw(p, g, m, v, {}, decay, cfg); }, total * 4.0 * 7, 0);
}
TESSERA_CUDA_BENCH(BM_adamw_124M);

void BM_global_grad_norm(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  std::vector<Tensor> g;
  int64_t total = 0;
  for (int i = 0; i < 50; ++i) {
    g.push_back(dev_randn({2500000}, DType::f32));
    total += 2500000;
  }
  run(s, [&] { cuda::global_grad_norm(g); }, total * 4.0, 0);
}
TESSERA_CUDA_BENCH(BM_global_grad_norm);

// ---- matrix work ----
void BM_cublas_gemm_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t n = s.range(0);
  Tensor a = dev_randn({n, n}, DType::bf16), b = dev_randn({n, n}, DType::bf16);
  Tensor c = empty({n, n}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  run(s, [&] { gpu().matmul(a, b, c); }, 0, 2.0 * n * n * n);
}
BENCHMARK(BM_cublas_gemm_bf16)->Arg(4096)->Arg(8192)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

// The three GEMMs of a Linear (16384 rows) with the weight stored [in, out] (GPT-2's Conv1D
// layout, layout 0) or [out, in] (torch's nn.Linear, layout 1), as cuBLASLt sees them:
// range(0) = in, range(1) = out, range(2) = 0 forward y = x W, 1 input gradient g Wᵀ, 2 weight
// gradient (xᵀ g, or gᵀ x for layout 1), range(3) = layout.
void BM_linear_layouts_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t in = s.range(0), out = s.range(1), which = s.range(2);
  const bool torch_layout = s.range(3) == 1;
  const TensorOptions bf16{.dtype = DType::bf16, .device = Device::cuda(0)};
  Tensor x = dev_randn({kRows, in}, DType::bf16), g = dev_randn({kRows, out}, DType::bf16);
  Tensor w = torch_layout ? dev_randn({out, in}, DType::bf16, 0.02)
                          : dev_randn({in, out}, DType::bf16, 0.02);
  const Tensor w_io = torch_layout ? raw::transpose(w, 0, 1) : w;  // [in, out] either way
  Tensor y = empty({kRows, out}, bf16), dx = empty({kRows, in}, bf16), dw = empty_like(w);
  run(
      s,
      [&] {
        if (which == 0)
          gpu().matmul(x, w_io, y);
        else if (which == 1)
          gpu().matmul(g, raw::transpose(w_io, 0, 1), dx);
        else if (torch_layout)
          gpu().matmul(raw::transpose(g, 0, 1), x, dw);
        else
          gpu().matmul(raw::transpose(x, 0, 1), g, dw);
      },
      0, 2.0 * kRows * in * out);
}
BENCHMARK(BM_linear_layouts_bf16)
    ->ArgsProduct({{768}, {768, 2304, 3072}, {0, 1, 2}, {0, 1}})
    ->ArgsProduct({{3072}, {768}, {0, 1, 2}, {0, 1}})
    ->ArgNames({"in", "out", "gemm", "layout"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

// A Linear's weight gradient with its bias gradient, GPT-2 124M shapes (16384 rows): range(0)
// = K (inputs), range(1) = N (outputs), range(2) = 0: the GEMM alone (no bias), 1: with the
// bias gradient (Tessera's column sums beside the GEMM; cuBLASLt's BGRADA epilogue only where
// they do not apply). TFLOP/s counts the GEMM's flops only, so the rows show what the bias
// gradient costs.
void BM_linear_weight_grad_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t K = s.range(0), N = s.range(1), mode = s.range(2);
  Tensor x = dev_randn({kRows, K}, DType::bf16), g = dev_randn({kRows, N}, DType::bf16);
  Tensor dw = empty({K, N}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  Tensor db = mode == 0 ? Tensor() : empty({N}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  run(s, [&] { cuda::linear_weight_grad(x, g, dw, db); }, 0, 2.0 * kRows * K * N);
}
BENCHMARK(BM_linear_weight_grad_bf16)
    ->ArgsProduct({{768}, {768, 2304, 3072}, {0, 1}})
    ->Args({3072, 768, 0})
    ->Args({3072, 768, 1})
    ->ArgNames({"K", "N", "bias"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

// The hand-written GEMM (tensor_core_gemm: wgmma + TMA on an H100) next to cuBLASLt's
// (autotuned) on a square size and GPT-2 124M's c_fc forward [16384, 768] @ [768, 3072]:
// range(0..2) = M, K, N, range(3) = 0 cuBLASLt, 1 hand-written.
void BM_tensor_core_gemm_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t M = s.range(0), K = s.range(1), N = s.range(2);
  Tensor a = dev_randn({M, K}, DType::bf16), b = dev_randn({K, N}, DType::bf16);
  Tensor c = empty({M, N}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  run(s, [&] { s.range(3) ? cuda::tensor_core_gemm(a, b, c) : gpu().matmul(a, b, c); }, 0,
      2.0 * M * N * K);
}
BENCHMARK(BM_tensor_core_gemm_bf16)
    ->ArgsProduct({{4096}, {4096}, {4096}, {0, 1}})
    ->ArgsProduct({{16384}, {768}, {3072}, {0, 1}})
    ->ArgNames({"M", "K", "N", "own"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

// Causal attention, H=12 bf16, 8192 tokens per call: range(0) = D, range(1) = the
// implementation: 0 the hand-written flash kernels as dispatched (forward and backward: wgmma +
// TMA on an H100/H200), 1 cuDNN's fused attention (kernels/cuda/cudnn_attention.h), 2 the
// mma.sync flash kernels that other devices run; range(2) = T (B = 8192 / T: 8 x 1024, 1 x 8192).
struct AttentionCase {
  Tensor q, k, v, o, lse;
  double scale;
  bool cudnn, mma_sync;
  explicit AttentionCase(const benchmark::State& s) : cudnn(s.range(1) == 1), mma_sync(s.range(1) == 2) {
    const int64_t T = s.range(2), B = 8192 / T, H = 12, D = s.range(0);
    q = dev_randn({B, H, T, D}, DType::bf16), k = dev_randn({B, H, T, D}, DType::bf16);
    v = dev_randn({B, H, T, D}, DType::bf16), o = empty_like(q);
    lse = empty({B, H, T}, {.device = Device::cuda(0)});
    scale = 1.0 / std::sqrt(double(D));
  }
  void forward() {
    if (cudnn) cuda::cudnn_attention_forward(q, k, v, scale, o, lse);
    else if (mma_sync) cuda::flash_attention_forward_mma_sync(q, k, v, scale, o, lse);
    else cuda::flash_attention_forward(q, k, v, scale, o, lse);
  }
  double matmul_flops(double per_pair) const {  // causal: half of the T*T pairs
    return per_pair * q.size(0) * q.size(1) * q.size(2) * q.size(2) * q.size(3);
  }
};

bool skip_attention(benchmark::State& s) {
  std::string why;
  if (cuda_device_count() == 0) why = "no CUDA device";
  else if (s.range(1) == 1 && !cuda::cudnn_attention_available(&why)) why = "cuDNN attention: " + why;
  if (!why.empty()) s.SkipWithError(why.c_str());
  return !why.empty();
}

void BM_attention_fwd_bf16(benchmark::State& s) {
  if (skip_attention(s)) return;
  AttentionCase c(s);
  run(s, [&] { c.forward(); }, 0, c.matmul_flops(2.0));  // 4 T*T*D multiply-adds, halved
}
BENCHMARK(BM_attention_fwd_bf16)->ArgsProduct({{64, 128}, {0, 1, 2}, {1024, 8192}})
    ->ArgNames({"D", "impl", "T"})
    ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

void BM_attention_bwd_bf16(benchmark::State& s) {
  if (skip_attention(s)) return;
  AttentionCase c(s);
  c.forward();
  Tensor dout = dev_randn(c.q.shape(), DType::bf16);
  Tensor dq = empty_like(c.q), dk = empty_like(c.q), dv = empty_like(c.q);
  auto backward = [&] {
    if (c.cudnn) cuda::cudnn_attention_backward(c.q, c.k, c.v, c.o, dout, c.lse, c.scale, dq, dk, dv);
    else if (c.mma_sync)
      cuda::flash_attention_backward_mma_sync(c.q, c.k, c.v, c.o, dout, c.lse, c.scale, dq, dk, dv);
    else cuda::flash_attention_backward(c.q, c.k, c.v, c.o, dout, c.lse, c.scale, dq, dk, dv);
  };
  run(s, backward, 0, c.matmul_flops(5.0));  // 5 T*T*D matmul-equivalents, halved
}
BENCHMARK(BM_attention_bwd_bf16)->ArgsProduct({{64, 128}, {0, 1, 2}, {1024, 8192}})
    ->ArgNames({"D", "impl", "T"})
    ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

// The attention of one GPT-2 124M layer as the training step calls it: batch 16, q, k and v
// heads of one fused [B, T, 3, H, D] projection, the output and its gradient [B, T, H, D], the
// input gradients into one fused [B, T, 3, H, D] tensor (76 MB of inputs: they do not stay in
// L2 between calls as BM_attention_*'s 38 MB partly do). layout 0: the same shapes as
// contiguous [B, H, T, D] tensors, for the layout's share. impl: 0 ours, 1 cuDNN.
struct AttentionStepCase {
  Tensor q, k, v, o, lse, dout, dq, dk, dv;
  double scale = 0.125;
  bool cudnn;
  explicit AttentionStepCase(const benchmark::State& s, int64_t B = 16, int64_t T = 1024)
      : cudnn(s.range(1) == 1) {
    const int64_t H = 12, D = 64;
    const TensorOptions bf16{.dtype = DType::bf16, .device = Device::cuda(0)};
    auto heads = [&](const Tensor& fused, int64_t i) {  // [B, T, 3, H, D] -> [B, H, T, D] view
      return raw::transpose(raw::select(fused, 2, i), 1, 2);
    };
    auto bhtd = [&] { return empty({B, H, T, D}, bf16); };
    if (s.range(0) == 1) {
      const Tensor qkv = dev_randn({B, T, 3, H, D}, DType::bf16);
      const Tensor dqkv = empty({B, T, 3, H, D}, bf16);
      q = heads(qkv, 0), k = heads(qkv, 1), v = heads(qkv, 2);
      dq = heads(dqkv, 0), dk = heads(dqkv, 1), dv = heads(dqkv, 2);
      o = raw::transpose(empty({B, T, H, D}, bf16), 1, 2);
      dout = raw::transpose(dev_randn({B, T, H, D}, DType::bf16), 1, 2);
    } else {
      q = dev_randn({B, H, T, D}, DType::bf16), k = dev_randn({B, H, T, D}, DType::bf16);
      v = dev_randn({B, H, T, D}, DType::bf16), dout = dev_randn({B, H, T, D}, DType::bf16);
      o = bhtd(), dq = bhtd(), dk = bhtd(), dv = bhtd();
    }
    lse = empty({B, H, T}, {.device = Device::cuda(0)});
  }
  void forward() {
    if (cudnn) cuda::cudnn_attention_forward(q, k, v, scale, o, lse);
    else cuda::flash_attention_forward(q, k, v, scale, o, lse);
  }
  void backward() {
    if (cudnn) cuda::cudnn_attention_backward(q, k, v, o, dout, lse, scale, dq, dk, dv);
    else cuda::flash_attention_backward(q, k, v, o, dout, lse, scale, dq, dk, dv);
  }
  double matmul_flops(double per_pair) const {
    return per_pair * q.size(0) * q.size(1) * q.size(2) * q.size(2) * q.size(3);
  }
};

void BM_attention_step_fwd_bf16(benchmark::State& s) {
  if (skip_attention(s)) return;
  AttentionStepCase c(s);
  run(s, [&] { c.forward(); }, 0, c.matmul_flops(2.0));
}
void BM_attention_step_bwd_bf16(benchmark::State& s) {
  if (skip_attention(s)) return;
  AttentionStepCase c(s);
  c.forward();
  run(s, [&] { c.backward(); }, 0, c.matmul_flops(5.0));
}
// The backward at the step's 16384 tokens per call with the sequence length varied (batch
// 16384 / T, the fused layout): every T launches 3,072 blocks of 128 rows (8 row tiles x 192
// heads x 2 roles at T = 1024), whose walks grow with T (a causal block visits up to T / 128
// tiles). The time against the number of tile steps is a line whose intercept is what the
// blocks cost apart from their steps (start, first copies, stores, tail).
void BM_attention_tokens_bwd_bf16(benchmark::State& s) {
  if (skip_attention(s)) return;
  const int64_t T = s.range(2);
  AttentionStepCase c(s, 16384 / T, T);
  c.forward();
  run(s, [&] { c.backward(); }, 0, c.matmul_flops(5.0));
  const double tiles = static_cast<double>(T / 128);
  // Per (batch entry, head): T / 128 dk/dv and as many dq blocks, walking 1, ..., T / 128 tiles.
  s.counters["tile_steps"] = static_cast<double>(c.q.size(0) * c.q.size(1)) * tiles * (tiles + 1);
}
BENCHMARK(BM_attention_tokens_bwd_bf16)
    ->ArgsProduct({{1}, {0, 1}, {256, 512, 1024, 2048, 4096}})
    ->ArgNames({"layout", "impl", "T"})
    ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_attention_step_fwd_bf16)->ArgsProduct({{0, 1}, {0, 1}})->ArgNames({"layout", "impl"})
    ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_attention_step_bwd_bf16)->ArgsProduct({{0, 1}, {0, 1}})->ArgNames({"layout", "impl"})
    ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

// Attention over keys padded on the right (a BERT-style batch), forward + backward, B=8 H=12
// T=1024 bf16: the hand-written flash kernels (flash_masked_attention_*, mma.sync) against
// cuDNN's masked graphs, timed in the same run. range(0) = D, range(1) = causal. Row b holds
// T - 96 b real keys (1024 down to 352). TFLOP/s counts only the (query, real key) pairs each
// query attends to (under causal, also only keys up to the query), 7 matmuls of 2 D flops per
// pair (2 forward, 5 backward); cudnn_over_flash is cuDNN's time over the flash kernels' (above
// 1: the flash kernels are faster).
void BM_attention_padded_fwd_bwd_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) {
    s.SkipWithError("no CUDA device");
    return;
  }
  const int64_t B = 8, H = 12, T = 1024, D = s.range(0);
  const bool causal = s.range(1) == 1;
  const Tensor q = dev_randn({B, H, T, D}, DType::bf16), k = dev_randn({B, H, T, D}, DType::bf16),
               v = dev_randn({B, H, T, D}, DType::bf16),
               dout = dev_randn({B, H, T, D}, DType::bf16);
  const Tensor o = empty_like(q), dq = empty_like(q), dk = empty_like(q), dv = empty_like(q);
  const Tensor lse = empty({B, H, T}, {.device = Device::cuda(0)});
  std::vector<int32_t> lengths(B);
  double pairs = 0;  // (query, real key) pairs attended, per head
  for (int64_t b = 0; b < B; ++b) {
    lengths[b] = static_cast<int32_t>(T - 96 * b);
    for (int64_t i = 0; i < T; ++i)
      pairs += causal ? std::min<int64_t>(i + 1, lengths[b]) : lengths[b];
  }
  const Tensor kv_lengths =
      raw::to(from_vector(lengths, {B}, {.dtype = DType::i32}), Device::cuda(0), DType::i32);
  const double scale = 1.0 / std::sqrt(double(D)), flops = 14.0 * D * H * pairs;
  auto flash = [&] {
    cuda::flash_masked_attention_forward(q, k, v, scale, causal, kv_lengths, o, lse);
    cuda::flash_masked_attention_backward(q, k, v, o, dout, lse, scale, causal, kv_lengths, dq, dk,
                                          dv);
  };
  run(s, flash, 0, flops);
  std::string why;
  if (!cuda::cudnn_masked_attention_available(&why)) {
    std::printf("attention padded D %lld %s: cuDNN masked attention not available (%s)\n",
                static_cast<long long>(D), causal ? "causal" : "bidirectional", why.c_str());
    return;
  }
  const double flash_ms = time_ms(flash, 10);
  const double cudnn_ms = time_ms(
      [&] {
        cuda::cudnn_masked_attention_forward(q, k, v, scale, causal, kv_lengths, o, lse);
        cuda::cudnn_masked_attention_backward(q, k, v, o, dout, lse, scale, causal, kv_lengths, dq,
                                              dk, dv);
      },
      10);
  s.counters["cudnn_ms"] = cudnn_ms;
  s.counters["cudnn_TFLOP/s"] = flops / (cudnn_ms * 1e-3) / 1e12;
  s.counters["cudnn_over_flash"] = cudnn_ms / flash_ms;
  std::printf(
      "attention padded D %lld %s fwd+bwd (real-key flops only): flash %.3f ms %.1f TFLOP/s, "
      "cuDNN %.3f ms %.1f TFLOP/s, cuDNN / flash time %.2f\n",
      static_cast<long long>(D), causal ? "causal" : "bidirectional", flash_ms,
      flops / (flash_ms * 1e-3) / 1e12, cudnn_ms, flops / (cudnn_ms * 1e-3) / 1e12,
      cudnn_ms / flash_ms);
}
BENCHMARK(BM_attention_padded_fwd_bwd_bf16)
    ->ArgsProduct({{64, 128}, {0, 1}})
    ->ArgNames({"D", "causal"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

// ---- the bias paths of Linear at GPT-2 sizes: gradient (a column sum) and the add ----
void BM_bias_grad_column_sum_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t n = s.range(0);
  Tensor g = dev_randn({kRows, n}, DType::bf16), out = empty({n}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  run(s, [&] { gpu().reduce(ReduceOp::Sum, g, {0}, out); }, kRows * n * 2.0 + n * 2.0, 0);
}
BENCHMARK(BM_bias_grad_column_sum_bf16)->Arg(768)->Arg(3072)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

// GPT-2 124M's MLP backward pass after the GEMM: dpre = d * gelu'(pre) in place and c_fc's bias
// gradient (the column sums of dpre) in one pass (gelu_backward_with_bias_grad); bytes: pre
// and d read, d written.
void BM_gelu_backward_bias_grad_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t H = 4 * kC;
  Tensor pre = dev_randn({kRows, H}, DType::bf16), d = dev_randn({kRows, H}, DType::bf16);
  Tensor db = empty({H}, {.dtype = DType::bf16, .device = Device::cuda(0)});
  run(
      s, [&] { cuda::gelu_backward_with_bias_grad(pre, d, db); }, 3.0 * kRows * H * 2, 0);
}
BENCHMARK(BM_gelu_backward_bias_grad_bf16)
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

void BM_full_sum_f32(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t n = kV * kC;  // the size of the embedding gradient
  Tensor x = dev_randn({n}, DType::f32), out = empty({}, {.device = Device::cuda(0)});
  run(s, [&] { gpu().reduce(ReduceOp::Sum, x, {0}, out); }, n * 4.0, 0);
}
TESSERA_CUDA_BENCH(BM_full_sum_f32);

void BM_bias_add_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t n = s.range(0);
  Tensor y = dev_randn({kRows, n}, DType::bf16), bias = dev_randn({n}, DType::bf16);
  const Tensor broadcast = raw::expand(bias, {kRows, n});
  run(s, [&] { gpu().binary(BinaryOp::Add, y, broadcast, y); }, kRows * n * 4.0, 0);
}
BENCHMARK(BM_bias_add_bf16)->Arg(768)->Arg(3072)->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

// ---- the embedding's weight gradient (tied wte / lm_head) at GPT-2 124M training size ----
// 16384 token ids with a Zipf-like skew (frequent tokens fill whole sort tiles), bf16 dy.
struct EmbeddingGradCase {
  Tensor idx, dy;
  int64_t unique = 0;  // rows the ids name
  EmbeddingGradCase() {
    std::vector<int64_t> ids(kRows);
    std::vector<bool> named(kV, false);
    uint64_t state = 2024;
    for (int64_t& id : ids) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      id = static_cast<int64_t>(std::pow(static_cast<double>(state >> 11) * 0x1p-53, 4.0) * kV) % kV;
      if (!named[id]) named[id] = true, ++unique;
    }
    idx = from_vector(ids, {kRows}, {.dtype = DType::i64, .device = Device::cuda(0)});
    dy = dev_randn({kRows, kC}, DType::bf16);
  }
  double input_bytes() const { return kRows * kC * 2.0 + kRows * 8.0; }
};

// Arg accumulate 1: add into the f32 gradient the lm_head already wrote (bytes: dy and ids
// read, the named rows read and written); 0: overwrite a bf16 gradient (every row written).
// Arg graph 1: replayed from a CUDA graph as `tessera train` runs it (eager calls also wait
// for the index range check's read-back).
void BM_embedding_backward(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const bool accumulate = s.range(0) != 0, graphed = s.range(1) != 0;
  EmbeddingGradCase c;
  Tensor out = dev_randn({kV, kC}, accumulate ? DType::f32 : DType::bf16);
  auto step = [&] { gpu().embedding_backward(c.dy, c.idx, accumulate, 1.0, out); };
  std::unique_ptr<DeviceGraph> graph;
  if (graphed) {
    step();  // the allocator's blocks, cached for the capture
    GraphBackend& backend = *graph_backend(DeviceType::CUDA);
    backend.begin_capture(Device::cuda(0));
    step();
    graph = backend.end_capture(Device::cuda(0));
  }
  const double out_bytes = accumulate ? 2.0 * c.unique * kC * 4 : double(kV) * kC * 2;
  s.counters["unique_rows"] = static_cast<double>(c.unique);
  run(s, [&] { graphed ? graph->replay() : step(); }, c.input_bytes() + out_bytes, 0);
}
BENCHMARK(BM_embedding_backward)->ArgsProduct({{1, 0}, {1, 0}})->ArgNames({"accumulate", "graph"})
    ->UseManualTime()->Iterations(3)->Unit(benchmark::kMillisecond);

// What it replaced: zero an f32 gradient, then add dy rows with atomics (not deterministic).
void BM_embedding_backward_atomic_baseline(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  EmbeddingGradCase c;
  Tensor out = empty({kV, kC}, {.device = Device::cuda(0)});
  run(s, [&] {
    gpu().fill(out, 0.0);
    gpu().index_add(out, 0, c.idx, c.dy);
  }, c.input_bytes() + double(kV) * kC * 4 + 2.0 * c.unique * kC * 4, 0);
}
TESSERA_CUDA_BENCH(BM_embedding_backward_atomic_baseline);

// ---- GPT-2 124M's MLP GEMMs and GELU, forward and c_proj's input gradient through gelu'
// with db_fc, four ways: impl 0 no GELU epilogue (bias GEMM + GELU kernel; GEMM + one pass
// for gelu' and the bias gradient), 1 the default: cuBLASLt's GELU epilogues both ways
// (GELU_AUX_BIAS; DGELU + a column sum of dpre), 2 the passes apart (GEMM + GELU-backward
// kernel + a column sum of dpre), 3 the forward's epilogue with impl 0's backward. Two GEMMs
// of 2 * rows * 768 * 3072 flops each.
void BM_mlp_gelu_gemms_bf16(benchmark::State& s) {
  if (cuda_device_count() == 0) return s.SkipWithError("no CUDA device");
  const int64_t H = 4 * kC, impl = s.range(0);
  const TensorOptions bf16{.dtype = DType::bf16, .device = Device::cuda(0)};
  Tensor x = dev_randn({kRows, kC}, DType::bf16), w_fc = dev_randn({kC, H}, DType::bf16, 0.02);
  Tensor b_fc = dev_randn({H}, DType::bf16, 0.1), w_proj = dev_randn({H, kC}, DType::bf16, 0.02);
  Tensor g = dev_randn({kRows, kC}, DType::bf16);
  Tensor pre = empty({kRows, H}, bf16), act = empty({kRows, H}, bf16);
  Tensor dpre = empty({kRows, H}, bf16), db_fc = empty({H}, bf16);
  cuda::set_gelu_epilogues(impl == 1   ? cuda::GeluEpilogues::both
                           : impl == 3 ? cuda::GeluEpilogues::forward
                                       : cuda::GeluEpilogues::none);
  run(s,
      [&] {
        cuda::linear_gelu_forward(x, w_fc, b_fc, act, pre);
        if (impl != 2) return cuda::linear_input_grad_dgelu(g, w_proj, pre, dpre, db_fc);
        cuda::linear_forward(g, raw::transpose(w_proj, 0, 1), Tensor(), dpre);
        gpu().binary(BinaryOp::GeluBackward, pre, dpre, dpre);
        gpu().copy(db_fc, ops::sum(dpre, {0}));
      },
      0, 2 * 2.0 * kRows * kC * H);
  cuda::set_gelu_epilogues(cuda::GeluEpilogues::both);
}
BENCHMARK(BM_mlp_gelu_gemms_bf16)
    ->Arg(0)
    ->Arg(1)
    ->Arg(2)
    ->Arg(3)
    ->ArgNames({"impl"})
    ->UseManualTime()
    ->Iterations(3)
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace tessera

BENCHMARK_MAIN();
