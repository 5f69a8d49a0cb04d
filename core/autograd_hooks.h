// Core makes tensors that may ask for gradients (TensorOptions::requires_grad) but knows
// nothing about gradients: the autograd layer above it fills this table when the library
// loads (autograd/tensor_methods.cpp), and core calls through it. So core links and runs
// without autograd, and the call still goes where the user expects.
#pragma once

namespace tessera {

class Tensor;

struct AutogradHooks {
  // t.requires_grad_(on) of the autograd layer.
  void (*set_requires_grad)(const Tensor& t, bool on) = nullptr;
};

void install_autograd_hooks(const AutogradHooks& hooks);

namespace detail {
// Marks a tensor just made by factory `op` as requiring grad; an error naming `op` when no
// autograd layer has installed its hooks.
void mark_requires_grad(const Tensor& t, const char* op);
}  // namespace detail

}  // namespace tessera
