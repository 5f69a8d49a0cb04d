// AdamW's update on the CPU (internal to optim/): one fused pass over a contiguous tensor,
// OpenMP over the cores and vectorised, each element updated by core/adamw_math.h's
// adamw_update_element — the CUDA kernel's own arithmetic, so both give the same bits. This
// is also the update ZeRO-Offload runs on the host (its optimizer is optim::AdamW pointed at
// host slices). adamw_cpu.cpp is compiled with -ffp-contract=off (CMakeLists.txt) so that no
// multiply-add is fused: every operation rounds as the device's does.
#pragma once
#include "tessera/core/adamw_math.h"
#include "tessera/core/tensor.h"

namespace tessera::optim::detail {

// param -= AdamW's step in place (param, grad: one dtype, contiguous; m, v: float for
// f32/f16/bf16 parameters, double for f64). Coefficients are rounded to the moments' dtype.
void adamw_cpu(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
               const AdamWCoefficients<double>& coeffs);

// Mixed precision: the f32 master is updated from grad (param's dtype or f32) and param
// (f16/bf16) receives the master rounded to nearest even, in the same pass. All contiguous.
void adamw_cpu_master(const Tensor& param, const Tensor& master, const Tensor& grad,
                      const Tensor& m, const Tensor& v, const AdamWCoefficients<double>& coeffs);

}  // namespace tessera::optim::detail
