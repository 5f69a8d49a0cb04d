// Host cost per op: what Tessera spends on the CPU around a kernel (dispatch, shape and
// stride vectors, tensor and storage objects, tape nodes and their closures, the allocator),
// measured on tiny CPU tensors where the arithmetic itself takes a few nanoseconds. On a GPU
// this is the time the host needs to issue one op; when it exceeds the kernel's own run time
// the training step is host-bound (issue 12: small models).
//
//   bench_host_overhead [--benchmark_filter=...]   (Google Benchmark flags)
//
// Each benchmark reports us_per_op: for Forward/* one call without a tape; for
// ForwardBackward/* the op recorded on the tape plus its share of a backward (the backward
// of the op and of the sum that makes a scalar, so two ops); for GPTStep the whole tiny
// training step (forward, backward, clipping, AdamW) divided by the number of tape nodes it
// records, and us_per_step.
#include <benchmark/benchmark.h>

#include <unordered_set>

#include "tessera/autograd/autograd.h"
#include "tessera/autograd/functions.h"
#include "tessera/nn/nn.h"
#include "tessera/optim/optim.h"

using namespace tessera;

namespace {

constexpr int64_t kRows = 4, kCols = 8;  // tiny: the kernels cost next to nothing

Tensor tiny(Generator& gen, Shape shape = {kRows, kCols}, bool requires_grad = false) {
  Tensor t = randn(shape, {}, &gen);
  if (requires_grad) t.requires_grad_();
  return t;
}

void report_per_op(benchmark::State& state, double ops_per_iteration) {
  state.counters["us_per_op"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * ops_per_iteration * 1e-6,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

// ---- one op, no tape (grad mode off): dispatch, output allocation, metadata ----

template <class Op>
void forward_only(benchmark::State& state, Op op, int inputs) {
  Generator gen(1);
  std::vector<Tensor> x;
  for (int i = 0; i < inputs; ++i) x.push_back(tiny(gen));
  autograd::NoGradGuard no_grad;
  for (auto _ : state) benchmark::DoNotOptimize(op(x));
  report_per_op(state, 1);
}

// ---- one op recorded on the tape and backpropagated (plus the sum that makes it a scalar) --

template <class Op>
void forward_backward(benchmark::State& state, Op op, int inputs) {
  Generator gen(2);
  std::vector<Tensor> x;
  for (int i = 0; i < inputs; ++i) x.push_back(tiny(gen, {kRows, kCols}, true));
  for (auto _ : state) {
    Tensor loss = sum(op(x));
    loss.backward();
    for (auto& t : x) t.set_grad(Tensor());
  }
  report_per_op(state, 2);
}

auto add_op = [](const std::vector<Tensor>& x) { return x[0] + x[1]; };
auto mul_op = [](const std::vector<Tensor>& x) { return x[0] * x[1]; };
auto gelu_op = [](const std::vector<Tensor>& x) { return gelu(x[0]); };
auto matmul_op = [](const std::vector<Tensor>& x) { return matmul(x[0], x[1].t()); };
auto softmax_op = [](const std::vector<Tensor>& x) { return softmax(x[0], -1); };
auto layer_norm_op = [](const std::vector<Tensor>& x) {
  return layer_norm(x[0], x[1].select(0, 0), x[1].select(0, 1));
};
auto view_op = [](const std::vector<Tensor>& x) { return x[0].view({kCols, kRows}); };
auto transpose_op = [](const std::vector<Tensor>& x) { return x[0].transpose(0, 1); };

#define TESSERA_HOST_BENCH(name, op, inputs)                                            \
  void Forward_##name(benchmark::State& s) { forward_only(s, op, inputs); }             \
  void ForwardBackward_##name(benchmark::State& s) { forward_backward(s, op, inputs); } \
  BENCHMARK(Forward_##name);                                                            \
  BENCHMARK(ForwardBackward_##name)

TESSERA_HOST_BENCH(add, add_op, 2);
TESSERA_HOST_BENCH(mul, mul_op, 2);
TESSERA_HOST_BENCH(gelu, gelu_op, 1);
TESSERA_HOST_BENCH(matmul, matmul_op, 2);
TESSERA_HOST_BENCH(softmax, softmax_op, 1);
TESSERA_HOST_BENCH(layer_norm, layer_norm_op, 2);
TESSERA_HOST_BENCH(view, view_op, 1);
TESSERA_HOST_BENCH(transpose, transpose_op, 1);

// Tensor creation alone: a Storage from the allocator, shape and strides, the impl.
void Empty(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(empty({kRows, kCols}));
  report_per_op(state, 1);
}
BENCHMARK(Empty);

// The number of tape nodes reachable from root (the ops a backward will run).
size_t count_nodes(const Tensor& root) {
  std::unordered_set<const autograd::Node*> seen;
  std::vector<std::shared_ptr<autograd::Node>> stack{autograd::gradient_edge(root).node};
  while (!stack.empty()) {
    auto node = std::move(stack.back());
    stack.pop_back();
    if (!node || !seen.insert(node.get()).second) continue;
    for (const auto& e : node->next_edges) stack.push_back(e.node);
  }
  return seen.size();
}

// One training step of a GPT so small that every kernel is a few hundred flops: what is left
// is the host's work per op, as for the shakespeare_char shape on a GPU.
void GPTStep(benchmark::State& state) {
  Generator gen(3);
  const int64_t batch = 2, seq = 8, vocab = 16;
  nn::GPT model(
      nn::GPTConfig{.vocab_size = vocab, .block_size = seq, .n_layer = 2, .n_head = 2, .n_embd = 8},
      &gen);
  optim::AdamW opt(model.parameters(), {.lr = 1e-3, .weight_decay = 0.1});
  const Tensor idx = randint(0, vocab, {batch, seq}, {.dtype = DType::i64}, &gen);
  const Tensor targets = randint(0, vocab, {batch, seq}, {.dtype = DType::i64}, &gen);
  size_t nodes = 0;
  for (auto _ : state) {
    opt.zero_grad();
    Tensor loss = model.loss(idx, targets);
    if (nodes == 0) nodes = count_nodes(loss);
    loss.backward();
    optim::clip_grad_norm_(model.parameters(), 1.0);
    opt.step();
  }
  state.counters["tape_nodes"] = static_cast<double>(nodes);
  state.counters["us_per_step"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 1e-6,
                         benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  report_per_op(state, static_cast<double>(nodes));
}
BENCHMARK(GPTStep);

}  // namespace

BENCHMARK_MAIN();
