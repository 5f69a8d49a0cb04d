#include "tessera/dist/tensor_parallel.h"

#include "tessera/autograd/autocast.h"
#include "tessera/autograd/functions.h"
#include "tessera/dist/rank_groups.h"

namespace tessera::dist {

using autograd::BackwardArgs;
using autograd::record;
using Grads = std::vector<Tensor>;

// ---- the conjugate functions ----

Tensor copy_to_tensor_parallel_region(const Tensor& x, const GroupPtr& group) {
  Tensor y = ops::alias(x);
  record("CopyToTensorParallelRegionBackward", {x}, {y}, [group](const BackwardArgs& a) {
    // A fresh buffer: the incoming gradient may be shared with other consumers of it.
    Tensor summed = ops::clone(a.grad());
    group->all_reduce(summed, ReduceOp::Sum)->wait();
    return Grads{summed};
  });
  return y;
}

Tensor reduce_from_tensor_parallel_region(const Tensor& partial, const GroupPtr& group) {
  Tensor y = ops::clone(partial);
  group->all_reduce(y, ReduceOp::Sum)->wait();
  record("ReduceFromTensorParallelRegionBackward", {partial}, {y},
         [](const BackwardArgs& a) { return Grads{a.grad()}; });
  return y;
}

Tensor gather_from_tensor_parallel_region(const Tensor& x, const std::vector<int64_t>& widths,
                                          const GroupPtr& group) {
  const int rank = group->rank();
  TESSERA_CHECK(static_cast<int>(widths.size()) == group->size() && x.dim() >= 1 &&
                    x.size(-1) == widths[rank],
                "gather_from_tensor_parallel_region: ", autograd::describe(x), " on rank ", rank,
                " of ", group->size(), " does not end in its width ",
                rank < static_cast<int>(widths.size()) ? widths[rank] : -1);
  std::vector<Tensor> parts;
  int64_t offset = 0;
  for (int r = 0; r < group->size(); ++r) {
    Shape shape = x.shape();
    shape.back() = widths[r];
    parts.push_back(empty(shape, {.dtype = x.dtype(), .device = x.device()}));
    if (r < rank) offset += widths[r];
  }
  group->all_gather(parts, ops::contiguous(x))->wait();
  Tensor y = ops::cat(parts, -1);
  record("GatherFromTensorParallelRegionBackward", {x}, {y},
         [offset, width = widths[rank]](const BackwardArgs& a) {
           return Grads{ops::contiguous(ops::narrow(a.grad(), a.grad().dim() - 1, offset, width))};
         });
  return y;
}

// ---- sequence parallelism ----

void check_sequence_split(int64_t tokens, int world) {
  TESSERA_CHECK(world >= 1 && tokens % world == 0, "sequence parallelism: T = ", tokens,
                " tokens do not split evenly over tp_size ", world);
}

namespace {
std::vector<int64_t> first_two_swapped(int64_t dims) {
  std::vector<int64_t> order(dims);
  for (int64_t i = 0; i < dims; ++i) order[i] = i;
  std::swap(order[0], order[1]);
  return order;
}
// [B, T, ...] -> [W, B, T/W, ...]: rank r's slice of every sequence made one block, which is
// what reduce-scatter and all-gather chunk (the cost of the batch-first layout: one copy).
Tensor slices_first(const Tensor& x, int world) {
  Shape split = x.shape();
  split[1] /= world;
  split.insert(split.begin() + 1, world);  // [B, W, T/W, ...]
  return ops::contiguous(ops::permute(ops::reshape(ops::contiguous(x), split),
                                      first_two_swapped(static_cast<int64_t>(split.size()))));
}
// The inverse: [W, B, T/W, ...] -> [B, T, ...].
Tensor slices_back(const Tensor& blocks) {
  Shape whole(blocks.shape().begin() + 1, blocks.shape().end());
  whole[1] *= blocks.size(0);
  return ops::reshape(ops::contiguous(ops::permute(blocks, first_two_swapped(blocks.dim()))),
                      whole);
}
Tensor all_gather_sequence(const Tensor& slice, ProcessGroup& group) {
  Shape blocks = slice.shape();
  blocks.insert(blocks.begin(), group.size());
  Tensor out = empty(blocks, {.dtype = slice.dtype(), .device = slice.device()});
  group.all_gather(out, ops::contiguous(slice))->wait();
  return slices_back(out);
}
Tensor reduce_scatter_sequence(const Tensor& whole, ProcessGroup& group) {
  check_sequence_split(whole.size(1), group.size());
  Shape slice = whole.shape();
  slice[1] /= group.size();
  Tensor out = empty(slice, {.dtype = whole.dtype(), .device = whole.device()});
  group.reduce_scatter(out, slices_first(whole, group.size()), ReduceOp::Sum)->wait();
  return out;
}
}  // namespace

Tensor gather_from_sequence_parallel_region(const Tensor& x, const GroupPtr& group) {
  TESSERA_CHECK(x.dim() >= 2, "gather_from_sequence_parallel_region: x must be [B, T/W, ...], got ",
                autograd::describe(x));
  Tensor y = all_gather_sequence(x, *group);
  record("GatherFromSequenceParallelRegionBackward", {x}, {y}, [group](const BackwardArgs& a) {
    return Grads{reduce_scatter_sequence(a.grad(), *group)};
  });
  return y;
}

Tensor reduce_scatter_to_sequence_parallel_region(const Tensor& partial, const GroupPtr& group) {
  TESSERA_CHECK(partial.dim() >= 2,
                "reduce_scatter_to_sequence_parallel_region: partial must be [B, T, ...], got ",
                autograd::describe(partial));
  Tensor y = reduce_scatter_sequence(partial, *group);
  record("ReduceScatterToSequenceParallelRegionBackward", {partial}, {y},
         [group](const BackwardArgs& a) { return Grads{all_gather_sequence(a.grad(), *group)}; });
  return y;
}

// ---- shard specs ----

int64_t ShardSpec::local_size(int rank) const {
  int64_t n = 0;
  for (const Range& r : pieces.at(rank)) n += r.end - r.begin;
  return n;
}

ShardSpec ShardSpec::contiguous(int64_t dim, int64_t n, int world) {
  TESSERA_CHECK(world >= 1 && n >= world, "ShardSpec: ", n, " rows cannot be split over ", world,
                " ranks");
  ShardSpec spec{dim, {}};
  for (int r = 0; r < world; ++r) spec.pieces.push_back({{r * n / world, (r + 1) * n / world}});
  return spec;
}

ShardSpec ShardSpec::blocked(int64_t dim, int64_t n, int64_t blocks, int world) {
  TESSERA_CHECK(world >= 1 && blocks >= 1 && n % (blocks * world) == 0, "ShardSpec: ", n,
                " columns are not ", blocks, " blocks of a multiple of ", world, " ranks");
  const int64_t block = n / blocks, part = block / world;
  ShardSpec spec{dim, std::vector<std::vector<Range>>(world)};
  for (int r = 0; r < world; ++r)
    for (int64_t b = 0; b < blocks; ++b)
      spec.pieces[r].push_back({b * block + r * part, b * block + (r + 1) * part});
  return spec;
}

Tensor take_shard(const Tensor& full, const ShardSpec& spec, int rank) {
  if (spec.replicated()) return ops::clone(full);
  std::vector<Tensor> parts;
  for (const ShardSpec::Range& r : spec.pieces.at(rank))
    parts.push_back(ops::narrow(full, spec.dim, r.begin, r.end - r.begin));
  return parts.size() == 1 ? ops::clone(parts[0]) : ops::cat(parts, spec.dim);
}

Tensor gather_shard(const Tensor& local, const ShardSpec& spec, const Shape& full_shape,
                    ProcessGroup& group) {
  if (spec.replicated()) return ops::clone(local);
  TESSERA_CHECK(static_cast<int>(spec.pieces.size()) == group.size(), "gather_shard: a spec of ",
                spec.pieces.size(), " ranks over a group of ", group.size());
  std::vector<Tensor> parts;
  for (int r = 0; r < group.size(); ++r) {
    Shape shape = full_shape;
    shape[spec.dim] = spec.local_size(r);
    parts.push_back(empty(shape, {.dtype = local.dtype(), .device = local.device()}));
  }
  group.all_gather(parts, ops::contiguous(local))->wait();
  Tensor full = empty(full_shape, {.dtype = local.dtype(), .device = local.device()});
  for (int r = 0; r < group.size(); ++r) {
    int64_t offset = 0;
    for (const ShardSpec::Range& piece : spec.pieces[r]) {
      const int64_t n = piece.end - piece.begin;
      ops::copy_(ops::narrow(full, spec.dim, piece.begin, n),
                 ops::narrow(parts[r], spec.dim, offset, n));
      offset += n;
    }
  }
  return full;
}

// ---- the layers ----

namespace {
// The dimension of a weight that holds its outputs (column-parallel) or inputs (row-parallel).
int64_t output_dim(WeightLayout layout) { return layout == WeightLayout::in_out ? 1 : 0; }
int64_t input_dim(WeightLayout layout) { return 1 - output_dim(layout); }

Tensor project(const Tensor& x, const Tensor& weight, WeightLayout layout, const Tensor& bias) {
  return linear(x, layout == WeightLayout::in_out ? weight : weight.t(), bias);
}

ShardSpec along(ShardSpec spec, int64_t dim) {
  spec.dim = dim;
  return spec;
}
}  // namespace

ColumnParallelLinear::ColumnParallelLinear(const Tensor& full_weight, const Tensor& full_bias,
                                           WeightLayout layout_in, const ShardSpec& outputs,
                                           GroupPtr group)
    : layout(layout_in),
      weight_spec(along(outputs, output_dim(layout_in))),
      bias_spec(along(outputs, 0)),
      group_(std::move(group)) {
  weight = register_parameter("weight", take_shard(full_weight, weight_spec, group_->rank()));
  if (full_bias.defined())
    bias = register_parameter("bias", take_shard(full_bias, bias_spec, group_->rank()));
}

Tensor ColumnParallelLinear::forward(const Tensor& x) {
  return forward_in_region(copy_to_tensor_parallel_region(x, group_));
}

Tensor ColumnParallelLinear::forward_in_region(const Tensor& x) {
  return project(x, weight, layout, bias);
}

RowParallelLinear::RowParallelLinear(const Tensor& full_weight, const Tensor& full_bias,
                                     WeightLayout layout_in, const ShardSpec& inputs,
                                     GroupPtr group)
    : layout(layout_in),
      weight_spec(along(inputs, input_dim(layout_in))),
      group_(std::move(group)) {
  weight = register_parameter("weight", take_shard(full_weight, weight_spec, group_->rank()));
  if (full_bias.defined()) bias = register_parameter("bias", ops::clone(full_bias));
}

Tensor RowParallelLinear::partial(const Tensor& x_local) {
  return project(x_local, weight, layout, Tensor());
}

Tensor RowParallelLinear::forward(const Tensor& x_local) {
  const Tensor y = reduce_from_tensor_parallel_region(partial(x_local), group_);
  // Added once, after the sum: on every rank the same whole bias, so its gradient (the sum of
  // dy over the rows) is the same everywhere and the replicas stay equal.
  return bias.defined() ? y + bias : y;
}

VocabParallelEmbedding::VocabParallelEmbedding(const Tensor& full_weight, GroupPtr group)
    : spec(ShardSpec::contiguous(0, full_weight.size(0), group->size())), group_(std::move(group)) {
  range_ = spec.pieces[group_->rank()][0];
  weight = register_parameter("weight", take_shard(full_weight, spec, group_->rank()));
}

std::vector<int64_t> VocabParallelEmbedding::vocab_widths() const {
  std::vector<int64_t> widths;
  for (size_t r = 0; r < spec.pieces.size(); ++r) widths.push_back(spec.local_size(r));
  return widths;
}

namespace {
// ids in [begin, end) (bool, ids' shape).
Tensor in_vocab_range(const Tensor& ids, int64_t begin, int64_t end) {
  return ops::binary(BinaryOp::LogicalAnd, ops::binary(BinaryOp::Ge, ids, double(begin)),
                     ops::binary(BinaryOp::Lt, ids, double(end)));
}
// ids - begin where in range, 0 elsewhere (a row every rank has; its lookups are masked).
Tensor local_ids(const Tensor& ids, const Tensor& in_range, int64_t begin) {
  return ops::where(in_range, ops::binary(BinaryOp::Sub, ids, double(begin)), zeros_like(ids));
}
}  // namespace

Tensor VocabParallelEmbedding::forward(const Tensor& ids) {
  return reduce_from_tensor_parallel_region(partial(ids), group_);
}

Tensor VocabParallelEmbedding::partial(const Tensor& ids_in) {
  TESSERA_CHECK(is_integral(ids_in.dtype()) && ids_in.dtype() != DType::boolean,
                "VocabParallelEmbedding: ids must be integers, got ", autograd::describe(ids_in));
  const Tensor ids = ops::contiguous(ids_in);
  const Tensor in_range = in_vocab_range(ids, range_.begin, range_.end);
  const Tensor rows = embedding(weight, local_ids(ids, in_range, range_.begin));
  // Other ranks' ids contribute zeros, so the sum is every id's own row, exactly.
  return masked_fill(rows, ops::unsqueeze(ops::unary(UnaryOp::LogicalNot, in_range), -1), 0.0);
}

Tensor VocabParallelEmbedding::logits(const Tensor& h) {
  return logits_in_region(copy_to_tensor_parallel_region(h, group_));
}

Tensor VocabParallelEmbedding::logits_in_region(const Tensor& h) {
  // Under autocast the head (the largest matmul) runs in the compute dtype, as GPT's does.
  return matmul(autograd::autocast(h), autograd::autocast(weight).t());
}

// ---- entering and leaving the regions ----

Tensor Regions::enter(const Tensor& x) const {
  return sequence_parallel ? gather_from_sequence_parallel_region(x, group)
                           : copy_to_tensor_parallel_region(x, group);
}

Tensor Regions::leave(RowParallelLinear& row, const Tensor& x_local) const {
  const Tensor y = sequence_parallel
                       ? reduce_scatter_to_sequence_parallel_region(row.partial(x_local), group)
                       : reduce_from_tensor_parallel_region(row.partial(x_local), group);
  return row.bias.defined() ? y + whole(row.bias) : y;
}

Tensor Regions::whole(const Tensor& parameter) const {
  return sequence_parallel && parameter.defined() ? copy_to_tensor_parallel_region(parameter, group)
                                                  : parameter;
}

Tensor Regions::embed(VocabParallelEmbedding& embedding, const Tensor& ids) const {
  const Tensor rows = embedding.partial(ids);
  return sequence_parallel ? reduce_scatter_to_sequence_parallel_region(rows, group)
                           : reduce_from_tensor_parallel_region(rows, group);
}

Tensor Regions::positions(const Tensor& rows) const {
  if (!sequence_parallel) return rows;
  const int64_t slice = rows.size(0) / group->size();
  return copy_to_tensor_parallel_region(rows, group).narrow(0, group->rank() * slice, slice);
}

// ---- the loss ----

Tensor vocab_parallel_cross_entropy(const Tensor& local_logits, const Tensor& targets,
                                    int64_t vocab_begin, const GroupPtr& group,
                                    int64_t ignore_index, Reduction reduction) {
  const char* op = "vocab_parallel_cross_entropy";
  TESSERA_CHECK(reduction != Reduction::None, op,
                ": reduces to the mean or the sum over the targets, not per target");
  TESSERA_CHECK(local_logits.dim() >= 1 && is_floating(local_logits.dtype()), op,
                ": logits must be floating [..., V_r], got ", autograd::describe(local_logits));
  const Shape rows_shape(local_logits.shape().begin(), local_logits.shape().end() - 1);
  TESSERA_CHECK(targets.shape() == rows_shape && is_integral(targets.dtype()), op,
                ": targets must be integers of shape ", shape_str(rows_shape), ", got ",
                autograd::describe(targets));
  const int64_t width = local_logits.size(-1), rows = targets.numel();
  const Device device = local_logits.device();
  // f16/bf16 logits are reduced in f32, as the fused classifier does.
  const DType compute = local_logits.dtype() == DType::f64 ? DType::f64 : DType::f32;
  const Tensor z =
      ops::to(ops::reshape(ops::contiguous(local_logits), {rows, width}), device, compute);
  const Tensor y = ops::to(ops::reshape(ops::contiguous(targets), {rows}), device, DType::i64);

  // The rows' maxima over the whole vocabulary, for a stable exp.
  Tensor row_max = ops::amax(z, {1});
  group->all_reduce(row_max, ReduceOp::Max)->wait();
  const Tensor exps = ops::unary(UnaryOp::Exp, ops::sub(z, ops::unsqueeze(row_max, 1)));
  // Each target's logit lives on one rank; the others add zero.
  const Tensor in_range = in_vocab_range(y, vocab_begin, vocab_begin + width);
  const Tensor column = ops::unsqueeze(local_ids(y, in_range, vocab_begin), 1);
  const Tensor target_logit = ops::where(in_range, ops::squeeze(ops::gather(z, 1, column), 1),
                                         zeros({rows}, {.dtype = compute, .device = device}));
  // One all-reduce of [2, N]: the sums of exponentials and the target logits.
  Tensor sums = ops::stack({ops::sum(exps, {1}), target_logit}, 0);
  group->all_reduce(sums, ReduceOp::Sum)->wait();
  const Tensor sum_exp = ops::select(sums, 0, 0);
  // log Σ exp(z) − z_target = log Σ exp(z − max) + max − z_target.
  const Tensor per_row =
      ops::sub(ops::add(ops::unary(UnaryOp::Log, sum_exp), row_max), ops::select(sums, 0, 1));
  const Tensor valid = ops::to(ops::binary(BinaryOp::Ne, y, double(ignore_index)), device, compute);
  // The mean divides by the targets that count; the sum by one.
  const Tensor count = reduction == Reduction::Sum
                           ? full({}, 1.0, {.dtype = compute, .device = device})
                           : ops::sum(valid);
  Tensor loss =
      ops::to(ops::div(ops::sum(ops::mul(per_row, valid)), count), device, local_logits.dtype());

  record("VocabParallelCrossEntropyBackward", {local_logits}, {loss},
         [exps, sum_exp, column, in_range, valid, count, shape = local_logits.shape(),
          dtype = local_logits.dtype()](const BackwardArgs& a) {
           // d loss / d z = (softmax − onehot) · valid / count, times the incoming gradient.
           const Tensor softmax = ops::div(exps, ops::unsqueeze(sum_exp, 1));
           const Tensor onehot =
               ops::scatter(zeros_like(exps), 1, column,
                            ops::unsqueeze(ops::to(in_range, exps.device(), exps.dtype()), 1));
           const Tensor weight =
               ops::mul(ops::div(valid, count), ops::to(a.grad(), exps.device(), exps.dtype()));
           const Tensor dz = ops::mul(ops::sub(softmax, onehot), ops::unsqueeze(weight, 1));
           return Grads{ops::to(ops::reshape(dz, shape), dz.device(), dtype)};
         });
  return loss;
}

// ---- the groups ----

GroupPtr tensor_parallel_group(ProcessGroup& world, int tp_size) {
  return consecutive_rank_group(world, tp_size, "tensor parallelism: tp_size");
}

}  // namespace tessera::dist
