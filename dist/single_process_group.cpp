// The "single" backend: a world of one process. Every collective is the identity
// or a copy, done where the tensors live (no host staging, so a one-GPU run pays
// nothing for going through DDP), and code written for many ranks runs unchanged.
#include "tessera/dist/process_group.h"

namespace tessera::dist {
namespace {

class SingleProcessGroup final : public ProcessGroup {
 public:
  explicit SingleProcessGroup(ProcessGroupOptions options) : ProcessGroup(0, 1, std::move(options)) {}
  std::string backend_name() const override { return "single"; }

 protected:
  bool supports_device(Device) const override { return true; }
  WorkPtr do_all_reduce(const CollectiveSignature&, const Tensor&, ReduceOp) override {
    return completed_work();  // sum, avg, max and min of one value are the value
  }
  WorkPtr do_reduce_scatter(const CollectiveSignature&, const Tensor& output, const Tensor& input,
                            ReduceOp) override {
    raw::copy_(output, raw::view(input, output.shape()));
    return completed_work();
  }
  WorkPtr do_all_gather(const CollectiveSignature&, const std::vector<Tensor>& outputs,
                        const Tensor& input) override {
    raw::copy_(outputs[0], raw::view(input, outputs[0].shape()));
    return completed_work();
  }
  WorkPtr do_broadcast(const CollectiveSignature&, const Tensor&, int) override {
    return completed_work();
  }
  WorkPtr do_barrier(const CollectiveSignature&) override { return completed_work(); }
  // ProcessGroup::send/recv reject a peer equal to this rank, the only rank there is.
  WorkPtr do_send(const Tensor&, int, int) override { return completed_work(); }
  WorkPtr do_recv(const Tensor&, int, int) override { return completed_work(); }
  std::shared_ptr<ProcessGroup> do_new_group(const std::vector<int>&, uint64_t,
                                             ProcessGroupOptions options) override {
    return std::make_shared<SingleProcessGroup>(std::move(options));
  }
};

const bool registered = [] {
  register_backend("single", [](const BackendContext& ctx) -> std::shared_ptr<ProcessGroup> {
    TESSERA_CHECK(ctx.env.world_size == 1, "dist: the single backend needs a world of 1, got ",
                  ctx.env.world_size);
    return std::make_shared<SingleProcessGroup>(ctx.options);
  });
  return true;
}();

}  // namespace
}  // namespace tessera::dist
