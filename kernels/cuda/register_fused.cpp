// Fills the CUDA row of the fused-kernel table (kernels/fused_table.h) when
// libtessera_cuda.so loads: autograd, nn and optim reach these kernels only through it.
#include "tessera/kernels/cuda/cudnn_attention.h"
#include "tessera/kernels/cuda/fused.h"
#include "tessera/kernels/cuda/linear.h"
#include "tessera/kernels/fused_table.h"

namespace tessera::cuda {
namespace {

const bool registered = [] {
  FusedKernelTable& t = fused_kernel_table(DeviceType::CUDA);
  t.linear_forward = linear_forward;
  t.linear_weight_grad = linear_weight_grad;
  t.linear_gelu_forward = linear_gelu_forward;
  t.linear_input_grad_dgelu = linear_input_grad_dgelu;
  t.classifier = fused_classifier;
  t.flash_attention_forward = flash_attention_forward;
  t.flash_attention_backward = flash_attention_backward;
  t.flash_attention_dropout_forward = flash_attention_dropout_forward;
  t.flash_attention_dropout_backward = flash_attention_dropout_backward;
  t.flash_attention_backward_with_bias_grad = flash_attention_backward_with_bias_grad;
  t.flash_masked_attention_forward = flash_masked_attention_forward;
  t.flash_masked_attention_backward = flash_masked_attention_backward;
  t.flash_masked_attention_dropout_forward = flash_masked_attention_dropout_forward;
  t.flash_masked_attention_dropout_backward = flash_masked_attention_dropout_backward;
  t.cudnn_attention_available = [](std::string* reason) { return cudnn_attention_available(reason); };
  t.cudnn_attention_forward = cudnn_attention_forward;
  t.cudnn_attention_backward = cudnn_attention_backward;
  t.cudnn_masked_attention_available = [](std::string* reason) {
    return cudnn_masked_attention_available(reason);
  };
  t.cudnn_masked_attention_forward = cudnn_masked_attention_forward;
  t.cudnn_masked_attention_backward = cudnn_masked_attention_backward;
  t.multi_tensor_adamw = multi_tensor_adamw;
  t.global_grad_norm = global_grad_norm;
  t.multi_tensor_scale = multi_tensor_scale_;
  t.swiglu_forward = swiglu_forward;
  t.swiglu_backward = swiglu_backward;
  t.dropout_forward = dropout_forward;
  t.dropout_backward = dropout_backward;
  t.gelu_erf_forward = gelu_erf_forward;
  t.gelu_erf_backward = gelu_erf_backward;
  t.multi_tensor_clip = multi_tensor_clip_;
  t.scale_by_device_scalar_ = scale_by_device_scalar_;
  return true;
}();

}  // namespace
}  // namespace tessera::cuda
