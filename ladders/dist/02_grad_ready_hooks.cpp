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

int main(int argc, char** argv) {
  return run_ladder(argc, argv, {"02_grad_ready_hooks", "dist/ddp.cpp (the grad-ready hooks of DistributedDataParallel)"},
                    [](Job& job, CountingGroup& comm) {
    TinyMlp model(job.device);
    optim::AdamW opt(model.parameters(), adamw_options());
    const int64_t rows = job.options.rows_per_rank;

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

    std::vector<double> losses;
    for (int step = 0; step < job.options.steps; ++step) {
      Batch mine = global_batch(step, job.size * rows, job.device).rows(job.rank * rows, rows);
      Tensor loss = cross_entropy(model(mine.x), mine.y);
      loss.backward();  // the all-reduces start inside this call

      for (WorkPtr& work : in_flight) work->wait();
      in_flight.clear();
      opt.step();
      opt.zero_grad();
      comm.end_step();
      losses.push_back(job.mean_over_ranks(loss.item()));
      if (step == 0 && job.rank == 0)
        std::printf("  launch order (the last layer's gradients are ready first): %s ... %s\n",
                    launch_order.front().c_str(), launch_order.back().c_str());
    }

    Outcome out;
    out.theory.add(kAllReduce, kMlpTensors, 4 * kMlpParameters);
    out.theory_reason = "as step 1 (the same collectives, started earlier): one all_reduce per "
                        "parameter tensor (" + std::to_string(kMlpTensors) + "), 4 bytes x " +
                        std::to_string(kMlpParameters) + " parameters";
    check_against(out.check, losses, model, train_one_process(job));
    return out;
  });
}
