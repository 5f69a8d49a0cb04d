// The CUDA embedding backward (sort + ordered per-row sums): against the float64 reference,
// bit-for-bit repeatable at GPT-2 124M's size, and recorded in a CUDA graph and replayed.
#include <gtest/gtest.h>

#include <cstring>

#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/core/graph_capture.h"
#include "tessera/kernels/ops.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/kernels/embedding_backward_case.h"

using namespace tessera;
using tessera::test::DyLayout;
using tessera::test::EmbeddingBackwardCase;

namespace {

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor host = raw::to(t, Device::cpu(), t.dtype()).contiguous();
  std::vector<uint8_t> out(host.nbytes());
  std::memcpy(out.data(), host.raw_data(), out.size());
  return out;
}

TEST(CudaEmbeddingBackward, MatchesFloat64) {
  TESSERA_REQUIRE_GPU();
  uint64_t seed = 500;
  for (int64_t C : {13, 768, 770}) {
    for (DType out_dtype : {DType::f32, DType::bf16, DType::f16}) {
      for (bool accumulate : {false, true}) {
        for (DyLayout layout :
             {DyLayout::Contiguous, DyLayout::RowPadded, DyLayout::ColumnStrided}) {
          EmbeddingBackwardCase c;
          c.C = C, c.out_dtype = out_dtype, c.accumulate = accumulate, c.layout = layout;
          c.dy_dtype = seed % 3 == 0 ? DType::f32 : seed % 3 == 1 ? DType::bf16 : DType::f16;
          c.index_dtype = seed % 2 ? DType::i32 : DType::i64;
          c.seed = seed++;
          SCOPED_TRACE(c.name());
          auto in = test::make_embedding_backward_inputs(c, cuda_test::dev());
          ops::embedding_backward_into(in.out, in.dy, in.ids, c.accumulate);
          test::expect_embedding_backward_matches(c, in, in.out);
        }
      }
    }
  }
  // f64 on both sides sums in f64
  EmbeddingBackwardCase c;
  c.dy_dtype = c.out_dtype = DType::f64, c.accumulate = true, c.C = 40, c.seed = 599;
  auto in = test::make_embedding_backward_inputs(c, cuda_test::dev());
  ops::embedding_backward_into(in.out, in.dy, in.ids, true);
  test::expect_embedding_backward_matches(c, in, in.out);
}

// The scaled sums (DDP's average of gathered rows): against float64, and for a power-of-two
// scale the bits of scaling dy in out's dtype first.
TEST(CudaEmbeddingBackward, ScaledRowsMatchFloat64AndThePrescaledPass) {
  TESSERA_REQUIRE_GPU();
  uint64_t seed = 650;
  for (double scale : {0.5, 1.0 / 3.0}) {
    for (DType dy_dtype : {DType::bf16, DType::f32, DType::f16}) {
      for (DType out_dtype : {DType::bf16, DType::f32}) {
        for (int64_t C : {13, 768}) {
          EmbeddingBackwardCase c;
          c.C = C, c.dy_dtype = dy_dtype, c.out_dtype = out_dtype, c.scale = scale;
          c.accumulate = seed % 2 == 0;
          c.layout = seed % 3 == 0 ? DyLayout::RowPadded : DyLayout::Contiguous;
          c.index_dtype = seed % 2 ? DType::i32 : DType::i64;
          c.seed = seed++;
          SCOPED_TRACE(c.name());
          auto in = test::make_embedding_backward_inputs(c, cuda_test::dev());
          ops::embedding_backward_into(in.out, in.dy, in.ids, c.accumulate, c.scale);
          test::expect_embedding_backward_matches(c, in, in.out);
          if (scale == 0.5) test::expect_scale_equals_prescaled_pass(c, in, in.out);
        }
      }
    }
  }
}

TEST(CudaEmbeddingBackward, BadIndexNamesValueAndPosition) {
  TESSERA_REQUIRE_GPU();
  Tensor out = cuda_test::to_gpu(cuda_test::host_randn({37, 8}));
  const std::vector<uint8_t> before = bytes_of(out);
  const Tensor dy = cuda_test::to_gpu(cuda_test::host_randn({4, 8}));
  const Tensor ids =
      cuda_test::to_gpu(from_vector<int64_t>({3, 5, 41, -1}, {4}, {.dtype = DType::i64}));
  try {
    ops::embedding_backward_into(out, dy, ids, true);
    ADD_FAILURE() << "no error for index 41";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("index 41 (position 2)"), std::string::npos) << m;
    EXPECT_NE(m.find("size 37"), std::string::npos) << m;
  }
  EXPECT_EQ(bytes_of(out), before) << "a refused call wrote the destination";
}

// GPT-2 124M's shape: 16 x 1024 tokens into 50304 x 768, a Zipf-like skew (a few tokens fill
// whole tiles), bf16 dy into an f32 gradient (accumulate) and a bf16 one (overwrite).
TEST(CudaEmbeddingBackward, BitwiseRepeatableAtGpt2Size) {
  TESSERA_REQUIRE_GPU();
  const int64_t V = 50304, C = 768, n = 16384;
  std::vector<int64_t> ids(n);
  uint64_t state = 12345;
  for (int64_t p = 0; p < n; ++p) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(state >> 11) / 9007199254740992.0;
    ids[p] = static_cast<int64_t>(std::pow(u, 4.0) * V) % V;  // small ids far more often
  }
  const Tensor idx = cuda_test::to_gpu(from_vector(ids, {16, 1024}, {.dtype = DType::i64}));
  const Tensor dy = cuda_test::to_gpu(cuda_test::host_randn({16, 1024, C}, DType::bf16));
  const Tensor start = cuda_test::to_gpu(cuda_test::host_randn({V, C}));
  for (bool accumulate : {true, false}) {
    const DType out_dtype = accumulate ? DType::f32 : DType::bf16;
    std::vector<uint8_t> first;
    for (int run = 0; run < 3; ++run) {
      Tensor out = raw::clone(raw::to(start, cuda_test::dev(), out_dtype));  // never start itself
      ops::embedding_backward_into(out, dy, idx, accumulate);
      if (run == 0)
        first = bytes_of(out);
      else
        EXPECT_TRUE(bytes_of(out) == first)
            << "run " << run << " differs (accumulate " << accumulate << ")";
    }
  }
  // and it is the reference's sum
  EmbeddingBackwardCase c;
  c.rows = V, c.C = C, c.dy_dtype = DType::bf16, c.out_dtype = DType::f32, c.accumulate = true;
  test::EmbeddingBackwardInputs in;
  in.dy = dy, in.ids = idx, in.out = raw::clone(start);
  in.out_before = raw::to(in.out, Device::cpu(), DType::f64).to_vector<double>();
  c.positions = n;
  ops::embedding_backward_into(in.out, dy, idx, true);
  test::expect_embedding_backward_matches(c, in, in.out);
}

TEST(CudaEmbeddingBackward, RecordedInACudaGraphAndReplayed) {
  TESSERA_REQUIRE_GPU();
  EmbeddingBackwardCase c;
  c.rows = 301, c.C = 768, c.positions = 4000, c.dy_dtype = DType::bf16, c.out_dtype = DType::f32;
  c.accumulate = true, c.seed = 77;
  auto in = test::make_embedding_backward_inputs(c, cuda_test::dev());
  const Tensor start = in.out.clone();
  GraphBackend& backend = *graph_backend(DeviceType::CUDA);
  cuda::synchronize();
  backend.begin_capture(cuda_test::dev());
  ops::embedding_backward_into(in.out, in.dy, in.ids, true);
  std::unique_ptr<DeviceGraph> graph = backend.end_capture(cuda_test::dev());
  // Capturing runs nothing: out is still the start; each replay adds the sums once more.
  EXPECT_EQ(bytes_of(in.out), bytes_of(start));
  graph->replay();
  cuda::synchronize();
  test::expect_embedding_backward_matches(c, in, in.out);
  Tensor eager = start.clone();
  ops::embedding_backward_into(eager, in.dy, in.ids, true);
  EXPECT_TRUE(bytes_of(in.out) == bytes_of(eager)) << "the replay differs from the eager call";
  // New values in the captured inputs reach the next replay.
  raw::copy_(in.out, start);
  raw::copy_(in.dy, ops::mul(in.dy.clone(), -1.0));
  graph->replay();
  cuda::synchronize();
  Tensor eager_neg = start.clone();
  ops::embedding_backward_into(eager_neg, in.dy, in.ids, true);
  EXPECT_TRUE(bytes_of(in.out) == bytes_of(eager_neg));
  EXPECT_FALSE(bytes_of(eager_neg) == bytes_of(eager));
}

}  // namespace
