// The CUDA runtime: allocator caching and statistics, OOM, streams/events, pinned memory,
// host<->device copies, device selection errors.
#include <cuda_runtime_api.h>

#include "tessera/core/cuda/cuda_runtime.h"
#include "cuda_test_util.h"

namespace tessera {
namespace {
using namespace cuda_test;

TEST(CudaRuntime, SizeClassesRoundUp) {
  // Pure arithmetic: runs without a GPU too.
  EXPECT_EQ(cuda::allocation_size_class(1), 512u);
  EXPECT_EQ(cuda::allocation_size_class(512), 512u);
  EXPECT_EQ(cuda::allocation_size_class(513), 1024u);
  EXPECT_EQ(cuda::allocation_size_class((1u << 20) + 1), 2u << 20);
  EXPECT_EQ(cuda::allocation_size_class(5u << 20), 6u << 20);
}

TEST(CudaRuntime, DeviceCountMatchesDriver) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) n = 0;
  cudaGetLastError();
  EXPECT_EQ(cuda::device_count(), n);
  EXPECT_EQ(cuda_device_count(), n);
}

TEST(CudaRuntime, CachingAllocatorReusesFreedBlocks) {
  TESSERA_REQUIRE_GPU();
  cuda::synchronize(0);
  const auto before = cuda::memory_stats(0);
  {
    Tensor a = empty({1000, 37}, {.dtype = DType::f32, .device = dev()});
    const auto during = cuda::memory_stats(0);
    // A cached block up to a quarter larger than the size class may serve the request.
    const size_t cls = cuda::allocation_size_class(1000 * 37 * 4);
    EXPECT_GE(during.allocated_bytes - before.allocated_bytes, cls);
    EXPECT_LE(during.allocated_bytes - before.allocated_bytes, cls + cls / 4);
    EXPECT_GE(during.peak_allocated_bytes, during.allocated_bytes);
  }
  const auto mid = cuda::memory_stats(0);
  EXPECT_EQ(mid.allocated_bytes, before.allocated_bytes);
  for (int i = 0; i < 10; ++i) {
    Tensor a = empty({1000, 37}, {.dtype = DType::f32, .device = dev()});
    gpu().fill(a, 1.0);
  }
  const auto after = cuda::memory_stats(0);
  EXPECT_EQ(after.num_device_allocs, mid.num_device_allocs) << "steady state must not cudaMalloc";
  EXPECT_GE(after.num_cache_hits, mid.num_cache_hits + 10);
  EXPECT_GE(after.reserved_bytes, after.allocated_bytes);

  cuda::empty_cache(0);
  const auto emptied = cuda::memory_stats(0);
  EXPECT_LT(emptied.reserved_bytes, after.reserved_bytes);
  EXPECT_EQ(emptied.reserved_bytes, emptied.allocated_bytes) << "only blocks in use stay reserved";
  cuda::reset_peak_memory_stats(0);
  EXPECT_EQ(cuda::memory_stats(0).peak_allocated_bytes, cuda::memory_stats(0).allocated_bytes);
}

TEST(CudaRuntime, OutOfMemoryIsItsOwnError) {
  TESSERA_REQUIRE_GPU();
  const int64_t huge = int64_t{1} << 46;  // 64 TiB of bytes
  EXPECT_THROW(empty({huge}, {.dtype = DType::u8, .device = dev()}), OutOfMemoryError);
  // The device stays usable afterwards.
  Tensor t = empty({16}, {.dtype = DType::f32, .device = dev()});
  gpu().fill(t, 2.5);
  EXPECT_EQ(values(t)[15], 2.5);
}

TEST(CudaRuntime, MissingDeviceIsNamed) {
  TESSERA_REQUIRE_GPU();
  try {
    empty({4}, {.device = Device::cuda(cuda::device_count() + 3)});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cuda::set_device(-1), Error);
}

TEST(CudaRuntime, HostDeviceRoundTrip) {
  TESSERA_REQUIRE_GPU();
  Tensor h = host_randn({257, 3});
  Tensor d = to_gpu(h);
  EXPECT_EQ(d.device(), dev());
  EXPECT_EQ(values(d), values(h));
  // Non-contiguous destinations and sources across devices.
  Tensor ht = raw::transpose(h, 0, 1);
  Tensor dt = to_gpu(ht);
  EXPECT_EQ(values(dt), values(ht));
}

TEST(CudaRuntime, StreamsEventsAndPinnedMemory) {
  TESSERA_REQUIRE_GPU();
  cuda::Stream stream(0);
  const size_t n = 1 << 20;
  cuda::PinnedBuffer src(n * sizeof(float)), dst(n * sizeof(float));
  float* s = static_cast<float*>(src.data());
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<float>(i % 1000) * 0.5f;
  Tensor d = empty({static_cast<int64_t>(n)}, {.dtype = DType::f32, .device = dev()});
  cuda::Event start, stop;
  {
    cuda::StreamGuard guard(stream.handle(), 0);
    EXPECT_EQ(cuda::current_stream(0), stream.handle());
    start.record(stream.handle());
    cuda::memcpy_async(d.raw_data(), src.data(), n * sizeof(float));
    gpu().unary(UnaryOp::Neg, d, d);
    cuda::memcpy_async(dst.data(), d.raw_data(), n * sizeof(float));
    stop.record(stream.handle());
  }
  EXPECT_EQ(cuda::current_stream(0), nullptr);
  stop.synchronize();
  EXPECT_TRUE(stop.query());
  EXPECT_GE(start.elapsed_ms(stop), 0.f);
  const float* out = static_cast<const float*>(dst.data());
  for (size_t i = 0; i < n; i += 997) ASSERT_EQ(out[i], -s[i]);
}

TEST(CudaRuntime, RecordStreamDelaysReuse) {
  TESSERA_REQUIRE_GPU();
  cuda::Stream side(0);
  cuda::empty_cache(0);
  void* first = nullptr;
  {
    Tensor t = empty({4096}, {.dtype = DType::f32, .device = dev()});
    first = t.raw_data();
    cuda::record_stream(first, side.handle());
  }
  side.synchronize();
  // Once the side stream's work is done the block comes back to the cache.
  Tensor u = empty({4096}, {.dtype = DType::f32, .device = dev()});
  EXPECT_EQ(u.raw_data(), first);
}

TEST(CudaRuntime, ErrorsNameTheCall) {
  TESSERA_REQUIRE_GPU();
  try {
    cuda::Stream s(cuda::device_count() + 5);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tessera
