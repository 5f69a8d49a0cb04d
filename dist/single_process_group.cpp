// The "single" backend: a world of one process. Collectives are copies (or nothing), so
// code written for many ranks runs unchanged in one.
#include <cstring>

#include "dist/host_process_group.h"

namespace tessera::dist {
namespace {

class SingleProcessGroup final : public HostProcessGroup {
 public:
  explicit SingleProcessGroup(ProcessGroupOptions options)
      : HostProcessGroup(0, 1, std::move(options)) {}
  ~SingleProcessGroup() override { stop_worker(); }
  std::string backend_name() const override { return "single"; }

 protected:
  void host_all_reduce(void*, int64_t, DType, ReduceOp, Deadline) override {}
  void host_reduce_scatter(const void* in, void* out, int64_t count, DType dtype, ReduceOp,
                           Deadline) override {
    std::memmove(out, in, count * dtype_size(dtype));
  }
  void host_all_gather(const void* in, const std::vector<void*>& outs,
                       const std::vector<size_t>& out_bytes, Deadline) override {
    std::memmove(outs[0], in, out_bytes[0]);
  }
  void host_broadcast(void*, size_t, int, Deadline) override {}
  void host_barrier(Deadline) override {}
  // ProcessGroup::send/recv reject a peer equal to this rank, the only rank there is.
  void host_send(const void*, size_t, int, int, Deadline) override {}
  void host_recv(void*, size_t, int, int, Deadline) override {}
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
