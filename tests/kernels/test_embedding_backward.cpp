// ops::embedding_backward_into on the CPU against a float64 reference (one rounding of an f32
// running sum), overwrite and accumulate, every float dtype pair, strided dy, i32/i64 indices.
#include "tests/kernels/embedding_backward_case.h"
#include "tests/kernels/kernel_test_util.h"

namespace tessera::test {
namespace {

void run_case(const EmbeddingBackwardCase& c) {
  SCOPED_TRACE(c.name());
  EmbeddingBackwardInputs in = make_embedding_backward_inputs(c, Device::cpu());
  const uint64_t version = in.out.impl().version;
  ops::embedding_backward_into(in.out, in.dy, in.ids, c.accumulate, c.scale);
  EXPECT_GT(in.out.impl().version, version);
  expect_embedding_backward_matches(c, in, in.out);
  // (Not into f16: halving an f16 subnormal rounds, so there the two orders may differ; nor
  // f64 dy into a narrower out: its sum runs in f64, the pre-scaled copy's in f32.)
  const bool comparable =
      c.out_dtype != DType::f16 && (c.dy_dtype != DType::f64 || c.out_dtype == DType::f64);
  if ((c.scale == 0.5 || c.scale == 0.25) && comparable)
    expect_scale_equals_prescaled_pass(c, in, in.out);
}

TEST(EmbeddingBackwardInto, MatchesFloat64ForEveryDtypePair) {
  uint64_t seed = 100;
  const std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::f16, DType::f64};
  for (DType dy_dtype : dtypes) {
    for (DType out_dtype : dtypes) {
      for (bool accumulate : {false, true}) {
        EmbeddingBackwardCase c;
        c.dy_dtype = dy_dtype, c.out_dtype = out_dtype, c.accumulate = accumulate;
        c.index_dtype = seed % 2 ? DType::i32 : DType::i64;
        c.seed = seed++;
        run_case(c);
      }
    }
  }
}

// DDP's sparse embedding sync averages gathered rows with the scale: each element is scaled
// and rounded to out's dtype as the scatter reads it.
TEST(EmbeddingBackwardInto, ScaledRowsForEveryDtypePair) {
  uint64_t seed = 150;
  const std::vector<DType> dtypes = {DType::f32, DType::bf16, DType::f16, DType::f64};
  for (double scale : {0.5, 1.0 / 3.0, 0.25}) {
    for (DType dy_dtype : dtypes) {
      for (DType out_dtype : dtypes) {
        EmbeddingBackwardCase c;
        c.dy_dtype = dy_dtype, c.out_dtype = out_dtype, c.scale = scale;
        c.accumulate = seed % 2 == 0;
        c.layout = seed % 3 == 0 ? DyLayout::ColumnStrided : DyLayout::Contiguous;
        c.C = seed % 2 ? 13 : 16;
        c.seed = seed++;
        run_case(c);
      }
    }
  }
}

TEST(EmbeddingBackwardInto, WideRowsAndStridedViews) {
  uint64_t seed = 200;
  for (int64_t C : {768, 770}) {
    for (DyLayout layout : {DyLayout::Contiguous, DyLayout::RowPadded, DyLayout::ColumnStrided}) {
      for (bool accumulate : {false, true}) {
        EmbeddingBackwardCase c;
        c.C = C, c.layout = layout, c.accumulate = accumulate, c.seed = seed++;
        c.dy_dtype = DType::bf16;
        c.out_dtype = accumulate ? DType::f32 : DType::bf16;
        c.index_dtype = accumulate ? DType::i32 : DType::i64;
        run_case(c);
      }
    }
  }
}

TEST(EmbeddingBackwardInto, StridedDestinationAndEmptyIndices) {
  // out as a transposed view: written through a contiguous copy, accumulate keeps its values
  EmbeddingBackwardCase c;
  c.accumulate = true, c.seed = 300;
  EmbeddingBackwardInputs in = make_embedding_backward_inputs(c, Device::cpu());
  Tensor out_t = raw::transpose(raw::contiguous(raw::transpose(in.out, 0, 1)), 0, 1);
  ASSERT_FALSE(out_t.is_contiguous());
  ops::embedding_backward_into(out_t, in.dy, in.ids, true);
  expect_embedding_backward_matches(c, in, out_t);

  // no positions: overwrite zeroes the table, accumulate leaves it
  const Tensor none = empty({0}, {.dtype = DType::i64});
  Tensor out = full({5, 3}, 2.5);
  ops::embedding_backward_into(out, empty({0, 3}), none, true);
  EXPECT_EQ(out.to_vector<float>(), std::vector<float>(15, 2.5f));
  ops::embedding_backward_into(out, empty({0, 3}), none, false);
  EXPECT_EQ(out.to_vector<float>(), std::vector<float>(15, 0.f));
}

TEST(EmbeddingBackwardInto, BadInputsNameTheProblem) {
  Tensor out = zeros({37, 4});
  const Tensor dy = ones({3, 4});
  expect_error(
      [&] {
        ops::embedding_backward_into(
            out, dy, from_vector<int64_t>({1, 37, 2}, {3}, {.dtype = DType::i64}), true);
      },
      {"embedding_backward", "index 37", "position 1", "size 37"});
  expect_error(
      [&] {
        ops::embedding_backward_into(
            out, dy, from_vector<int32_t>({-3, 0, 0}, {3}, {.dtype = DType::i32}), false);
      },
      {"embedding_backward", "-3", "position 0"});
  expect_error([&] { ops::embedding_backward_into(out, dy, zeros({3}), true); },
               {"embedding_backward", "int32 or int64", "float32"});
  expect_error(
      [&] { ops::embedding_backward_into(out, dy, zeros({3}, {.dtype = DType::i64}), true, NAN); },
      {"embedding_backward", "scale must be finite", "nan"});
  expect_error(
      [&] {
        ops::embedding_backward_into(out, ones({3, 5}), zeros({3}, {.dtype = DType::i64}), true);
      },
      {"embedding_backward", "[37, 4]", "5]"});
  expect_error(
      [&] {
        ops::embedding_backward_into(out, ones({4, 4}), zeros({3}, {.dtype = DType::i64}), true);
      },
      {"embedding_backward", "[4, 4]", "[3]"});
  expect_error(
      [&] {
        ops::embedding_backward_into(zeros({37, 4}, {.dtype = DType::i32}), dy,
                                     zeros({3}, {.dtype = DType::i64}), true);
      },
      {"embedding_backward", "floating", "int32"});
}

}  // namespace
}  // namespace tessera::test
