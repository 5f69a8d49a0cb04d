#include "tessera/core/adamw_math.h"

namespace tessera {

AdamWCoefficients<double> adamw_coefficients(double lr, double beta1, double beta2, double eps,
                                             double weight_decay, int64_t step) {
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  return {.decay = 1.0 - lr * weight_decay,
          .beta1 = beta1,
          .one_minus_beta1 = 1.0 - beta1,
          .beta2 = beta2,
          .one_minus_beta2 = 1.0 - beta2,
          .step_size = lr / bias_correction1,
          .bias_correction2_sqrt = std::sqrt(bias_correction2),
          .eps = eps};
}

}  // namespace tessera
