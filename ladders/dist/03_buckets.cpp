// Step 3: gradient buckets, filled in reverse order (picotron's bucketed DataParallel).
//
// Step 2 sent one message per parameter tensor. Small messages waste the network: each pays
// a fixed latency, and the bandwidth is only reached by large ones. So we group the
// parameters into buckets of about kBucketBytes, each bucket owning one flat buffer, and
// all-reduce a whole bucket at once when the last of its gradients is ready.
//
// Which parameters share a bucket? Those whose gradients become ready at about the same
// time: backward runs from the last layer to the first, so we fill the buckets walking the
// parameters in REVERSE order of the model. The first bucket holds the head and the last
// block, and is ready (and on the wire) while the rest of backward still runs.
//
// Buckets are launched strictly in bucket order: all ranks must issue their collectives in
// one order, and a rule that does not depend on the hooks' timing guarantees it.
//
// Run: tessera launch --nproc-per-node 2 build/ladders/dist/ladder_03_buckets
#include "ladder.h"

using namespace ladder;

const LadderInfo kStep = {
    "03_buckets", "dist/flat_buckets.cpp (the bucket layout), dist/ddp.cpp (launching them)"};

namespace {

constexpr int64_t kBucketBytes = 4096;  // small, so that this tiny model spans several buckets

struct Bucket {
  std::vector<Tensor> params;    // in reverse model order
  std::vector<int64_t> offsets;  // where each one's gradient lives in `flat`
  Tensor flat;                   // the bucket's gradients, side by side
  size_t ready = 0;              // how many of its gradients this backward has produced
  WorkPtr work;
};

// Walks the parameters from the last to the first, starting a new bucket when the next one
// would not fit (a parameter larger than a bucket gets one to itself).
std::vector<Bucket> make_buckets(const std::vector<Tensor>& params, const Job& job) {
  std::vector<Bucket> buckets(1);
  int64_t filled = 0;
  for (auto p = params.rbegin(); p != params.rend(); ++p) {
    const int64_t bytes = static_cast<int64_t>(p->nbytes());
    if (filled > 0 && filled + bytes > kBucketBytes) buckets.emplace_back(), filled = 0;
    buckets.back().offsets.push_back(filled / 4);
    buckets.back().params.push_back(*p);
    filled += bytes;
  }
  for (Bucket& b : buckets) {
    int64_t numel = 0;
    for (const Tensor& p : b.params) numel += p.numel();
    b.flat = zeros({numel}, job.floats());
  }
  return buckets;
}

}  // namespace

Outcome run_step(Job& job, CountingGroup& comm) {
  TinyMlp model(job.device);
  optim::AdamW opt(one_group(model.parameters()), adamw_options());
  std::vector<Bucket> buckets = make_buckets(model.parameters(), job);
  size_t next_to_launch = 0;

  // A bucket whose gradients are all ready is packed and launched, but only once every
  // bucket before it has been launched.
  auto launch_ready_buckets = [&] {
    while (next_to_launch < buckets.size() &&
           buckets[next_to_launch].ready == buckets[next_to_launch].params.size()) {
      Bucket& b = buckets[next_to_launch++];
      autograd::NoGradGuard no_grad;
      for (size_t i = 0; i < b.params.size(); ++i)
        ops::copy_(b.flat.narrow(0, b.offsets[i], b.params[i].numel()),
                   b.params[i].grad().reshape({-1}));
      b.work = comm.all_reduce(b.flat, dist::ReduceOp::Avg);
    }
  };
  for (Bucket& b : buckets)
    for (const Tensor& p : b.params)
      autograd::register_grad_ready_hook(p, [&b, &launch_ready_buckets](const Tensor&) {
        ++b.ready;
        launch_ready_buckets();
      });

  const std::vector<double> losses = train_data_parallel(job, comm, model, [&] {
    // Wait for every bucket and unpack the averaged gradients back into .grad.
    TESSERA_CHECK(next_to_launch == buckets.size(), "a bucket was never launched");
    for (Bucket& b : buckets) {
      b.work->wait();
      for (size_t i = 0; i < b.params.size(); ++i)
        ops::copy_(b.params[i].grad(),
                   b.flat.narrow(0, b.offsets[i], b.params[i].numel()).view(b.params[i].shape()));
      b.ready = 0;
    }
    next_to_launch = 0;
    opt.step();
    opt.zero_grad();
  });

  // The theory, from the sizes alone: the same greedy packing over the tensor sizes, in
  // reverse order of the shapes the model is made of.
  std::vector<int64_t> sizes;
  for (const LinearShape& s : mlp_linear_shapes())
    sizes.push_back(s.in * s.out), sizes.push_back(s.out);
  int64_t bucket_count = 1, filled = 0;
  for (auto n = sizes.rbegin(); n != sizes.rend(); ++n) {
    if (filled > 0 && filled + 4 * *n > kBucketBytes) ++bucket_count, filled = 0;
    filled += 4 * *n;
  }
  Traffic theory;
  theory.add(kAllReduce, bucket_count, 4 * kMlpParameters);
  return replicated_outcome(job, losses, model, theory,
                            "one all_reduce per bucket of <= " + std::to_string(kBucketBytes) +
                                " bytes (" + std::to_string(bucket_count) + " buckets instead of " +
                                std::to_string(kMlpTensors) + " tensors), the same 4 x " +
                                std::to_string(kMlpParameters) + " bytes in all");
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
