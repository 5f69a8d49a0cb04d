// Step 5: ZeRO stage 2, the gradients sharded too.
//
// In step 4 every rank received the reduced gradient of the WHOLE model and then used 1/W of
// it. A reduce-scatter gives each rank exactly the sum over ranks of its own shard: half the
// ring traffic of an all-reduce ((W-1)/W·N instead of 2(W-1)/W·N). An all-reduce IS a
// reduce-scatter followed by an all-gather, so ZeRO-2 moves the same bytes as plain data
// parallelism (step 3), while each rank keeps 1/W of the optimizer state and of the reduced
// gradients.
//
// For clarity the reduce-scatter runs once after backward. Production ZeRO-2 reduce-scatters
// bucket by bucket DURING backward (the hooks of steps 2 and 3) and frees each bucket's full
// gradients right after, which is where the gradient memory is saved.
//
// Run: tessera launch --nproc-per-node 2 build/ladders/dist/ladder_05_zero2
#include "ladder.h"

using namespace ladder;

Outcome run_step(Job& job, CountingGroup& comm) {
  TinyMlp model(job.device);
  const FlatLayout layout(model.parameters(), job.size);
  Tensor flat_grads = zeros({layout.padded}, job.floats());
  Tensor flat_params = zeros({layout.padded}, job.floats());
  layout.pack_values(flat_params);

  Tensor my_shard = layout.owned(flat_params, job.rank).clone().requires_grad_();
  Tensor my_grad = zeros({layout.shard}, job.floats());  // only 1/W of the reduced gradients
  optim::AdamW opt(one_group({my_shard}), adamw_options());

  const std::vector<double> losses = train_data_parallel(job, comm, model, [&] {
    autograd::NoGradGuard no_grad;
    layout.pack_grads(flat_grads);
    // Rank r receives the average over ranks of shard r, and nothing else.
    comm.reduce_scatter(my_grad, flat_grads, dist::ReduceOp::Avg)->wait();
    my_shard.set_grad(my_grad);
    opt.step();
    comm.all_gather(flat_params, my_shard.detach())->wait();
    layout.unpack_values(flat_params);
    model.zero_grad();
  });

  Outcome out;
  const int64_t padded = padded_to(kMlpParameters, job.size);
  out.theory.add(kReduceScatter, 1, 4 * padded);
  out.theory.add(kAllGather, 1, 4 * padded);
  out.theory_reason =
      "one reduce_scatter of the flat gradients and one all_gather of the "
      "flat weights, each 4 x " +
      std::to_string(padded) +
      " bytes: on a ring "
      "2(W-1)/W x payload in all, what the all-reduce of step 3 moves";
  check_against(out.check, losses, model, train_one_process(job));
  return out;
}

int main(int argc, char** argv) {
  return run_ladder(
      argc, argv,
      {"05_zero2", "dist/zero.cpp (ZeroStrategy, stage 2: reduce-scatter of the buckets)"},
      run_step);
}
