// Tensor parallelism (Megatron-LM's): the ranks of one group run the SAME rows through a layer
// and each keeps a slice of its big matrices. docs/parallelism.md walks through it;
// ladders/dist/07_tensor_parallel.cpp teaches the same in one file.
//
// The pieces, bottom up:
//   - the two conjugate functions ("f" and "g"): copy_to_tensor_parallel_region (identity
//     forward, all-reduce of the gradient backward) and reduce_from_tensor_parallel_region
//     (all-reduce of partial sums forward, identity backward); and the vocabulary gather of
//     the logits (forward()'s full logits);
//   - ShardSpec: which ranges of one dimension of a full parameter a rank keeps, with
//     take_shard (the rank's slice, from the full tensor) and gather_shard (the full tensor,
//     from every rank's slice);
//   - the layers: ColumnParallelLinear (outputs split: whole heads of q/k/v, hidden units of
//     an MLP), RowParallelLinear (inputs split; its bias added once, after the all-reduce),
//     VocabParallelEmbedding (vocabulary rows in contiguous ranges; ids outside a rank's range
//     masked, the partial embeddings all-reduced) and vocab_parallel_cross_entropy (the max and
//     the sums of exponentials all-reduced; the logits are never gathered);
//   - tensor_parallel_group: the group of consecutive ranks of the world that this rank
//     belongs to, refusing a world size that tp_size does not divide.
// The models built from these are in dist/tensor_parallel_models.h.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/autograd/functions.h"
#include "tessera/dist/process_group.h"
#include "tessera/nn/module.h"

namespace tessera::dist {

using GroupPtr = std::shared_ptr<ProcessGroup>;

// ---- the conjugate functions ----
// f: identity forward; backward, the all-reduce (sum) of the gradient. At the entry of a
// tensor-parallel region: every rank uses the whole input, so its gradient is the sum of the
// ranks' contributions.
Tensor copy_to_tensor_parallel_region(const Tensor& x, const GroupPtr& group);
// g: the all-reduce (sum) of partial results forward; backward, identity (each rank's part
// entered the sum with weight one). At the exit of a region (after a row-parallel linear).
Tensor reduce_from_tensor_parallel_region(const Tensor& partial, const GroupPtr& group);
// x [..., n_r] (rank r's n_r columns of the last dimension, n_r from `widths`) -> [..., sum n_r]
// on every rank, in rank order; backward, this rank's columns of the gradient (no
// communication). forward()'s full logits from the vocabulary-parallel head.
Tensor gather_from_tensor_parallel_region(const Tensor& x, const std::vector<int64_t>& widths,
                                          const GroupPtr& group);

// ---- sequence parallelism (Korthikanti et al. 2022) ----
// Outside the tensor-parallel regions each rank keeps tokens [r·T/W, (r+1)·T/W) of every
// sequence ([B, T/W, C]), so the norms, residuals and biases run on a slice, not W times over.
// Entering a region: x [B, T/W, ...] -> [B, T, ...] on every rank (all-gather); backward, the
// reduce-scatter of the gradient into the slices (the sum over ranks f did, kept per slice).
Tensor gather_from_sequence_parallel_region(const Tensor& x, const GroupPtr& group);
// Leaving a region: partial sums [B, T, ...] -> this rank's [B, T/W, ...] of their sum over the
// ranks (reduce-scatter); backward, the all-gather of the slices' gradients.
Tensor reduce_scatter_to_sequence_parallel_region(const Tensor& partial, const GroupPtr& group);
// Refuses T tokens that W ranks cannot split evenly, naming both (before any communication).
void check_sequence_split(int64_t tokens, int world);

// ---- how a full parameter is cut ----
struct ShardSpec {
  struct Range {
    int64_t begin = 0, end = 0;
  };
  int64_t dim = -1;  // the dimension cut; -1: the parameter is kept whole on every rank
  // per rank: the ranges of `dim` it keeps, laid end to end in its local tensor
  std::vector<std::vector<Range>> pieces;
  bool replicated() const { return dim < 0; }
  int64_t local_size(int rank) const;
  static ShardSpec whole() { return {}; }
  // [r·n/W, (r+1)·n/W) of `dim` for rank r: contiguous ranges differing by at most one
  // (uneven vocabularies); n >= W.
  static ShardSpec contiguous(int64_t dim, int64_t n, int world);
  // `blocks` equal blocks of `dim`, each cut into W contiguous parts: rank r keeps part r of
  // every block (GPT-2's c_attn: its q | k | v blocks, each split by heads).
  static ShardSpec blocked(int64_t dim, int64_t n, int64_t blocks, int world);
};

// Each parameter of a split model (by the full model's name): how it is cut, and its full shape.
using TensorShards = std::map<std::string, std::pair<ShardSpec, Shape>>;
// The cuts of `split`'s parameters (a module built of the layers below, under the full model's
// names) on rank `tp_rank`, each with its full shape in `full`. Refuses a parameter of split
// that is not one of full's or whose shape is not its slice's; with `every_parameter`, one of
// full's that split lacks (a pipeline stage holds some of them).
TensorShards tensor_parallel_shards(const nn::Module& split, const nn::Module& full, int tp_rank,
                                    bool every_parameter);

// Rank `rank`'s slice of `full` (a new contiguous tensor).
Tensor take_shard(const Tensor& full, const ShardSpec& spec, int rank);
// Collective over `group`: the full tensor of `full_shape` from every rank's `local` slice
// (on every rank). A replicated parameter is returned as it is.
Tensor gather_shard(const Tensor& local, const ShardSpec& spec, const Shape& full_shape,
                    ProcessGroup& group);

// ---- the layers ----
// The layout of a linear's weight: nn::Linear's [in, out] (GPT-2's Conv1D) or
// nn::TorchLinear's [out, in] (torch.nn.Linear, Llama's projections).
enum class WeightLayout { in_out, out_in };

// y_local = x · W[:, my outputs] + b[my outputs]: this rank's outputs of a linear whose input
// every rank holds whole. forward(x) applies f to x first; forward_in_region(x) is for an x
// that already went through f (several column-parallel linears reading one input: Llama's
// q/k/v, gate/up share one f, hence one all-reduce backward).
class ColumnParallelLinear : public nn::Module {
 public:
  // The rank's slices of the full weight (and bias, may be undefined) by `outputs`, the
  // spec of the output dimension (its `dim` is ignored: the layout says which it is).
  ColumnParallelLinear(const Tensor& full_weight, const Tensor& full_bias, WeightLayout layout,
                       const ShardSpec& outputs, GroupPtr group);
  Tensor forward(const Tensor& x) override;
  Tensor forward_in_region(const Tensor& x);
  std::string type_name() const override { return "ColumnParallelLinear"; }
  Tensor weight, bias;
  WeightLayout layout;
  ShardSpec weight_spec, bias_spec;

 private:
  GroupPtr group_;
};

// y = g(x_local · W[my inputs, :]) + b: the rank's inputs (the outputs of a column-parallel
// linear) times its rows of the weight give a partial sum; the all-reduce adds them, and the
// bias, kept whole on every rank, is added once after it.
class RowParallelLinear : public nn::Module {
 public:
  RowParallelLinear(const Tensor& full_weight, const Tensor& full_bias, WeightLayout layout,
                    const ShardSpec& inputs, GroupPtr group);
  Tensor forward(const Tensor& x_local) override;
  // x_local · W[my inputs, :]: this rank's partial sum, before any reduction and the bias.
  Tensor partial(const Tensor& x_local);
  std::string type_name() const override { return "RowParallelLinear"; }
  Tensor weight, bias;
  WeightLayout layout;
  ShardSpec weight_spec;

 private:
  GroupPtr group_;
};

// Rows [begin, end) of a [V, C] embedding table (ShardSpec::contiguous over V). forward(ids)
// looks up the ids in this rank's range, zeroes the rest and all-reduces: every rank ends with
// the whole embedding of every id. logits(h) is the tied (or untied) output head on this
// table: this rank's vocabulary columns of h · Wᵀ, with f applied to h.
class VocabParallelEmbedding : public nn::Module {
 public:
  VocabParallelEmbedding(const Tensor& full_weight, GroupPtr group);
  Tensor forward(const Tensor& ids) override;
  Tensor logits(const Tensor& h);
  // The lookup's rows of this rank's range, zeros elsewhere, before any reduction.
  Tensor partial(const Tensor& ids);
  // This rank's logit columns of an h that already went through f (or a sequence gather).
  Tensor logits_in_region(const Tensor& h);
  std::string type_name() const override { return "VocabParallelEmbedding"; }
  int64_t vocab_begin() const { return range_.begin; }
  int64_t vocab_end() const { return range_.end; }
  // Every rank's number of rows, in rank order.
  std::vector<int64_t> vocab_widths() const;
  Tensor weight;  // [end - begin, C]
  ShardSpec spec;

 private:
  GroupPtr group_;
  ShardSpec::Range range_;
};

// The mean cross-entropy over targets != ignore_index of logits whose vocabulary is split:
// local_logits [..., V_r] are this rank's columns [vocab_begin, vocab_begin + V_r) of the full
// logits, targets [...] full ids. Forward: one all-reduce (max) of the rows' maxima and one
// (sum) of the rows' sums of exponentials with their target logits, 3·N values for N rows; the
// [N, V] logits are never gathered. Backward: softmax − onehot on the local columns, no
// communication. The same value on every rank. Reduction::Sum gives the sum over those targets
// instead (a pipeline's micro-batch, over the whole batch's count); None is refused.
Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets,
                                    int64_t vocab_begin, const GroupPtr& group,
                                    int64_t ignore_index = -100,
                                    Reduction reduction = Reduction::Mean);

// ---- entering and leaving the regions ----
// What a parallel block does at the borders of its regions: with tensor parallelism alone,
// f on entry and g after a row-parallel linear (then its bias), every activation outside the
// regions whole ([B, T, C]); with sequence parallelism, the sequence gather on entry and the
// reduce-scatter on exit, activations outside in slices ([B, T/W, C]), and `whole` applies f to
// each parameter kept whole (norms, row-parallel biases): each rank's gradient of it then
// covers only its tokens, and f's backward sums them over the ranks.
struct Regions {
  GroupPtr group;
  bool sequence_parallel = false;
  Tensor enter(const Tensor& x) const;
  Tensor leave(RowParallelLinear& row, const Tensor& x_local) const;
  Tensor whole(const Tensor& parameter) const;
  // The embedding's partial rows: all-reduced, or reduce-scattered into this rank's slice.
  Tensor embed(VocabParallelEmbedding& embedding, const Tensor& ids) const;
  // GPT-2's position rows [T, C] (the same on every rank): whole, or this rank's slice of them
  // (their gradient summed over the ranks by f).
  Tensor positions(const Tensor& rows) const;
};

// ---- the groups ----
// Collective over `world`: splits it into world.size() / tp_size groups of consecutive ranks
// ([0, tp), [tp, 2·tp), ...) and returns this rank's. Refuses, before any communication, a
// tp_size < 1 or one that does not divide the world size, naming both.
GroupPtr tensor_parallel_group(ProcessGroup& world, int tp_size);

}  // namespace tessera::dist
