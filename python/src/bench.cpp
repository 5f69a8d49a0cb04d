// The C++ side of benchmarks/python_overhead.py: bench_cpu_gpt_train's training step, run on
// the objects the Python loop uses, so the benchmark can alternate the C++ step and the same
// step written in Python one by one in one process (same memory, same threads, the same
// interference from the rest of the machine) and compare their times.
#include "bindings.h"

namespace tessera::python {

void bind_bench(py::module_& m) {
  m.def("_cpp_training_step", [](nn::GPT& model, optim::Optimizer& opt, const Tensor& idx,
                                 const Tensor& targets, const std::vector<Tensor>& params) {
    py::gil_scoped_release release;
    opt.zero_grad();
    Tensor loss = model.loss(idx, targets);
    loss.backward();
    optim::clip_grad_norm_(params, 1.0);
    opt.step();
    return loss.item();
  });
}

}  // namespace tessera::python
