// SGD with PyTorch's semantics (torch.optim.SGD):
//   d = g + wd·p                      (coupled L2 weight decay, when wd != 0)
//   b = d (first step) or μ·b + (1-dampening)·d
//   d = nesterov ? d + μ·b : b        (when μ != 0)
//   p -= lr·d
#pragma once
#include "tessera/optim/optimizer.h"

namespace tessera::optim {

struct SGDOptions {
  double lr = 1e-2;
  double momentum = 0.0;
  double dampening = 0.0;
  double weight_decay = 0.0;
  bool nesterov = false;
};

class SGD : public Optimizer {
 public:
  // One group with opts.weight_decay for every parameter.
  explicit SGD(const std::vector<Tensor>& params, SGDOptions opts = {});
  SGD(std::vector<ParamGroup> groups, SGDOptions opts);

  const SGDOptions& options() const { return opts_; }

 private:
  void apply_step() override;
  std::vector<std::string> state_tensor_names() const override { return {"momentum_buffer"}; }
  const char* name() const override { return "SGD"; }
  SGDOptions opts_;
};

}  // namespace tessera::optim
