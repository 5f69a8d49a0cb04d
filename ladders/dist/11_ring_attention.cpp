// Step 11: ring attention (context parallelism; Liu et al. 2023, picotron's context_parallel).
//
// Sequence parallelism (step 8) still gathers the whole sequence for attention. When even one
// layer's activations of the whole sequence are too many, the sequence must stay split there
// too: rank r keeps the queries, keys and values of its tokens [r·T/W, (r+1)·T/W), and the keys
// and values travel round a ring instead. W rounds: in each, a rank attends its queries to the
// chunk of keys and values it holds, then passes that chunk to rank r+1 and receives the next
// one from rank r-1 (point to point, send/recv). After the W rounds every query has met every
// key, and nobody ever held more than two chunks.
//
// Attention over a chunk at a time needs the online softmax: each chunk j gives its partial
// output o_j = softmax(s_j)·v_j and the log-sum-exp lse_j of its scores s_j, and two partial
// results merge exactly as lse = log(e^lse_a + e^lse_b), o = o_a·e^(lse_a-lse) + o_b·e^(lse_b-lse).
// Causal: the chunk of rank j < r is all past (no mask), rank r's own chunk needs the causal
// mask, chunks j > r are the future and are skipped (rank 0 then idles most rounds: zig-zag
// chunk orders balance that; not done here).
//
// Everything else of the block (LayerNorms, MLP, head) works token by token on the rank's own
// tokens; the parameters are whole on every rank, so their gradients are all-reduced after
// backward, as in data parallelism over tokens. Backward of a ring hop sends the gradient of the
// received chunk back to where it came from.
//
// Run: tessera launch --nproc-per-node 3 build/ladders/dist/ladder_11_ring_attention
#include <limits>

#include "gpt_block.h"

using namespace ladder;
using namespace ladder::block;

const LadderInfo kStep = {"11_ring_attention", kBlockProduction};

namespace {

// One hop round the ring: send `mine` to rank r+1, receive rank r-1's. Backward, the reverse:
// the gradient of what was received goes back to r-1, the gradient of what was sent comes from
// r+1. The send is not waited for before the receive: every rank sends at once.
Tensor ring_hop(const Tensor& mine, CountingGroup& comm) {
  const int next = (comm.rank() + 1) % comm.size(),
            prev = (comm.rank() + comm.size() - 1) % comm.size();
  const Tensor outgoing = mine.detach().contiguous();
  Tensor received = zeros(mine.shape(), {.dtype = mine.dtype(), .device = mine.device()});
  WorkPtr sending = comm.send(outgoing, next);
  comm.recv(received, prev)->wait();
  sending->wait();
  autograd::record("RingHopBackward", {mine}, {received},
                   [&comm, next, prev, shape = mine.shape()](const autograd::BackwardArgs& a) {
                     const Tensor grad_back = a.grad().contiguous();
                     Tensor grad_mine =
                         zeros(shape, {.dtype = grad_back.dtype(), .device = grad_back.device()});
                     WorkPtr sending_back = comm.send(grad_back, prev);
                     comm.recv(grad_mine, next)->wait();
                     sending_back->wait();
                     return std::vector<Tensor>{grad_mine};
                   });
  return received;
}

struct Partial {
  Tensor out, lse;  // [B, H, T', D] and [B, H, T', 1]
};

// Attention of q to one chunk of keys and values, with its log-sum-exp; `causal_mask` for the
// rank's own chunk (added to the scores: 0 or -inf).
Partial attend(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& causal_mask) {
  Tensor scores = matmul(q, k.transpose(-2, -1)) / std::sqrt(double(kHeadDim));
  if (causal_mask.defined()) scores = scores + causal_mask;
  Tensor lse = logsumexp(scores, {-1}, /*keepdim=*/true);
  return {matmul(exp(scores - lse), v), lse};
}

// The online softmax's merge of two partial results over disjoint sets of keys.
Partial merge(const Partial& a, const Partial& b) {
  Tensor lse = logsumexp(cat({a.lse, b.lse}, -1), {-1}, /*keepdim=*/true);
  return {a.out * exp(a.lse - lse) + b.out * exp(b.lse - lse), lse};
}

Tensor ring_attention(const Tensor& q, const Tensor& k, const Tensor& v, CountingGroup& comm) {
  const int64_t tokens = q.size(2);
  std::vector<float> mask(tokens * tokens, 0.0f);
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t j = i + 1; j < tokens; ++j)
      mask[i * tokens + j] = -std::numeric_limits<float>::infinity();
  const Tensor causal_mask = ops::to(from_vector(mask, {tokens, tokens}), q.device(), q.dtype());

  const int rank = comm.rank(), world = comm.size();
  Partial result = attend(q, k, v, causal_mask);  // round 0: my own chunk
  Tensor chunk = cat({k, v}, 0);                  // keys and values travel together
  Tensor unused = zeros({1}, {.dtype = q.dtype(), .device = q.device()});
  for (int round = 1; round < world; ++round) {
    chunk = ring_hop(chunk, comm);
    const int owner = (rank - round + world) % world;  // whose tokens this chunk holds
    if (owner < rank) {
      std::vector<Tensor> kv = tessera::chunk(chunk, 2, 0);
      result = merge(result, attend(q, kv[0], kv[1], Tensor()));
    } else {
      // The future: not attended to. Tied to the loss with weight zero all the same, so that
      // every hop runs its backward on every rank and the sends there pair with the receives.
      unused = unused + sum(chunk) * 0.0;
    }
  }
  return result.out + unused;
}

}  // namespace

Outcome run_step(Job& job, CountingGroup& comm) {
  TESSERA_CHECK(kTokens % job.size == 0, "11_ring_attention: ", job.size, " ranks do not divide ",
                kTokens, " tokens");
  std::vector<Parameter> mine = whole_block(job.device);  // every parameter whole on every rank
  for (Parameter& p : mine) p.split = Split::Whole;
  const int64_t tokens_here = kTokens / job.size;
  BlockTraining how;
  how.regions.attention = [&](const Tensor& q, const Tensor& k, const Tensor& v) {
    return ring_attention(q, k, v, comm);
  };
  how.my_part = [&](const Batch& b) {  // my tokens of every sequence
    return Batch{b.x.narrow(0, job.rank * tokens_here, tokens_here),
                 b.y.narrow(0, job.rank * tokens_here, tokens_here)};
  };
  how.loss_scale = 1.0 / job.size;  // the ranks' losses sum to the whole sequence's mean
  how.after_backward = [&] {
    for (const Parameter& p : mine) comm.all_reduce(p.value.grad(), dist::ReduceOp::Sum)->wait();
  };
  std::vector<double> losses = train_block(mine, job, how, &comm);
  for (double& loss : losses) loss = job.mean_over_ranks(loss);

  Outcome out;
  check_slices(out.check, losses, mine, job);
  int64_t parameter_values = 0;  // from the block's declared shapes
  for (const Parameter& p : block_parameter_list()) parameter_values += shape_numel(p.shape);
  const int64_t tensors = static_cast<int64_t>(block_parameter_list().size());
  const int64_t chunk_bytes = 4 * 2 * job.options.rows_per_rank * kHeads * tokens_here * kHeadDim;
  const int64_t hops = 2 * (job.size - 1);  // W-1 forward, as many backward
  out.theory.add(kSend, hops, hops * chunk_bytes);
  out.theory.add(kRecv, hops, hops * chunk_bytes);
  out.theory.add(kAllReduce, tensors, 4 * parameter_values);
  out.theory_reason = std::to_string(job.size - 1) +
                      " ring hops forward and as many backward, "
                      "each a send and a recv of this rank's keys and values, 2 x B x H x T/W x "
                      "D floats (" +
                      std::to_string(chunk_bytes) +
                      " bytes); an all_reduce of "
                      "each of the " +
                      std::to_string(tensors) + " parameter tensors (" +
                      std::to_string(parameter_values) + " values)";
  return out;
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
