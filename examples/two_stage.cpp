// A two-stage run: stage 1 trains and saves its state, tears the process group
// down (end_training); stage 2 builds a new Accelerator (a new process group on
// the same launch environment), loads the state and goes on. Stage 2 checks
// that every rank holds the same weights and that they differ from stage 1's.
//
//   tessera launch --nproc-per-node 2 example_two_stage [STATE_DIR]
#include <cmath>
#include <filesystem>
#include <iostream>

#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/dist/accelerator.h"
#include "tessera/nn/layers.h"
#include "tessera/optim/adamw.h"

using namespace tessera;

namespace {

struct Net : nn::Module {
  nn::Linear fc{8, 4, true, 0.3};
  Net() { register_module("fc", fc); }
  Tensor forward(const Tensor& x) override { return fc(x); }
};

void train(dist::Accelerator& acc, Net& net, optim::AdamW& opt, int steps) {
  for (int s = 0; s < steps; ++s) {
    Generator g(1000 + s * acc.num_processes() + acc.process_index());
    Tensor x = randn({4, 8}, {}, &g);
    Tensor y = from_vector(std::vector<int64_t>{0, 1, 2, 3}, {4}, {.dtype = DType::i64});
    auto micro = acc.accumulate(net);
    acc.backward(cross_entropy(net(x), y));
    opt.step();
    opt.zero_grad();
  }
}

double first_weight(Net& net) {
  return ops::to(net.fc.weight.detach(), Device::cpu(), DType::f64).to_vector<double>()[0];
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir =
      argc > 1 ? argv[1] : (std::filesystem::temp_directory_path() / "tessera_two_stage").string();
  double after_stage1 = 0;
  {
    dist::Accelerator acc({.cpu = true});
    default_generator().manual_seed(3 + acc.process_index());
    Net net;
    optim::AdamW opt(net.parameters(), {.lr = 0.05});
    acc.prepare(net, opt);
    train(acc, net, opt, 4);
    acc.save_state(dir);
    after_stage1 = first_weight(net);
    acc.print("stage 1: trained 4 steps on ", acc.num_processes(), " process(es), saved to ", dir);
    acc.end_training();  // the process group is gone now
  }
  {
    dist::Accelerator acc({.cpu = true});
    default_generator().manual_seed(99);  // different initial weights: load_state must fix them
    Net net;
    optim::AdamW opt(net.parameters(), {.lr = 0.05});
    acc.prepare(net, opt);
    acc.load_state(dir);
    if (first_weight(net) != after_stage1) {
      std::cerr << "stage 2: load_state did not restore stage 1's weights\n";
      return 1;
    }
    train(acc, net, opt, 4);
    Tensor w = full({1}, first_weight(net), {.dtype = DType::f64});
    double spread = acc.reduce(w, "max").item() - acc.reduce(w, "min").item();
    acc.print("stage 2: resumed and trained 4 more steps; weight spread across ranks ", spread);
    acc.end_training();
    if (spread != 0) return 1;
  }
  return 0;
}
