// Step 7: tensor parallelism (Megatron-LM's; picotron's ColumnParallelLinear and
// RowParallelLinear).
//
// Data parallelism (steps 1-6) gives every rank different rows and the same model. Tensor
// parallelism gives every rank the SAME rows and a slice of every big matrix of the layer, so
// a layer too large for one device fits on W of them. One GPT block, pre-LayerNorm:
//
//   a = x + Attention(LN1(x))        y = a + MLP(LN2(a))        loss = CE(y·W_head + b_head)
//
// The MLP: fc [d, 4d] is split by COLUMNS (column-parallel: rank r computes hidden units
// [r·4d/W, (r+1)·4d/W) of every token, GELU applies to them independently), proj [4d, d] by
// ROWS (row-parallel: rank r multiplies its hidden units by its rows, which gives a PARTIAL
// sum of the output). One all-reduce adds the partial sums; proj's bias is added once, after.
// Attention is split by heads, the same way: q, k, v column-parallel (rank r owns whole heads:
// their attention needs nobody else), the output projection row-parallel.
//
// So each half of the block needs one all-reduce forward (after the row-parallel linear:
// "g" below) and one backward: the input of the column-parallel linears is used by every
// rank, so its gradient is the SUM of the ranks' contributions ("f" below, the identity
// forward, an all-reduce of the input gradient backward). 2 + 2 all-reduces of B·T·d values
// per block and step. The LayerNorms and the head stay whole on every rank: their inputs and
// the gradients reaching them are the same everywhere, so their replicas never drift apart.
//
// The check: the very same forward with the whole matrices and no communication is the one
// process; each rank's slices after the steps must equal the same slices of its result.
//
// Run: tessera launch --nproc-per-node 2 build/ladders/dist/ladder_07_tensor_parallel
#include "ladder.h"

using namespace ladder;

const LadderInfo kStep = {
    "07_tensor_parallel",
    "no production counterpart yet: Tessera has data parallelism and ZeRO (dist/ddp.cpp, "
    "dist/zero.cpp), no tensor parallelism"};

namespace {

constexpr int64_t kModel = 24, kHeads = 6, kHeadDim = kModel / kHeads, kInner = 4 * kModel;
constexpr int64_t kTokens = 7, kVocab = 11;

// ---- f and g, the two communicating functions (null `comm`: one process, identity) ----

// f: identity forward; backward, the all-reduce of the gradient of a tensor every rank used.
Tensor copy_to_parallel_region(const Tensor& x, CountingGroup* comm) {
  if (!comm) return x;
  Tensor y = raw::alias(x);
  autograd::record("CopyToParallelRegionBackward", {x}, {y},
                   [comm](const autograd::BackwardArgs& a) {
                     Tensor summed = a.grad().contiguous().clone();
                     comm->all_reduce(summed, dist::ReduceOp::Sum)->wait();
                     return std::vector<Tensor>{summed};
                   });
  return y;
}

// g: the all-reduce of the row-parallel linear's partial sums forward; backward, identity
// (every rank's partial sum contributed to the output with weight one).
Tensor reduce_from_parallel_region(const Tensor& partial, CountingGroup* comm) {
  if (!comm) return partial;
  Tensor y = partial.detach().contiguous().clone();
  comm->all_reduce(y, dist::ReduceOp::Sum)->wait();
  autograd::record("ReduceFromParallelRegionBackward", {partial}, {y},
                   [](const autograd::BackwardArgs& a) { return std::vector<Tensor>{a.grad()}; });
  return y;
}

// ---- the block's parameters, and which slice of each a rank owns ----
enum class Split { Whole, Columns, Rows };  // columns: of [in, out] weights (and their bias)
struct Parameter {
  std::string name;
  Shape shape;
  Split split;
  Tensor value;
};

std::vector<Parameter> block_parameter_list() {
  using S = Split;
  return {{"ln1.weight", {kModel}, S::Whole, {}},          {"ln1.bias", {kModel}, S::Whole, {}},
          {"q.weight", {kModel, kModel}, S::Columns, {}},  {"q.bias", {kModel}, S::Columns, {}},
          {"k.weight", {kModel, kModel}, S::Columns, {}},  // no k.bias: see block_loss
          {"v.weight", {kModel, kModel}, S::Columns, {}},  {"v.bias", {kModel}, S::Columns, {}},
          {"o.weight", {kModel, kModel}, S::Rows, {}},     {"o.bias", {kModel}, S::Whole, {}},
          {"ln2.weight", {kModel}, S::Whole, {}},          {"ln2.bias", {kModel}, S::Whole, {}},
          {"fc.weight", {kModel, kInner}, S::Columns, {}}, {"fc.bias", {kInner}, S::Columns, {}},
          {"proj.weight", {kInner, kModel}, S::Rows, {}},  {"proj.bias", {kModel}, S::Whole, {}},
          {"head.weight", {kModel, kVocab}, S::Whole, {}}, {"head.bias", {kVocab}, S::Whole, {}}};
}

// Rank r's part of a whole tensor: columns (the last dimension) or rows (the first), in W
// equal contiguous pieces. Heads are contiguous in q, k, v, so a column piece is whole heads.
Tensor slice_of(const Tensor& whole, Split split, int rank, int world) {
  if (split == Split::Whole) return whole;
  const int64_t dim = split == Split::Rows ? 0 : whole.dim() - 1;
  const int64_t piece = whole.size(dim) / world;
  return whole.narrow(dim, rank * piece, piece);
}

// The whole block, seeded (the same on every rank), as leaf parameters; LayerNorm 1 / 0.
std::vector<Parameter> whole_block(Device device) {
  Generator gen(kInitSeed);
  std::vector<Parameter> params = block_parameter_list();
  for (Parameter& p : params) {
    const bool norm = p.name.rfind("ln", 0) == 0;
    Tensor t =
        norm ? (p.name.ends_with("weight") ? ones(p.shape) : zeros(p.shape))
             : normal(p.shape, 0.0, p.shape.size() == 2 ? 1.0 / std::sqrt(double(p.shape[0])) : 0.1,
                      {}, &gen);
    p.value = raw::to(t, device, DType::f32).requires_grad_();
  }
  return params;
}

// ---- the forward: one code for the one process (comm null) and for every rank ----
Tensor block_loss(const std::vector<Parameter>& params, const Batch& batch, CountingGroup* comm) {
  auto w = [&](const std::string& name) -> const Tensor& {
    for (const Parameter& p : params)
      if (p.name == name) return p.value;
    TESSERA_CHECK(false, "no parameter ", name);
  };
  const int64_t B = batch.x.size(0), T = batch.x.size(1);
  const int64_t heads_here = w("q.weight").size(1) / kHeadDim;  // kHeads / W
  auto split_heads = [&](const Tensor& t) {
    return t.reshape({B, T, heads_here, kHeadDim}).transpose(1, 2);
  };

  Tensor h =
      copy_to_parallel_region(layer_norm(batch.x, w("ln1.weight"), w("ln1.bias")), comm);  // f
  Tensor q =
      split_heads(linear(h, w("q.weight"), w("q.bias")));  // column-parallel: this rank's heads
  // k has no bias: adding b to every key adds q·b to a whole row of scores, which the softmax
  // ignores, so its gradient is zero up to rounding, and AdamW would blow that noise up into
  // full-size steps that no two summation orders agree on.
  Tensor k = split_heads(linear(h, w("k.weight")));
  Tensor v = split_heads(linear(h, w("v.weight"), w("v.bias")));
  Tensor att = scaled_dot_product_attention(q, k, v, /*causal=*/true);
  att = att.transpose(1, 2).reshape({B, T, heads_here * kHeadDim});
  Tensor a = batch.x + reduce_from_parallel_region(linear(att, w("o.weight")), comm) +
             w("o.bias");  // g, row-parallel

  Tensor h2 = copy_to_parallel_region(layer_norm(a, w("ln2.weight"), w("ln2.bias")), comm);  // f
  Tensor hidden = gelu(linear(h2, w("fc.weight"), w("fc.bias")));  // column-parallel
  Tensor y = a + reduce_from_parallel_region(linear(hidden, w("proj.weight")), comm) +
             w("proj.bias");  // g

  Tensor logits = linear(y, w("head.weight"), w("head.bias"));
  return cross_entropy(logits.reshape({B * T, kVocab}), batch.y.reshape({B * T}));
}

// Trains `params` for the steps on the same seeded batches every rank sees; returns the losses.
std::vector<double> train(std::vector<Parameter>& params, const Job& job, CountingGroup* comm) {
  std::vector<Tensor> leaves;
  for (const Parameter& p : params) leaves.push_back(p.value);
  optim::AdamW opt(one_group(leaves), adamw_options());
  std::vector<double> losses;
  for (int step = 0; step < job.options.steps; ++step) {
    Generator gen(7000 + step);
    const int64_t B = job.options.rows_per_rank;
    Batch batch{raw::to(randn({B, kTokens, kModel}, {}, &gen), job.device, DType::f32),
                raw::to(randint(0, kVocab, {B, kTokens}, {.dtype = DType::i64}, &gen), job.device,
                        DType::i64)};
    Tensor loss = block_loss(params, batch, comm);
    loss.backward();
    opt.step();
    opt.zero_grad();
    if (comm) comm->end_step();
    losses.push_back(loss.item());
  }
  return losses;
}

}  // namespace

Outcome run_step(Job& job, CountingGroup& comm) {
  TESSERA_CHECK(kHeads % job.size == 0 && kInner % job.size == 0, "07_tensor_parallel: ", job.size,
                " ranks do not divide ", kHeads, " heads and ", kInner, " hidden units");
  // Every rank builds the whole block from the seed and keeps its slices as its parameters.
  std::vector<Parameter> mine = whole_block(job.device);
  for (Parameter& p : mine)
    p.value = slice_of(p.value.detach(), p.split, job.rank, job.size).clone().requires_grad_();
  const std::vector<double> losses = train(mine, job, &comm);

  std::vector<Parameter> reference = whole_block(job.device);
  const std::vector<double> reference_losses = train(reference, job, nullptr);

  Outcome out;
  out.check.values("losses", losses, reference_losses);
  for (size_t i = 0; i < mine.size(); ++i)
    out.check.tensor(mine[i].name, mine[i].value,
                     slice_of(reference[i].value.detach(), mine[i].split, job.rank, job.size));
  const int64_t activation_bytes = 4 * job.options.rows_per_rank * kTokens * kModel;
  out.theory.add(kAllReduce, 4, 4 * activation_bytes);
  out.theory_reason = "4 all_reduces of B x T x d = " + std::to_string(job.options.rows_per_rank) +
                      " x " + std::to_string(kTokens) + " x " + std::to_string(kModel) +
                      " floats (" + std::to_string(activation_bytes) +
                      " bytes): forward after the "
                      "row-parallel attention output and MLP proj, backward at the input of the "
                      "column-parallel q/k/v and fc";
  return out;
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
