// Front-end of the rotary position embeddings: the cos/sin tables of a run of positions and
// the rotation (Hugging Face's rotate_half pairing), forward or inverse. Kernels:
// kernels/cpu/rope.cpp, kernels/cuda/rope.cu.
#include <cmath>
#include <vector>

#include "tessera/kernels/ops.h"
#include "tessera/kernels/ops_util.h"

namespace tessera::ops {

using detail::stat_dtype;

RopeTables rope_tables(int64_t start, int64_t count, int64_t head_dim, double theta, DType dtype,
                       Device device) {
  TESSERA_CHECK(head_dim > 0 && head_dim % 2 == 0,
                "rope_tables: head_dim must be even and "
                "positive, got ",
                head_dim);
  TESSERA_CHECK(start >= 0 && count >= 0 && theta > 0, "rope_tables: start ", start, ", count ",
                count, " and theta ", theta, " must be non-negative (theta positive)");
  const int64_t half = head_dim / 2;
  // Angles in f64 (exact to f32 and f64 rounding of the result, at any position).
  std::vector<double> cos_values(count * half), sin_values(count * half);
  for (int64_t i = 0; i < half; ++i) {
    const double inv_freq = 1.0 / std::pow(theta, static_cast<double>(2 * i) / head_dim);
    for (int64_t p = 0; p < count; ++p) {
      const double angle = static_cast<double>(start + p) * inv_freq;
      cos_values[p * half + i] = std::cos(angle);
      sin_values[p * half + i] = std::sin(angle);
    }
  }
  const TensorOptions host{.dtype = stat_dtype(dtype)};
  RopeTables t{from_vector<double>(cos_values, {count, half}, host),
               from_vector<double>(sin_values, {count, half}, host)};
  if (!device.is_cpu()) {
    t.cos = raw::to(t.cos, device, t.cos.dtype());
    t.sin = raw::to(t.sin, device, t.sin.dtype());
  }
  return t;
}

void rope_into(const Tensor& x, const RopeTables& tables, bool inverse, const Tensor& out) {
  const Device dev = detail::common_device("rope", {&x, &tables.cos, &tables.sin, &out});
  TESSERA_CHECK(is_floating(x.dtype()) && x.dim() == 4 && x.size(3) % 2 == 0, "rope: input ",
                detail::describe(x), " must be a float [B, T, H, D] tensor with an even D");
  TESSERA_CHECK(out.shape() == x.shape() && out.dtype() == x.dtype(), "rope: output ",
                detail::describe(out), " must have the input's shape and dtype ",
                detail::describe(x));
  check_no_internal_overlap("rope", out);
  const Shape want{x.size(1), x.size(3) / 2};
  const DType table_dtype = stat_dtype(x.dtype());
  for (const Tensor* t : {&tables.cos, &tables.sin}) {
    TESSERA_CHECK(t->shape() == want, "rope: tables ", detail::describe(*t), " must be ",
                  shape_str(want), " ([T, D/2]) for input ", detail::describe(x));
  }
  const Tensor cos = raw::contiguous(raw::to(tables.cos, dev, table_dtype));
  const Tensor sin = raw::contiguous(raw::to(tables.sin, dev, table_dtype));
  if (out.numel() > 0)
    checked_kernel(detail::kernels_for(dev).rope, "rope", dev)(x, cos, sin, inverse, out);
}

Tensor rope(const Tensor& x, const RopeTables& tables, bool inverse) {
  Tensor out = empty(x.shape(), {.dtype = x.dtype(), .device = x.device()});
  rope_into(x, tables, inverse, out);
  return out;
}

}  // namespace tessera::ops
