// CPU element-wise kernels: unary, binary, where and the fused a + alpha * b.
//
// Each kernel first brings its inputs to one "work" dtype (a converted temporary only when
// the caller mixed dtypes), then applies the op in compute_t<T> (float for f16/bf16/f32,
// double for f64, int64 for integers) and rounds once on store. When the output dtype
// differs from what the op produces (e.g. an in-place add into f16 of an f32 operand), the
// result goes through a temporary and the copy kernel.
#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/elementwise_ops.h"
#include "tessera/kernels/cpu/map.h"

namespace tessera::cpu {
namespace {

Tensor as_dtype(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return t;
  Tensor tmp = empty(t.shape(), {.dtype = dtype, .device = t.device()});
  kernel_table(DeviceType::CPU).copy(tmp, t);
  return tmp;
}

// Runs write(target) where target has `dtype`: out itself when it matches, else a temporary
// that is then converted into out.
template <class Fn>
void write_as(const Tensor& out, DType dtype, Fn&& write) {
  if (out.dtype() == dtype) {
    write(out);
    return;
  }
  Tensor tmp = empty(out.shape(), {.dtype = dtype, .device = out.device()});
  write(tmp);
  kernel_table(DeviceType::CPU).copy(out, tmp);
}

// A broadcast scalar operand as one value in the compute type.
template <class T>
compute_t<T> scalar_value(const Tensor& t) {
  return static_cast<compute_t<T>>(convert<compute_t<T>>(*static_cast<const T*>(t.raw_data())));
}

void unary(UnaryOp op, const Tensor& x, const Tensor& out) {
  with_enum_constant<UnaryOp, kNumUnaryOps>(op, [&](auto op_c) {
    constexpr UnaryOp kOp = decltype(op_c)::value;
    // LogicalNot reads any dtype and writes bool; the rest compute in out's dtype.
    const DType work = unary_returns_bool(kOp) ? x.dtype() : out.dtype();
    const Tensor in = as_dtype(x, work);
    visit_dtype(work, [&](auto tag) {
      using T = decltype(tag);
      using C = compute_t<T>;
      using O = std::conditional_t<unary_returns_bool(kOp), bool, T>;
      write_as(out, DTypeOf<O>::value, [&](const Tensor& target) {
        map_elements<O, T>(
            target, [=](T v) { return convert<O>(apply_unary<kOp>(convert<C>(v))); }, {&in});
      });
    });
  });
}

void binary(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  with_enum_constant<BinaryOp, kNumBinaryOps>(op, [&](auto op_c) {
    constexpr BinaryOp kOp = decltype(op_c)::value;
    const DType work = promote_types(a.dtype(), b.dtype());
    const Tensor lhs = as_dtype(a, work), rhs = as_dtype(b, work);
    visit_dtype(work, [&](auto tag) {
      using T = decltype(tag);
      using C = compute_t<T>;
      using O = std::conditional_t<binary_returns_bool(kOp), bool, T>;
      write_as(out, DTypeOf<O>::value, [&](const Tensor& target) {
        // A scalar operand (x * 0.5, x + bias element) is hoisted so the loop stays unit-stride.
        if (is_broadcast_scalar(rhs) && !is_broadcast_scalar(lhs)) {
          const C s = scalar_value<T>(rhs);
          map_elements<O, T>(
              target, [=](T v) { return convert<O>(apply_binary<kOp>(convert<C>(v), s)); },
              {&lhs});
        } else if (is_broadcast_scalar(lhs) && !is_broadcast_scalar(rhs)) {
          const C s = scalar_value<T>(lhs);
          map_elements<O, T>(
              target, [=](T v) { return convert<O>(apply_binary<kOp>(s, convert<C>(v))); },
              {&rhs});
        } else {
          map_elements<O, T, T>(
              target,
              [=](T u, T v) { return convert<O>(apply_binary<kOp>(convert<C>(u), convert<C>(v))); },
              {&lhs, &rhs});
        }
      });
    });
  });
}

void where(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  const Tensor c = as_dtype(cond, DType::boolean);
  const Tensor lhs = as_dtype(a, out.dtype()), rhs = as_dtype(b, out.dtype());
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    // masked_fill's fill value is a broadcast scalar: hoist it so the loop stays unit-stride.
    if (is_broadcast_scalar(lhs) && !is_broadcast_scalar(rhs)) {
      const T fill = *static_cast<const T*>(lhs.raw_data());
      map_elements<T, bool, T>(out, [fill](bool k, T v) { return k ? fill : v; }, {&c, &rhs});
    } else if (is_broadcast_scalar(rhs) && !is_broadcast_scalar(lhs)) {
      const T fill = *static_cast<const T*>(rhs.raw_data());
      map_elements<T, bool, T>(out, [fill](bool k, T u) { return k ? u : fill; }, {&c, &lhs});
    } else {
      map_elements<T, bool, T, T>(
          out, [](bool k, T u, T v) { return k ? u : v; }, {&c, &lhs, &rhs});
    }
  });
}

void add_scaled(const Tensor& a, const Tensor& b, double alpha, const Tensor& out) {
  const Tensor lhs = as_dtype(a, out.dtype()), rhs = as_dtype(b, out.dtype());
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    const C s = static_cast<C>(alpha);
    map_elements<T, T, T>(
        out, [s](T u, T v) { return convert<T>(C(convert<C>(u) + s * convert<C>(v))); },
        {&lhs, &rhs});
  });
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CPU);
  t.unary = unary;
  t.binary = binary;
  t.where = where;
  t.add_scaled = add_scaled;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
