// Embedding gather, index_add_ scatter, index_select, and cat/stack/split/chunk against
// float64 loops, with strided inputs and bad indices.
#include "tests/kernels/kernel_test_util.h"

namespace tessera::test {
namespace {

Tensor random_ids(const Shape& shape, int64_t high, DType dt, uint64_t seed) {
  Generator gen(seed);
  return raw::to(randint(0, high, shape, {.dtype = DType::i64}, &gen), Device::cpu(), dt);
}

TEST(Embedding, GathersRowsForAnyIndexShape) {
  uint64_t seed = 1;
  for (DType dt : kFloatDTypes) {
    for (Layout layout : {Layout::Contiguous, Layout::Transposed, Layout::Stepped}) {
      for (DType idt : {DType::i32, DType::i64}) {
        const int64_t V = 65, C = 33;
        const Tensor w = random_tensor({V, C}, dt, seed++, layout);
        const Tensor ids = random_ids({3, 7}, V, idt, seed++);
        const Tensor out = ops::embedding(w, ids);
        ASSERT_EQ(out.shape(), (Shape{3, 7, C}));
        const auto wv = host(w), iv = host(ids);
        std::vector<double> want;
        for (double id : iv) for (int64_t c = 0; c < C; ++c) want.push_back(wv[static_cast<int64_t>(id) * C + c]);
        expect_close(out, want, {3, 7, C}, 0, std::string("embedding ") + dtype_name(dt) + " " + layout_name(layout));
      }
    }
  }
  // a transposed (non-contiguous) index tensor and a 0-d index
  const Tensor w = random_tensor({5, 2}, DType::f32, 9);
  const Tensor ids = raw::transpose(from_vector<int64_t>({0, 1, 2, 3, 4, 0}, {2, 3}, {.dtype = DType::i64}), 0, 1);
  const auto got = host(ops::embedding(w, ids)), wv = host(w);
  const std::vector<int64_t> order = {0, 3, 1, 4, 2, 0};
  for (int64_t i = 0; i < 6; ++i) {
    EXPECT_EQ(got[i * 2], wv[order[i] * 2]);
    EXPECT_EQ(got[i * 2 + 1], wv[order[i] * 2 + 1]);
  }
  EXPECT_EQ(ops::embedding(w, full({}, 3, {.dtype = DType::i64})).shape(), (Shape{2}));
}

TEST(Embedding, BadIndicesNameTheIdAndTableSize) {
  const Tensor w = ones({65, 8});
  expect_error([&] { ops::embedding(w, from_vector<int64_t>({3, 65}, {2}, {.dtype = DType::i64})); },
               {"embedding", "65", "size 65"});
  expect_error([&] { ops::embedding(w, from_vector<int32_t>({-1}, {1}, {.dtype = DType::i32})); },
               {"embedding", "-1", "65"});
  expect_error([&] { ops::embedding(w, zeros({2})); }, {"embedding", "int32 or int64", "float32"});
  expect_error([&] { ops::embedding(ones({4}), zeros({2}, {.dtype = DType::i64})); }, {"embedding", "2-D"});
}

TEST(Embedding, BackwardAccumulatesRepeatedIds) {
  for (DType dt : kFloatDTypes) {
    const int64_t V = 65, C = 33;
    const Tensor ids = random_ids({4, 257}, V, DType::i64, 20);  // every id repeats
    const Tensor dy = random_tensor({4, 257, C}, dt, 21, Layout::Stepped);
    const Tensor g = ops::embedding_backward(dy, ids, V);
    ASSERT_EQ(g.shape(), (Shape{V, C}));
    const auto iv = host(ids), gv = host(dy);
    std::vector<double> want(V * C, 0.0);
    for (size_t i = 0; i < iv.size(); ++i)
      for (int64_t c = 0; c < C; ++c) want[static_cast<int64_t>(iv[i]) * C + c] += gv[i * C + c];
    // f16/bf16 accumulate in the storage type: ~30 rounded additions per row
    expect_close(g, want, {V, C}, dt == DType::f32 ? 1e-5 : tolerance(dt) * 3,
                 std::string("embedding_backward ") + dtype_name(dt));
  }
}

TEST(IndexAdd, AddsAlongAnyDimInPlace) {
  uint64_t seed = 30;
  for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
    // contiguous operands take the row-block path, a transposed source the strided one
    for (Layout layout : {Layout::Contiguous, Layout::Transposed}) {
      for (int64_t dim = 0; dim < 3; ++dim) {
        Shape out_shape = {5, 7, 3}, src_shape = out_shape;
        src_shape[dim] = 9;
        const Tensor out = random_tensor(out_shape, dt, seed++);
        const Tensor src = random_tensor(src_shape, dt, seed++, layout);
        const Tensor idx = random_ids({9}, out_shape[dim], DType::i32, seed++);
        auto want = host(out);
        const auto sv = host(src), iv = host(idx);
        for (int64_t i = 0; i < src.numel(); ++i) {
          auto p = unravel(i, src_shape);
          p[dim] = static_cast<int64_t>(iv[p[dim]]);
          want[ravel(p, out_shape)] += sv[i];
        }
        const uint64_t version = out.impl().version;
        ops::index_add_(out, dim, idx, src);
        EXPECT_GT(out.impl().version, version);
        expect_close(out, want, out_shape, tolerance(dt) * 2,
                     "index_add_ dim " + std::to_string(dim) + " " + layout_name(layout));
      }
    }
  }
  expect_error([] { ops::index_add_(zeros({3, 2}), 0, from_vector<int64_t>({0, 3}, {2}, {.dtype = DType::i64}), ones({2, 2})); },
               {"index_add_", "3"});
  expect_error([] { ops::index_add_(zeros({3, 2}), 0, zeros({2}, {.dtype = DType::i64}), ones({2, 5})); },
               {"index_add_", "[2, 5]", "[3, 2]"});
}

TEST(IndexSelect, SelectsAlongDims) {
  const Tensor x = random_tensor({4, 5, 6}, DType::f32, 40, Layout::Transposed);
  const Tensor idx = from_vector<int64_t>({3, 0, 3}, {3}, {.dtype = DType::i64});
  const auto xv = host(x);
  for (int64_t dim = 0; dim < 3; ++dim) {
    if (x.shape()[dim] <= 3) continue;
    const Tensor y = ops::index_select(x, dim, idx);
    Shape shape = x.shape();
    shape[dim] = 3;
    std::vector<double> want(shape_numel(shape));
    for (int64_t i = 0; i < shape_numel(shape); ++i) {
      auto p = unravel(i, shape);
      p[dim] = std::vector<int64_t>{3, 0, 3}[p[dim]];
      want[i] = xv[ravel(p, x.shape())];
    }
    expect_close(y, want, shape, 0, "index_select dim " + std::to_string(dim));
  }
  expect_error([&] { ops::index_select(x, 0, from_vector<int64_t>({4}, {1}, {.dtype = DType::i64})); },
               {"4", "size 4"});
}

TEST(Join, CatStackSplitChunk) {
  for (DType dt : kFloatDTypes) {
    const Tensor a = random_tensor({2, 3}, dt, 50, Layout::Transposed);
    const Tensor b = random_tensor({2, 5}, dt, 51, Layout::Stepped);
    const Tensor c = ops::cat({a, b}, 1);
    ASSERT_EQ(c.shape(), (Shape{2, 8}));
    const auto av = host(a), bv = host(b);
    std::vector<double> want;
    for (int64_t r = 0; r < 2; ++r) {
      for (int64_t k = 0; k < 3; ++k) want.push_back(av[r * 3 + k]);
      for (int64_t k = 0; k < 5; ++k) want.push_back(bv[r * 5 + k]);
    }
    expect_close(c, want, {2, 8}, 0, "cat dim 1");
    // split gives views of c that share its memory and reproduce a and b
    const auto parts = ops::split_sizes(c, {3, 5}, 1);
    ASSERT_EQ(parts.size(), 2u);
    EXPECT_TRUE(parts[0].shares_storage(c));
    expect_close(parts[0], av, {2, 3}, 0, "split 0");
    expect_close(parts[1], bv, {2, 5}, 0, "split 1");
  }
  const Tensor x = random_tensor({7, 3}, DType::f32, 52);
  const auto pieces = ops::split(x, 3, 0);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[2].shape(), (Shape{1, 3}));
  expect_close(ops::cat(pieces, 0), host(x), {7, 3}, 0, "cat of split");
  const auto chunks = ops::chunk(x, 2, 0);
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0].shape(), (Shape{4, 3}));
  const Tensor s = ops::stack({x, x, x}, 1);
  ASSERT_EQ(s.shape(), (Shape{7, 3, 3}));
  const auto sv = host(s), xv = host(x);
  for (int64_t i = 0; i < 7; ++i)
    for (int64_t k = 0; k < 3; ++k)
      for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(sv[(i * 3 + k) * 3 + j], xv[i * 3 + j]);
  expect_error([&] { ops::cat({x, ones({7, 4, 1})}, 0); }, {"cat", "[7, 4, 1]", "[7, 3]"});
  expect_error([&] { ops::cat({x, ones({6, 4})}, 1); }, {"cat", "[6, 4]"});
  expect_error([&] { ops::stack({x, ones({3, 7})}, 0); }, {"stack", "[3, 7]"});
  expect_error([&] { ops::split_sizes(x, {3, 3}, 0); }, {"split", "[3, 3]", "7"});
}

}  // namespace
}  // namespace tessera::test
