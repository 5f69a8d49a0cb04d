// Inputs and the float64 reference for ops::embedding_backward_into, shared by the CPU suite
// (tests/kernels) and the GPU one (tests/cuda): indices with many repeats and rows that no
// index names, dy as a contiguous, row-padded or column-strided view, out of any float dtype.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "tessera/core/random.h"
#include "tessera/core/tensor.h"
#include "tessera/kernels/ops.h"

namespace tessera::test {

enum class DyLayout { Contiguous, RowPadded, ColumnStrided };

struct EmbeddingBackwardCase {
  int64_t rows = 37, C = 13, positions = 1000;
  DType dy_dtype = DType::f32, out_dtype = DType::f32, index_dtype = DType::i64;
  DyLayout layout = DyLayout::Contiguous;
  bool accumulate = false;
  double scale = 1.0;  // embedding_backward_into's scale
  uint64_t seed = 1;

  std::string name() const {
    const char* layouts[] = {"contiguous", "row-padded", "column-strided"};
    return std::string("rows ") + std::to_string(rows) + " C " + std::to_string(C) + " n " +
           std::to_string(positions) + " dy " + dtype_name(dy_dtype) + " out " +
           dtype_name(out_dtype) + " idx " + dtype_name(index_dtype) + " " +
           layouts[static_cast<int>(layout)] + (accumulate ? " accumulate" : " overwrite") +
           (scale != 1.0 ? " scale " + std::to_string(scale) : "");
  }
};

struct EmbeddingBackwardInputs {
  Tensor dy;   // [2, positions / 2, C] (a view as the case's layout asks), on the device
  Tensor ids;  // [2, positions / 2]: even rows below rows - 4 only, so odd rows and the last
               // ones are never named and every named row repeats
  Tensor out;  // [rows, C]: random values for accumulate, NaN otherwise (every row is written)
  std::vector<double> out_before;  // out's values (f64) before the call
};

inline EmbeddingBackwardInputs make_embedding_backward_inputs(const EmbeddingBackwardCase& c,
                                                              Device device) {
  Generator gen(c.seed);
  const int64_t half = c.positions / 2;
  const int64_t named = std::max<int64_t>(1, (c.rows - 4 + 1) / 2);
  std::vector<int64_t> id_values =
      randint(0, named, {2 * half}, {.dtype = DType::i64}, &gen).to_vector<int64_t>();
  for (size_t p = 0; p < id_values.size(); ++p) {
    // The first 40 positions all name row 0: a row longer than any per-warp chunk.
    id_values[p] = p < 40 ? 0 : 2 * id_values[p];
  }
  const Tensor ids = from_vector(id_values, {2, half}, {.dtype = DType::i64});
  const int64_t wide = c.layout == DyLayout::RowPadded       ? c.C + 8
                       : c.layout == DyLayout::ColumnStrided ? 2 * c.C
                                                             : c.C;
  Tensor base =
      raw::to(normal({2, half, wide}, 0.0, 1.0, {.dtype = DType::f64}, &gen), device, c.dy_dtype);
  Tensor dy = c.layout == DyLayout::ColumnStrided ? raw::slice(base, 2, 1, wide, 2)
                                                  : raw::narrow(base, 2, 0, c.C);
  Tensor out0 = c.accumulate ? normal({c.rows, c.C}, 0.0, 1.0, {.dtype = DType::f64}, &gen)
                             : full({c.rows, c.C}, NAN, {.dtype = DType::f64});
  EmbeddingBackwardInputs in;
  in.out = raw::to(out0, device, c.out_dtype);
  in.out_before = raw::to(in.out, Device::cpu(), DType::f64).to_vector<double>();
  in.dy = dy;
  in.ids = raw::to(ids, device, c.index_dtype);
  return in;
}

// Half the spacing of representable values near 1 (the unit roundoff) of a float dtype.
inline double unit_roundoff(DType t) {
  switch (t) {
    case DType::f64:
      return std::ldexp(1.0, -53);
    case DType::f32:
      return std::ldexp(1.0, -24);
    case DType::f16:
      return std::ldexp(1.0, -11);
    default:
      return std::ldexp(1.0, -8);  // bf16
  }
}

// Element by element: |got - exact| within one rounding to out's dtype plus the error of a
// running sum in the compute type (f32, f64 for f64), and with a scale the rounding of each
// scaled element to out's dtype: an op that rounded to bf16 after every addition, or dropped,
// doubled or left unscaled a position, fails.
inline void expect_embedding_backward_matches(const EmbeddingBackwardCase& c,
                                              const EmbeddingBackwardInputs& in,
                                              const Tensor& got_tensor) {
  const std::vector<double> ids =
      raw::to(in.ids, Device::cpu(), DType::f64).contiguous().to_vector<double>();
  const std::vector<double> dy =
      raw::to(in.dy, Device::cpu(), DType::f64).contiguous().to_vector<double>();
  std::vector<double> sum(c.rows * c.C, 0.0), magnitude(c.rows * c.C, 0.0);
  std::vector<int64_t> count(c.rows, 0);
  for (size_t p = 0; p < ids.size(); ++p) {
    const int64_t r = static_cast<int64_t>(ids[p]);
    ++count[r];
    for (int64_t j = 0; j < c.C; ++j) {
      sum[r * c.C + j] += c.scale * dy[p * c.C + j];
      magnitude[r * c.C + j] += std::fabs(c.scale * dy[p * c.C + j]);
    }
  }
  const bool f64 = c.out_dtype == DType::f64 || c.dy_dtype == DType::f64;
  const double u_out = unit_roundoff(c.out_dtype),
               u_acc = unit_roundoff(f64 ? DType::f64 : DType::f32);
  const std::vector<double> got =
      raw::to(got_tensor, Device::cpu(), DType::f64).contiguous().to_vector<double>();
  int64_t bad = 0;
  for (int64_t r = 0; r < c.rows; ++r) {
    for (int64_t j = 0; j < c.C; ++j) {
      const int64_t e = r * c.C + j;
      const double before = c.accumulate ? in.out_before[e] : 0.0;
      const double want = before + sum[e];
      const double bound = u_out * std::fabs(want) * 1.0001 +
                           (count[r] + 1) * u_acc * (magnitude[e] + std::fabs(before)) * 1.01 +
                           (c.scale != 1.0 ? u_out * magnitude[e] * 1.0001 : 0.0) +
                           (c.out_dtype == DType::f16 ? std::ldexp(1.0, -24) : 0.0);
      if (!(std::fabs(got[e] - want) <= bound) && bad++ < 5)
        ADD_FAILURE() << c.name() << ": row " << r << " col " << j << " got " << got[e] << " want "
                      << want << " (bound " << bound << ", " << count[r] << " positions)";
    }
  }
  EXPECT_EQ(bad, 0) << c.name();
}

// With a power-of-two scale the fused scaling must give the bits of the pass it replaces: dy
// converted to out's dtype, multiplied by the scale there, then summed unscaled.
inline void expect_scale_equals_prescaled_pass(const EmbeddingBackwardCase& c,
                                               const EmbeddingBackwardInputs& in,
                                               const Tensor& got) {
  Tensor prescaled = raw::contiguous(raw::to(in.dy, in.dy.device(), c.out_dtype));
  ops::binary_(BinaryOp::Mul, prescaled, c.scale);
  Tensor want = raw::to(from_vector(in.out_before, in.out.shape(), {.dtype = DType::f64}),
                        in.out.device(), c.out_dtype);
  ops::embedding_backward_into(want, prescaled, in.ids, c.accumulate);
  const Tensor a = raw::to(got, Device::cpu(), c.out_dtype).contiguous();
  const Tensor b = raw::to(want, Device::cpu(), c.out_dtype).contiguous();
  ASSERT_EQ(a.nbytes(), b.nbytes());
  EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()), 0)
      << c.name() << ": differs from scaling dy first";
}

}  // namespace tessera::test
