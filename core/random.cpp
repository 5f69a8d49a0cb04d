#include "tessera/core/random.h"

#include "tessera/core/autograd_hooks.h"
#include "tessera/core/dispatch.h"

namespace tessera {

Generator& default_generator() {
  static Generator gen(0);
  return gen;
}

void manual_seed(uint64_t seed) { default_generator().manual_seed(seed); }

namespace {

void fill_random(const Tensor& t, RandomKind kind, double a, double b, Generator* gen) {
  TESSERA_CHECK(kind == RandomKind::Integer || is_floating(t.dtype()), "random: ",
                kind == RandomKind::Normal ? "normal" : "uniform",
                " needs a floating dtype, got ", dtype_name(t.dtype()));
  if (t.numel() == 0) return;
  Generator& g = gen ? *gen : default_generator();
  const uint64_t per_block = kind == RandomKind::Normal ? 2 : 4;
  const uint64_t n = static_cast<uint64_t>(t.numel());
  const uint64_t offset = g.reserve((n + per_block - 1) / per_block);
  Tensor target = t.is_contiguous() ? t : empty(t.shape(), {.dtype = t.dtype(), .device = t.device()});
  checked_kernel(kernel_table(t.device().type).random, "random", t.device())(target, kind, g.seed(),
                                                                           offset, a, b);
  if (!target.is_same(t)) raw::copy_(t, target);
  ++t.impl().version;
}

Tensor make_random(const Shape& shape, TensorOptions opts, RandomKind kind, double a, double b,
                   Generator* gen) {
  const bool rg = opts.requires_grad;
  opts.requires_grad = false;
  Tensor t = empty(shape, opts);
  fill_random(t, kind, a, b, gen);
  if (rg) detail::mark_requires_grad(t, "random");
  return t;
}

}  // namespace

Tensor rand(const Shape& shape, TensorOptions opts, Generator* gen) {
  return make_random(shape, opts, RandomKind::Uniform, 0.0, 1.0, gen);
}
Tensor uniform(const Shape& shape, double low, double high, TensorOptions opts, Generator* gen) {
  return make_random(shape, opts, RandomKind::Uniform, low, high, gen);
}
Tensor randn(const Shape& shape, TensorOptions opts, Generator* gen) {
  return make_random(shape, opts, RandomKind::Normal, 0.0, 1.0, gen);
}
Tensor normal(const Shape& shape, double mean, double std, TensorOptions opts, Generator* gen) {
  return make_random(shape, opts, RandomKind::Normal, mean, std, gen);
}
Tensor randint(int64_t low, int64_t high, const Shape& shape, TensorOptions opts, Generator* gen) {
  TESSERA_CHECK(high > low, "randint: empty range [", low, ", ", high, ")");
  return make_random(shape, opts, RandomKind::Integer, static_cast<double>(low),
                     static_cast<double>(high), gen);
}
void normal_(const Tensor& t, double mean, double std, Generator* gen) {
  fill_random(t, RandomKind::Normal, mean, std, gen);
}
void uniform_(const Tensor& t, double low, double high, Generator* gen) {
  fill_random(t, RandomKind::Uniform, low, high, gen);
}

}  // namespace tessera
