#include "tessera/dist/single_process_group.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

WorkPtr SingleProcessGroup::do_all_reduce(const CollectiveSignature&, const Tensor&, ReduceOp) {
  return completed_work();  // sum, avg, max and min of one value are the value
}
WorkPtr SingleProcessGroup::do_reduce_scatter(const CollectiveSignature&, const Tensor& output,
                                              const Tensor& input, ReduceOp) {
  ops::copy_(output, ops::view(input, output.shape()));
  return completed_work();
}
WorkPtr SingleProcessGroup::do_all_gather(const CollectiveSignature&,
                                          const std::vector<Tensor>& outputs, const Tensor& input) {
  ops::copy_(outputs[0], ops::view(input, outputs[0].shape()));
  return completed_work();
}
WorkPtr SingleProcessGroup::do_broadcast(const CollectiveSignature&, const Tensor&, int) {
  return completed_work();
}
WorkPtr SingleProcessGroup::do_barrier(const CollectiveSignature&) { return completed_work(); }
// ProcessGroup::send/recv reject a peer equal to this rank, the only rank there is.
WorkPtr SingleProcessGroup::do_send(const Tensor&, int, int) { return completed_work(); }
WorkPtr SingleProcessGroup::do_recv(const Tensor&, int, int) { return completed_work(); }
std::shared_ptr<ProcessGroup> SingleProcessGroup::do_new_group(const std::vector<int>&, uint64_t,
                                                               ProcessGroupOptions options) {
  return std::make_shared<SingleProcessGroup>(std::move(options));
}

namespace {
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
