// The offload worker's copy stream on CUDA (dist/offload.h): a non-blocking stream of its
// own, current on the worker thread for its lifetime, so the device↔host copies of
// gradients and parameters overlap the kernels of the compute stream.
#include "tessera/core/cuda/cuda_runtime.h"
#include "tessera/dist/offload.h"

namespace tessera::dist {
namespace {

struct CopyStreamScope {
  explicit CopyStreamScope(int index)
      : device(index), stream(index), current(stream.handle(), index) {}
  cuda::DeviceGuard device;
  cuda::Stream stream;
  cuda::StreamGuard current;
};

const bool registered = [] {
  register_copy_stream(DeviceType::CUDA, [](Device d) -> std::shared_ptr<void> {
    return std::make_shared<CopyStreamScope>(d.index);
  });
  return true;
}();

}  // namespace
}  // namespace tessera::dist
