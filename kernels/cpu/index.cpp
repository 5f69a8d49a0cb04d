// CPU gather and scatter-add by index: embedding rows and index_add_.
//
// Indices are read and range-checked up front (errors name the index and the size; an
// exception cannot leave an OpenMP region). index_add_ splits the work by destination
// lanes, never by index, so no two threads add into the same element and the order of
// additions is fixed: the result is deterministic.
#include <algorithm>
#include <cstring>
#include <vector>

#include "tessera/core/dispatch.h"
#include "tessera/kernels/cpu/lanes.h"

namespace tessera::cpu {
namespace {

std::vector<int64_t> read_indices(const Tensor& idx, int64_t size, const char* op,
                                  const char* what) {
  const Tensor& flat = idx;
  std::vector<int64_t> out(flat.numel());
  visit_dtype(flat.dtype(), [&](auto tag) {
    using I = decltype(tag);
    if constexpr (std::is_integral_v<I> && !std::is_same_v<I, bool>) {
      const I* p = static_cast<const I*>(flat.raw_data());
      // Walk the logical order (the index tensor may be any strided view).
      int64_t k = 0;
      const int64_t nd = flat.dim();
      std::vector<int64_t> pos(nd, 0);
      for (int64_t n = 0; n < flat.numel(); ++n) {
        int64_t off = 0;
        for (int64_t d = 0; d < nd; ++d) off += pos[d] * flat.strides()[d];
        out[k++] = static_cast<int64_t>(p[off]);
        for (int64_t d = nd - 1; d >= 0; --d) {
          if (++pos[d] < flat.shape()[d]) break;
          pos[d] = 0;
        }
      }
    } else {
      TESSERA_FAIL(op, ": indices must be int32 or int64, got ", dtype_name(flat.dtype()));
    }
  });
  for (size_t i = 0; i < out.size(); ++i) {
    TESSERA_CHECK(out[i] >= 0 && out[i] < size, op, ": index ", out[i], " (position ", i,
                  ") is out of range for ", what, " of size ", size);
  }
  return out;
}

// out[i, :] = weight[idx[i], :]
void embedding(const Tensor& weight, const Tensor& idx, const Tensor& out) {
  const int64_t V = weight.shape()[0], C = weight.shape()[1];
  const std::vector<int64_t> ids = read_indices(idx, V, "embedding", "an embedding table");
  const int64_t n = static_cast<int64_t>(ids.size());
  visit_dtype(weight.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* wp = static_cast<const T*>(weight.raw_data());
    T* op = static_cast<T*>(out.raw_data());
    const int64_t wr = weight.strides()[0], wc = weight.strides()[1];
    const int64_t orow = out.strides()[0], oc = out.strides()[1];
#pragma omp parallel for schedule(static) if (n * C >= kParallelGrain)
    for (int64_t i = 0; i < n; ++i) {
      const T* src = wp + ids[i] * wr;
      T* dst = op + i * orow;
      if (wc == 1 && oc == 1) {
        std::memcpy(static_cast<void*>(dst), static_cast<const void*>(src), C * sizeof(T));
      } else {
        for (int64_t c = 0; c < C; ++c) dst[c * oc] = src[c * wc];
      }
    }
  });
}

// out[..., idx[i], ...] += src[..., i, ...] along dim.
void index_add(const Tensor& out, int64_t dim, const Tensor& idx, const Tensor& src) {
  const std::vector<int64_t> ids = read_indices(idx, out.shape()[dim], "index_add_", "dimension");
  visit_dtype(out.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using C = compute_t<T>;
    T* op = static_cast<T*>(out.raw_data());
    const T* sp = static_cast<const T*>(src.raw_data());
    if (out.is_contiguous() && src.is_contiguous()) {
      // Contiguous rows (the embedding gradient): view both as [outer, len, inner] and add
      // whole inner rows; threads own blocks of inner columns, so each reads its slice of
      // every source row once (instead of one strided pass over src per column).
      int64_t outer = 1, inner = 1;
      for (int64_t d = 0; d < dim; ++d) outer *= out.shape()[d];
      for (int64_t d = dim + 1; d < out.dim(); ++d) inner *= out.shape()[d];
      const int64_t out_len = out.shape()[dim], n = static_cast<int64_t>(ids.size());
      constexpr int64_t kBlock = 64;
      const int64_t blocks = (inner + kBlock - 1) / kBlock;
#pragma omp parallel for collapse(2) schedule(static) if (outer * n * inner >= kParallelGrain)
      for (int64_t o = 0; o < outer; ++o) {
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const int64_t c0 = blk * kBlock, width = std::min(kBlock, inner - c0);
          for (int64_t i = 0; i < n; ++i) {
            T* dst = op + (o * out_len + ids[i]) * inner + c0;
            const T* s = sp + (o * n + i) * inner + c0;
#pragma omp simd
            for (int64_t c = 0; c < width; ++c)
              dst[c] = convert<T>(C(convert<C>(dst[c]) + convert<C>(s[c])));
          }
        }
      }
      return;
    }
    const int64_t out_step = out.strides()[dim];
    // Lanes of src along dim; out's strides for the other dims are the same positions.
    for_each_lane<2>(src.shape(), dim, {&src.strides(), &out.strides()},
                     [&](std::array<int64_t, 2> off, int64_t n, const std::array<int64_t, 2>& st) {
                       T* o = op + off[1];
                       const T* s = sp + off[0];
                       for (int64_t i = 0; i < n; ++i) {
                         T& dst = o[ids[i] * out_step];
                         dst = convert<T>(C(convert<C>(dst) + convert<C>(s[i * st[0]])));
                       }
                     });
  });
}

// Positions grouped by the row they name, in position order inside a row (a counting sort):
// row r's positions are order[first[r] .. first[r + 1]).
struct RowGroups {
  std::vector<int64_t> first, order;
};
RowGroups group_by_row(const std::vector<int64_t>& ids, int64_t rows) {
  RowGroups g{std::vector<int64_t>(rows + 1, 0), std::vector<int64_t>(ids.size())};
  for (int64_t id : ids) ++g.first[id + 1];
  for (int64_t r = 0; r < rows; ++r) g.first[r + 1] += g.first[r];
  std::vector<int64_t> next(g.first.begin(), g.first.end() - 1);
  for (size_t p = 0; p < ids.size(); ++p) g.order[next[ids[p]]++] = static_cast<int64_t>(p);
  return g;
}

// out[r, :] (+)= the dy rows of r's positions (each element times scale, rounded to out's dtype,
// when scale != 1), summed in position order in the compute type and rounded once. Threads own
// whole rows of out, so the result does not depend on them.
void embedding_backward(const Tensor& dy, const Tensor& idx, bool accumulate, double scale,
                        const Tensor& out) {
  const int64_t rows = out.shape()[0], C = out.shape()[1];
  const std::vector<int64_t> ids =
      read_indices(idx, rows, "embedding_backward", "an embedding table");
  const RowGroups groups = group_by_row(ids, rows);
  const int64_t dy_row = dy.strides()[0], dy_col = dy.strides()[1];
  visit_dtype(out.dtype(), [&](auto out_tag) {
    visit_dtype(dy.dtype(), [&](auto dy_tag) {
      using O = decltype(out_tag);
      using T = decltype(dy_tag);
      if constexpr (is_float_type_v<O> && is_float_type_v<T>) {
        using A = std::conditional_t<std::is_same_v<O, double> || std::is_same_v<T, double>, double,
                                     float>;
        O* op = static_cast<O*>(out.raw_data());
        const T* dp = static_cast<const T*>(dy.raw_data());
        const bool scaled = scale != 1.0;
        const A s = static_cast<A>(scale);
#pragma omp parallel if (rows * C >= kParallelGrain)
        {
          std::vector<A> sum(C);
#pragma omp for schedule(dynamic, 16)
          for (int64_t r = 0; r < rows; ++r) {
            O* dst = op + r * C;
            const int64_t begin = groups.first[r], end = groups.first[r + 1];
            if (begin == end) {
              if (!accumulate) std::fill(dst, dst + C, convert<O>(A(0)));
              continue;
            }
            std::fill(sum.begin(), sum.end(), A(0));
            for (int64_t k = begin; k < end; ++k) {
              const T* src = dp + groups.order[k] * dy_row;
              if (scaled)
                for (int64_t c = 0; c < C; ++c)
                  sum[c] += convert<A>(convert<O>(A(convert<A>(src[c * dy_col]) * s)));
              else
                for (int64_t c = 0; c < C; ++c) sum[c] += convert<A>(src[c * dy_col]);
            }
            for (int64_t c = 0; c < C; ++c)
              dst[c] = convert<O>(accumulate ? A(convert<A>(dst[c]) + sum[c]) : sum[c]);
          }
        }
      } else {
        TESSERA_FAIL("embedding_backward: gradient ", dtype_name(dy.dtype()), " and destination ",
                     dtype_name(out.dtype()), " must have floating dtypes");
      }
    });
  });
}

const bool registered = [] {
  KernelTable& t = kernel_table(DeviceType::CPU);
  t.embedding = embedding;
  t.index_add = index_add;
  t.embedding_backward = embedding_backward;
  return true;
}();

}  // namespace
}  // namespace tessera::cpu
