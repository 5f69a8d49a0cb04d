// The GPT block of steps 7, 8 and 11 (tensor, sequence and context parallelism): its parameters,
// which slice of each a tensor-parallel rank owns, its forward (one code for the one process and
// for every rank, the communication left to the step) and its training loop.
//
// Activations are sequence-first, [T, B, d] (Megatron-LM's layout): a slice of the sequence is
// then one contiguous block of memory, which is what reduce-scatter and all-gather chunk.
#pragma once
#include "ladder.h"

namespace ladder::block {

constexpr int64_t kModel = 24, kHeads = 6, kHeadDim = kModel / kHeads, kInner = 4 * kModel;
constexpr int64_t kTokens = 6, kVocab = 11;
constexpr const char* kBlockProduction =
    "no production counterpart yet: Tessera has data parallelism, ZeRO (dist/ddp.cpp, "
    "dist/zero.cpp) and tensor and sequence parallelism (dist/tensor_parallel.h), no context "
    "parallelism";

// ---- the block's parameters, and which slice of each a rank owns ----
enum class Split { Whole, Columns, Rows };  // columns: of [in, out] weights (and their bias)
struct Parameter {
  std::string name;
  Shape shape;
  Split split;
  Tensor value;
};

inline std::vector<Parameter> block_parameter_list() {
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
inline Tensor slice_of(const Tensor& whole, Split split, int rank, int world) {
  if (split == Split::Whole) return whole;
  const int64_t dim = split == Split::Rows ? 0 : whole.dim() - 1;
  const int64_t piece = whole.size(dim) / world;
  return whole.narrow(dim, rank * piece, piece);
}

// The whole block, seeded (the same on every rank), as leaf parameters; LayerNorm 1 / 0.
inline std::vector<Parameter> whole_block(Device device) {
  Generator gen(kInitSeed);
  std::vector<Parameter> params = block_parameter_list();
  for (Parameter& p : params) {
    const bool norm = p.name.rfind("ln", 0) == 0;
    Tensor t =
        norm ? (p.name.ends_with("weight") ? ones(p.shape) : zeros(p.shape))
             : normal(p.shape, 0.0, p.shape.size() == 2 ? 1.0 / std::sqrt(double(p.shape[0])) : 0.1,
                      {}, &gen);
    p.value = ops::to(t, device, DType::f32).requires_grad_();
  }
  return params;
}

inline const Tensor& parameter(const std::vector<Parameter>& params, const std::string& name) {
  for (const Parameter& p : params)
    if (p.name == name) return p.value;
  TESSERA_CHECK(false, "no parameter ", name);
}

// Where the tensor-parallel regions of the block begin (before the column-parallel linears)
// and end (after the row-parallel ones): what step 7 and step 8 each fill in. Identity both
// for the one process. And how attention runs (step 11).
struct Regions {
  std::function<Tensor(const Tensor&)> enter = [](const Tensor& x) { return x; };
  std::function<Tensor(const Tensor&)> leave = [](const Tensor& x) { return x; };
  // Causal attention of q, k, v [B, H', T, D] (step 11 replaces it with ring attention).
  std::function<Tensor(const Tensor&, const Tensor&, const Tensor&)> attention =
      [](const Tensor& q, const Tensor& k, const Tensor& v) {
        return scaled_dot_product_attention(q, k, v, /*causal=*/true);
      };
};

// x [T', B, d] -> the mean cross-entropy of its tokens' predictions of y [T', B]; T' = T, or
// this rank's slice of the sequence (step 8).
inline Tensor block_loss(const std::vector<Parameter>& params, const Tensor& x, const Tensor& y,
                         const Regions& regions) {
  auto w = [&](const std::string& name) -> const Tensor& { return parameter(params, name); };
  const int64_t heads_here = w("q.weight").size(1) / kHeadDim;  // kHeads / W
  Tensor h = regions.enter(layer_norm(x, w("ln1.weight"), w("ln1.bias")));
  const int64_t T = h.size(0), B = h.size(1);  // the whole sequence inside the region
  auto split_heads = [&](const Tensor& t) {    // [T, B, H'·D] -> [B, H', T, D]
    return t.reshape({T, B, heads_here, kHeadDim}).permute({1, 2, 0, 3});
  };
  Tensor q = split_heads(linear(h, w("q.weight"), w("q.bias")));  // column-parallel: my heads
  // k has no bias: adding b to every key adds q·b to a whole row of scores, which the softmax
  // ignores, so its gradient is zero up to rounding, and AdamW would blow that noise up into
  // full-size steps that no two summation orders agree on.
  Tensor k = split_heads(linear(h, w("k.weight")));
  Tensor v = split_heads(linear(h, w("v.weight"), w("v.bias")));
  Tensor att = regions
                   .attention(q, k, v)  // [B, H', T, D]
                   .permute({2, 0, 1, 3})
                   .reshape({T, B, heads_here * kHeadDim});
  Tensor a = x + regions.leave(linear(att, w("o.weight"))) + w("o.bias");  // row-parallel

  Tensor h2 = regions.enter(layer_norm(a, w("ln2.weight"), w("ln2.bias")));
  Tensor hidden = gelu(linear(h2, w("fc.weight"), w("fc.bias")));  // column-parallel
  Tensor out =
      a + regions.leave(linear(hidden, w("proj.weight"))) + w("proj.bias");  // row-parallel

  Tensor logits = linear(out, w("head.weight"), w("head.bias"));
  return cross_entropy(logits.reshape({-1, kVocab}), y.reshape({-1}));
}

// How a step trains the block: its regions, which part of the batch this rank sees, what the
// loss is scaled by before backward, and what runs between backward and the update.
struct BlockTraining {
  Regions regions;
  std::function<Batch(const Batch&)> my_part = [](const Batch& b) { return b; };
  double loss_scale = 1;
  std::function<void()> after_backward = [] {};
};

// Trains `params` for the steps on the seeded batches of sequences (the same on every rank);
// returns each step's loss as this rank computed it (unscaled).
inline std::vector<double> train_block(std::vector<Parameter>& params, const Job& job,
                                       const BlockTraining& how, CountingGroup* comm) {
  std::vector<Tensor> leaves;
  for (const Parameter& p : params) leaves.push_back(p.value);
  optim::AdamW opt(one_group(leaves), adamw_options());
  std::vector<double> losses;
  for (int step = 0; step < job.options.steps; ++step) {
    Generator gen(7000 + step);
    const int64_t B = job.options.rows_per_rank;
    const Batch mine =
        how.my_part({ops::to(randn({kTokens, B, kModel}, {}, &gen), job.device, DType::f32),
                     ops::to(randint(0, kVocab, {kTokens, B}, {.dtype = DType::i64}, &gen),
                             job.device, DType::i64)});
    Tensor loss = block_loss(params, mine.x, mine.y, how.regions);
    (loss * how.loss_scale).backward();
    how.after_backward();
    opt.step();
    opt.zero_grad();
    if (comm) comm->end_step();
    losses.push_back(loss.item());
  }
  return losses;
}

// Every rank builds the whole block from the seed and keeps its slices as its parameters.
inline std::vector<Parameter> my_slices(const Job& job) {
  std::vector<Parameter> mine = whole_block(job.device);
  for (Parameter& p : mine)
    p.value = slice_of(p.value.detach(), p.split, job.rank, job.size).clone().requires_grad_();
  return mine;
}

// The losses and this rank's slices after training, against the unsplit block trained by one
// process on the whole batch.
inline void check_slices(ResultCheck& check, const std::vector<double>& losses,
                         const std::vector<Parameter>& mine, const Job& job) {
  std::vector<Parameter> reference = whole_block(job.device);
  const std::vector<double> reference_losses = train_block(reference, job, {}, nullptr);
  check.values("losses", losses, reference_losses);
  for (size_t i = 0; i < mine.size(); ++i)
    check.tensor(mine[i].name, mine[i].value,
                 slice_of(reference[i].value.detach(), mine[i].split, job.rank, job.size));
}

}  // namespace ladder::block
