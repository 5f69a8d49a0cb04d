// Step 2: start each gradient's all-reduce the moment that gradient is ready.
//
// Backward produces gradients from the last layer to the first. In step 1 we waited for all
// of them and only then talked to the other ranks. Here every parameter gets a grad-ready
// hook (autograd::register_grad_ready_hook: called once per backward when a leaf's .grad
// holds all of that backward's contributions, while the rest of backward still runs), and
// the hook launches the all-reduce at once, without waiting for it. The collectives of the
// last layers travel while the first layers' gradients are still being computed: that
// overlap of communication with compute is what every real DDP does. After backward we wait
// for all of them, then step.
//
// On the TCP backend a collective runs on a host thread of the group, so the overlap is
// real here too; on NCCL it runs on the GPU's communication stream.
//
// Still one collective per parameter tensor: many tiny messages, each paying the network's
// latency. Step 3 groups them into buckets.
//
// Run: tessera launch --nproc-per-node 2 build/ladders/dist/ladder_02_grad_ready_hooks
#include "ladder.h"

using namespace ladder;

const LadderInfo kStep = {"02_grad_ready_hooks",
                          "dist/ddp.cpp (the grad-ready hooks of DistributedDataParallel)"};

Outcome run_step(Job& job, CountingGroup& comm) {
  TinyMlp model(job.device);
  optim::AdamW opt(one_group(model.parameters()), adamw_options());
  // The collectives launched by the hooks during the current backward, in launch order.
  // The hooks fire in the same order on every rank (the same graph), so every rank issues
  // the same collectives in the same order, which collectives require.
  std::vector<WorkPtr> in_flight;
  std::vector<std::string> launch_order;
  const auto named = model.named_parameters();
  for (const auto& [name, p] : named) {
    autograd::register_grad_ready_hook(p, [&, name = name](const Tensor& leaf) {
      in_flight.push_back(comm.all_reduce(leaf.grad(), dist::ReduceOp::Avg));
      launch_order.push_back(name);
    });
  }

  // The all-reduces start inside backward (from the hooks); after it, wait for them.
  const std::vector<double> losses = train_data_parallel(job, comm, model, [&] {
    for (WorkPtr& work : in_flight) work->wait();
    in_flight.clear();
    opt.step();
    opt.zero_grad();
  });
  if (job.rank == 0)
    std::printf("  launch order (the last layer's gradients are ready first): %s ... %s\n",
                launch_order.front().c_str(), launch_order[kMlpTensors - 1].c_str());

  Traffic theory;
  theory.add(kAllReduce, kMlpTensors, 4 * kMlpParameters);
  return replicated_outcome(
      job, losses, model, theory,
      "as step 1 (the same collectives, started earlier): one all_reduce per parameter tensor (" +
          std::to_string(kMlpTensors) + "), 4 bytes x " + std::to_string(kMlpParameters) +
          " parameters");
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
