// Causal softmax attention in float64 on the host: the reference the CUDA attention tests
// (flash kernels, cuDNN, grouped-query attention) compare against.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace tessera::cuda_test {

struct AttentionReference {
  std::vector<double> out, lse, dq, dk, dv;
};

// q, dout: contiguous [B, H, T, D]; k, v: contiguous [B, Hkv, T, D] with Hkv dividing H
// (query head h reads key/value head h / (H / Hkv)). Returns out and dq [B, H, T, D], lse
// [B, H, T] (natural log of the scaled scores) and dk, dv [B, Hkv, T, D] (each summed over
// the query heads of its group). An empty dout leaves the gradients empty (forward only).
// dropout: empty, or a factor per probability [B, H, T, T] (0 where dropped, 1 / (1 - p) where
// kept) that multiplies the probabilities before they weight v; lse stays that of the
// undropped probabilities.
inline AttentionReference reference_attention(const std::vector<double>& q,
                                              const std::vector<double>& k,
                                              const std::vector<double>& v,
                                              const std::vector<double>& dout, int64_t B, int64_t H,
                                              int64_t Hkv, int64_t T, int64_t D, double scale,
                                              const std::vector<double>& dropout = {}) {
  AttentionReference r;
  r.out.assign(B * H * T * D, 0.0);
  r.lse.assign(B * H * T, 0.0);
  const bool gradients = !dout.empty();
  if (gradients) {
    r.dq.assign(B * H * T * D, 0.0);
    r.dk.assign(B * Hkv * T * D, 0.0);
    r.dv.assign(B * Hkv * T * D, 0.0);
  }
  const int64_t group = H / Hkv;
  std::vector<double> prob(T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t zq = b * H + h, zk = b * Hkv + h / group;  // [B, H] and [B, Hkv] rows
      auto qrow = [&](const std::vector<double>& x, int64_t t) { return &x[(zq * T + t) * D]; };
      auto krow = [&](const std::vector<double>& x, int64_t t) { return &x[(zk * T + t) * D]; };
      for (int64_t i = 0; i < T; ++i) {
        double row_max = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < D; ++d) dot += qrow(q, i)[d] * krow(k, j)[d];
          prob[j] = dot * scale;
          row_max = std::max(row_max, prob[j]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(prob[j] - row_max);
        r.lse[zq * T + i] = row_max + std::log(sum);
        double* out_i = &r.out[(zq * T + i) * D];
        // The factor of probability (i, j): the mask's, or 1.
        auto kept = [&](int64_t j) { return dropout.empty() ? 1.0 : dropout[(zq * T + i) * T + j]; };
        for (int64_t j = 0; j <= i; ++j) {
          prob[j] = std::exp(prob[j] - row_max) / sum;
          for (int64_t d = 0; d < D; ++d) out_i[d] += prob[j] * kept(j) * krow(v, j)[d];
        }
        if (!gradients) continue;
        // dS_ij = P_ij (M_ij dout_i . v_j - dout_i . out_i) with M the dropout factors (1
        // without); dQ = scale dS K, dK = scale dS^T Q, dV = (P M)^T dout.
        const double* dout_i = qrow(dout, i);
        double dout_dot_out = 0;
        for (int64_t d = 0; d < D; ++d) dout_dot_out += dout_i[d] * out_i[d];
        for (int64_t j = 0; j <= i; ++j) {
          double dout_dot_v = 0;
          for (int64_t d = 0; d < D; ++d) dout_dot_v += dout_i[d] * krow(v, j)[d];
          const double dscore = prob[j] * (kept(j) * dout_dot_v - dout_dot_out) * scale;
          for (int64_t d = 0; d < D; ++d) {
            r.dv[(zk * T + j) * D + d] += prob[j] * kept(j) * dout_i[d];
            r.dq[(zq * T + i) * D + d] += dscore * krow(k, j)[d];
            r.dk[(zk * T + j) * D + d] += dscore * qrow(q, i)[d];
          }
        }
      }
    }
  return r;
}

}  // namespace tessera::cuda_test
