#include "tessera/optim/sgd.h"

#include "tessera/kernels/ops.h"
#include "tessera/optim/fused_update.h"

namespace tessera::optim {

namespace {

template <class A>
struct SGDCoeffs {
  A lr, weight_decay, momentum, one_minus_dampening;
  bool nesterov, first_step;
};

template <class T, class A>
void sgd_cpu(T* p, const T* g, A* buf, int64_t n, const SGDCoeffs<A>& c) {
  detail::parallel_ranges(n, [&](int64_t begin, int64_t end) {
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const A param = static_cast<A>(p[i]);
      A d = static_cast<A>(g[i]) + c.weight_decay * param;
      if (buf) {
        const A b = c.first_step ? d : c.momentum * buf[i] + c.one_minus_dampening * d;
        buf[i] = b;
        d = c.nesterov ? d + c.momentum * b : b;
      }
      p[i] = static_cast<T>(param - c.lr * d);
    }
  });
}

void sgd_generic(const Tensor& p, const Tensor& g, const Tensor& buf, const SGDCoeffs<double>& c) {
  Tensor d = ops::to(g, g.device(), buf.defined() ? buf.dtype() : g.dtype());
  if (c.weight_decay != 0) d = ops::add_scaled(d, p, c.weight_decay);
  if (buf.defined()) {
    if (c.first_step) {
      ops::copy_(buf, d);
    } else {
      ops::binary_(BinaryOp::Mul, buf, c.momentum);
      ops::binary_(BinaryOp::Add, buf, ops::mul(d, c.one_minus_dampening));
    }
    d = c.nesterov ? ops::add_scaled(d, buf, c.momentum) : buf;
  }
  ops::binary_(BinaryOp::Sub, p, ops::mul(d, c.lr));
}

}  // namespace

SGD::SGD(const std::vector<Tensor>& params, SGDOptions opts)
    : SGD(std::vector<ParamGroup>{ParamGroup{
              .params = params, .lr = opts.lr, .weight_decay = opts.weight_decay, .name = "all"}},
          opts) {}

SGD::SGD(std::vector<ParamGroup> groups, SGDOptions opts)
    : Optimizer(std::move(groups)), opts_(opts) {
  TESSERA_CHECK(!opts.nesterov || (opts.momentum > 0 && opts.dampening == 0),
                "SGD: nesterov momentum needs momentum > 0 and dampening 0 (got momentum ",
                opts.momentum, ", dampening ", opts.dampening, ")");
  TESSERA_CHECK(opts.momentum >= 0, "SGD: momentum must be >= 0, got ", opts.momentum);
}

void SGD::apply_step() {
  size_t index = 0;
  for (const auto& group : groups_) {
    for (const auto& p : group.params) {
      ParamState& s = state(index++);
      const Tensor grad = p.grad();
      if (!grad.defined()) continue;
      const Tensor g = detail::grad_like_param(p, grad, "SGD::step");
      Tensor buf;
      if (opts_.momentum != 0) {
        if (s.tensors.empty())
          s.tensors["momentum_buffer"] =
              zeros(p.shape(), {.dtype = detail::state_dtype(p.dtype()), .device = p.device()});
        buf = s.tensors["momentum_buffer"];
      }
      const SGDCoeffs<double> c{group.lr,       group.weight_decay,
                                opts_.momentum, 1.0 - opts_.dampening,
                                opts_.nesterov, s.step == 0};
      s.step += 1;
      detail::update_in_place(p, [&](const Tensor& pc) {
        if (pc.device().is_cpu()) {
          visit_dtype(pc.dtype(), [&](auto tag) {
            using T = decltype(tag);
            if constexpr (std::is_same_v<T, double>) {
              sgd_cpu<T, double>(pc.data<T>(), g.data<T>(),
                                 buf.defined() ? buf.data<double>() : nullptr, pc.numel(), c);
            } else if constexpr (std::is_same_v<T, float> || std::is_same_v<T, Half> ||
                                 std::is_same_v<T, BFloat16>) {
              const SGDCoeffs<float> cf{float(c.lr),       float(c.weight_decay),
                                        float(c.momentum), float(c.one_minus_dampening),
                                        c.nesterov,        c.first_step};
              sgd_cpu<T, float>(pc.data<T>(), g.data<T>(),
                                buf.defined() ? buf.data<float>() : nullptr, pc.numel(), cf);
            }
          });
        } else {
          sgd_generic(pc, g, buf, c);
        }
      });
    }
  }
}

}  // namespace tessera::optim
