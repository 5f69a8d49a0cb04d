// The "single" backend: a world of one process. Every collective is the identity
// or a copy, done where the tensors live (no host staging, so a one-GPU run pays
// nothing for going through DDP), and code written for many ranks runs unchanged.
// Not final: a test may derive from it to watch what a strategy asks of its group.
#pragma once
#include "tessera/dist/process_group.h"

namespace tessera::dist {

class SingleProcessGroup : public ProcessGroup {
 public:
  explicit SingleProcessGroup(ProcessGroupOptions options = {})
      : ProcessGroup(0, 1, std::move(options)) {}
  std::string backend_name() const override { return "single"; }

 protected:
  bool supports_device(Device) const override { return true; }
  WorkPtr do_all_reduce(const CollectiveSignature& sig, const Tensor& t, ReduceOp op) override;
  WorkPtr do_reduce_scatter(const CollectiveSignature& sig, const Tensor& output,
                            const Tensor& input, ReduceOp op) override;
  WorkPtr do_all_gather(const CollectiveSignature& sig, const std::vector<Tensor>& outputs,
                        const Tensor& input) override;
  WorkPtr do_broadcast(const CollectiveSignature& sig, const Tensor& t, int root) override;
  WorkPtr do_barrier(const CollectiveSignature& sig) override;
  WorkPtr do_send(const Tensor& t, int dst, int tag) override;
  WorkPtr do_recv(const Tensor& t, int src, int tag) override;
  std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>& ranks, uint64_t id,
                                             ProcessGroupOptions options) override;
};

}  // namespace tessera::dist
