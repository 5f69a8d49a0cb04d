// Step 6: ZeRO stage 3, the parameters sharded too (what PyTorch calls FSDP).
//
// After step 5 every rank still holds the whole model between steps. ZeRO-3 keeps only a
// shard of every layer: rank r holds 1/W of each linear's weight and bias (laid end to end,
// padded to W equal shards). A layer's full parameters exist only while the layer computes:
//   forward:  all-gather the layer's shards, compute, free the full copy;
//   backward: all-gather them AGAIN (they were freed), compute dx and the weight gradients,
//             reduce-scatter those into this rank's shard of the gradient, free.
// The optimizer updates the shards in place: no all-gather after the step.
//
// Waiting for each gather before computing would stall on every layer, so the gatherer
// PREFETCHES: forward, the all-gather of layer l+1 is launched before layer l computes; in
// backward, layer l-1's before layer l's. At most two layers are whole at any time.
//
// The layer is an autograd function of our own (record): its forward saves only the input
// (as every linear does), not the full weight, and its backward gathers what it needs.
// Traffic per step: 2 all-gathers and 1 reduce-scatter of every layer's parameters, 3N on
// the wire where data parallelism moves 2N: the price of holding 1/W of the model.
//
// Run: tessera launch --nproc-per-node 2 build/ladders/dist/ladder_06_zero3
#include "ladder.h"

using namespace ladder;

const LadderInfo kStep = {
    "06_zero3",
    "dist/zero.cpp (ZeroStrategy, stage 3: units gathered by nn::Module hooks, prefetch_numel)"};

namespace {

// One linear, sharded: its weight [in, out] then its bias [out], flat, padded, cut in W.
struct ShardedLinear {
  int64_t in = 0, out = 0, shard = 0;
  Tensor my_shard;  // a leaf: what this rank's optimizer updates
  int64_t padded(int world) const { return shard * world; }
};

// Holds the full parameters of the layers being used, gathering them ahead of need.
class Gatherer {
 public:
  Gatherer(std::vector<ShardedLinear>& layers, CountingGroup& comm, const Job& job)
      : layers_(layers), comm_(comm), job_(job), slots_(layers.size()) {}

  // Starts layer l's all-gather unless it is whole already or in flight (or l is no layer).
  void prefetch(size_t l) {
    if (l >= layers_.size() || slots_[l].full.defined()) return;
    slots_[l].full = zeros({layers_[l].padded(job_.size)}, job_.floats());
    slots_[l].work = comm_.all_gather(slots_[l].full, layers_[l].my_shard.detach());
    ++whole_now_;
    most_whole_ = std::max(most_whole_, whole_now_);
  }
  // Layer l's full weight and bias (gathering them now if nobody prefetched them).
  std::pair<Tensor, Tensor> whole(size_t l) {
    prefetch(l);
    slots_[l].work->wait();
    const ShardedLinear& layer = layers_[l];
    const Tensor& full = slots_[l].full;
    return {full.narrow(0, 0, layer.in * layer.out).view({layer.in, layer.out}),
            full.narrow(0, layer.in * layer.out, layer.out)};
  }
  // Frees layer l's full copy (the tensors returned by whole() die with their last use).
  void release(size_t l) {
    slots_[l] = {};
    --whole_now_;
  }
  int most_whole() const { return most_whole_; }

 private:
  struct Slot {
    Tensor full;
    WorkPtr work;
  };
  std::vector<ShardedLinear>& layers_;
  CountingGroup& comm_;
  const Job& job_;
  std::vector<Slot> slots_;
  int whole_now_ = 0, most_whole_ = 0;
};

// y = x·W + b for layer l, its parameters gathered just in time, forward and backward.
Tensor zero3_linear(size_t l, const Tensor& x, std::vector<ShardedLinear>& layers,
                    Gatherer& gatherer, CountingGroup& comm, const Job& job) {
  Tensor y;
  {
    auto [weight, bias] = gatherer.whole(l);
    gatherer.prefetch(l + 1);  // travels while this layer computes
    autograd::NoGradGuard no_grad;
    y = linear(x, weight, bias);
    gatherer.release(l);
  }
  const ShardedLinear& layer = layers[l];
  autograd::record(
      "Zero3LinearBackward", {x, layer.my_shard}, {y},
      [l, x = x.detach(), &layer, &gatherer, &comm, &job](const autograd::BackwardArgs& a) {
        auto [weight, bias] = gatherer.whole(l);  // gathered again: forward freed it
        if (l > 0) gatherer.prefetch(l - 1);      // backward goes from the last layer to the first
        const Tensor& dy = a.grad();
        Tensor dx = a.needs(0) ? matmul(dy, weight.transpose(0, 1)) : Tensor();
        // This rank's weight and bias gradients, laid out as the parameters are, then averaged
        // over the ranks shard by shard: rank r keeps only shard r.
        Tensor flat_grad = zeros({layer.padded(job.size)}, job.floats());
        ops::copy_(flat_grad.narrow(0, 0, layer.in * layer.out).view({layer.in, layer.out}),
                   matmul(x.transpose(0, 1), dy));
        ops::copy_(flat_grad.narrow(0, layer.in * layer.out, layer.out), sum(dy, {0}));
        Tensor shard_grad = zeros({layer.shard}, job.floats());
        comm.reduce_scatter(shard_grad, flat_grad, dist::ReduceOp::Avg)->wait();
        gatherer.release(l);
        return std::vector<Tensor>{dx, shard_grad};
      });
  return y;
}

}  // namespace

Outcome run_step(Job& job, CountingGroup& comm) {
  // Start from the same weights as everyone (TinyMlp's seed), keep this rank's shards only.
  std::vector<ShardedLinear> layers;
  {
    TinyMlp whole(job.device);
    for (nn::Linear* linear : whole.linears) {
      ShardedLinear layer{linear->weight.size(0), linear->weight.size(1), 0, {}};
      const FlatLayout layout({linear->weight, linear->bias}, job.size);
      Tensor flat = zeros({layout.padded}, job.floats());
      layout.pack_values(flat);
      layer.shard = layout.shard;
      layer.my_shard = layout.owned(flat, job.rank).clone().requires_grad_();
      layers.push_back(layer);
    }
  }  // the whole model is gone: from here on this rank holds 1/W of it
  std::vector<Tensor> shards;
  for (const ShardedLinear& layer : layers) shards.push_back(layer.my_shard);
  optim::AdamW opt(one_group(shards), adamw_options());

  Gatherer gatherer(layers, comm, job);
  auto model = [&](const Tensor& x) {
    return mlp_forward(x, [&](size_t l, const Tensor& h) {
      return zero3_linear(l, h, layers, gatherer, comm, job);
    });
  };
  const std::vector<double> losses = train_data_parallel(job, comm, model, [&] {
    opt.step();  // on the shards, where the reduce-scatters left their gradients
    opt.zero_grad();
  });

  // The check: gather every layer once more (not part of training) and compare.
  Outcome out;
  const Reference ref = train_one_process(job);
  out.check.values("losses", losses, ref.losses);
  for (size_t l = 0; l < layers.size(); ++l) {
    auto [weight, bias] = gatherer.whole(l);
    out.check.tensor("linear" + std::to_string(l) + ".weight", weight,
                     ref.model->linears[l]->weight);
    out.check.tensor("linear" + std::to_string(l) + ".bias", bias, ref.model->linears[l]->bias);
    gatherer.release(l);
  }
  int64_t padded_total = 0;
  for (const LinearShape& s : mlp_linear_shapes())
    padded_total += padded_to(s.in * s.out + s.out, job.size);
  const int64_t layer_count = static_cast<int64_t>(mlp_linear_shapes().size());
  out.theory.add(kAllGather, 2 * layer_count, 2 * 4 * padded_total);
  out.theory.add(kReduceScatter, layer_count, 4 * padded_total);
  out.theory_reason = "per layer (" + std::to_string(layer_count) +
                      "): an all_gather forward, "
                      "one again backward and a reduce_scatter of its gradients, each 4 x its "
                      "weight and bias padded to W shards (" +
                      std::to_string(padded_total) + " values in all); at most " +
                      std::to_string(gatherer.most_whole()) + " layers were whole at once";
  return out;
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
