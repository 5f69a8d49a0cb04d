// PeerAllReduce: the all-reduce (and all-gather) of the two ranks of one host through the
// copy engines.
//
// NCCL's all-reduce runs as kernels: while DDP's buckets are reduced during backward, its
// blocks hold SMs that the backward's GEMMs would use (on two H100s, 24 SMs for ~1.4 ms of a
// GPT-2 124M step). Two GPUs of one host can move the bytes with their copy engines instead,
// through CUDA IPC mappings of each other's buffers, and leave the SMs only the additions.
//
// A buffer from allocate() is one cudaMalloc allocation holding the bucket, a staging area of
// half its size and two 32-bit flags; each rank maps the other's allocation (CUDA IPC). With
// halves A (rank 0) and B (rank 1), rank r, on the group's stream:
//   1. copies the peer's half of its bucket into the peer's staging area (copy engine),
//   2. sets the peer's "arrived" flag, waits for its own, clears it,
//   3. adds the staging area into its own half (one pass, halving for Avg: cuda::sum_scaled),
//   4. copies its reduced half into the peer's bucket (copy engine),
//   5. sets the peer's "reduced" flag, waits for its own, clears it.
// Both ranks end with the same bytes: each half is computed once, by its owner, and copied.
// The flags are set and waited for with stream memory operations (cuStreamWriteValue32 /
// cuStreamWaitValue32), which a CUDA graph records, so a recorded training step replays the
// whole exchange. A rank sets each flag before it waits for the peer's, so neither can wait
// on the other; a flag is cleared by its owner before anything that lets the peer set it
// again (the peer sets it in the next all-reduce of the buffer, which needs this rank's
// later flags first). Every step of one all-reduce runs in stream order on each rank.
//
// An all-gather into a buffer (DDP's sparse embedding rows, dist/sparse_embedding.h) writes
// into the peer's buffer, whose owner reads it after the collective, so each rank first says
// it has come this far (everything before on its stream, reads of the buffer included, is done):
//   1. sets the peer's "reduced" flag (here: ready), waits for its own, clears it,
//   2. copies its input into its slot of the peer's buffer (copy engine), sets the peer's
//      "arrived" flag, copies its input into its slot of its own buffer,
//   3. waits for its own "arrived" flag, clears it.
#pragma once
#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "tessera/dist/process_group.h"
#include "tessera/dist/store.h"

namespace tessera::dist {

class PeerAllReduce {
 public:
  // Collective over a group of two ranks: both learn whether they run on one host with GPUs
  // that reach each other (peer access, stream memory operations). Returns null when not,
  // with the reason in *why_not (the same answer on both ranks).
  static std::unique_ptr<PeerAllReduce> connect(Store& store, const std::string& prefix, int rank,
                                                int device, std::string* why_not);

  // Collective: a buffer of numel elements that all_reduce() then serves (both ranks call it
  // in the same order with the same sizes). Not while a device graph is recorded.
  Tensor allocate(int64_t numel, DType dtype);
  // Whether t is (all of) a buffer from allocate() and op one the exchange computes.
  bool serves(const Tensor& t, ReduceOp op) const;
  // Enqueues the exchange of t (see serves) on `stream`, this group's GPU's stream.
  void enqueue(const Tensor& t, ReduceOp op, cudaStream_t stream);
  // Whether `outputs` (rank 0's part, then rank 1's, each like input) are together (all of) a
  // buffer from allocate(), and input a contiguous tensor the all-gather reads.
  bool serves_all_gather(const std::vector<Tensor>& outputs, const Tensor& input) const;
  // Enqueues the all-gather of input into outputs (see serves_all_gather) on `stream`.
  void enqueue_all_gather(const std::vector<Tensor>& outputs, const Tensor& input,
                          cudaStream_t stream);

  struct Buffer;  // one allocation of each rank, both mapped (peer_all_reduce.cpp)

 private:
  PeerAllReduce(Store& store, std::string prefix, int rank, int device);
  std::shared_ptr<Buffer> buffer_at(const void* data, int64_t numel, DType dtype) const;
  std::shared_ptr<Buffer> buffer_of(const Tensor& t) const;  // null: t is not all of one
  std::shared_ptr<Buffer> gather_buffer(const std::vector<Tensor>& outputs,
                                        const Tensor& input) const;

  Store& store_;
  std::string prefix_;
  int rank_, device_;
  int64_t allocated_ = 0;  // buffers so far: their keys in the store
  // The buffers alive, by the address of their data; shared with their deleters.
  struct Registry {
    std::mutex mutex;
    std::map<const void*, std::shared_ptr<Buffer>> buffers;
  };
  std::shared_ptr<Registry> registry_ = std::make_shared<Registry>();
};

}  // namespace tessera::dist
