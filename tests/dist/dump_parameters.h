// The dist check programs' result format: one line per parameter, "param NAME v0 v1 ...",
// values as f32 with 9 significant digits (enough to round-trip), read back by test_dist.
#pragma once
#include <cstdio>
#include <ostream>

#include "tessera/core/tensor.h"
#include "tessera/kernels/ops.h"
#include "tessera/nn/module.h"

namespace tessera::dist_check {

inline void dump_parameters(const nn::Module& model, std::ostream& out) {
  for (auto& [name, p] : model.named_parameters()) {
    out << "param " << name;
    for (float v : ops::to(p.detach(), Device::cpu(), DType::f32).to_vector<float>()) {
      char num[32];
      std::snprintf(num, sizeof num, " %.9g", v);
      out << num;
    }
    out << "\n";
  }
}

}  // namespace tessera::dist_check
