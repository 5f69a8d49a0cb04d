// Shared by the tests of the Hopper attention kernels (test_attention_sm90.cpp,
// test_attention_sm90_backward.cpp): the device check, the test shapes and the fused-buffer
// views q | k | v are taken from.
#pragma once
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "cuda_test_util.h"

namespace tessera::cuda_test::sm90 {

// The device's compute capability as "sm_XY".
inline std::string device_arch() {
  int major = 0, minor = 0;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, 0);
  return "sm_" + std::to_string(major) + std::to_string(minor);
}

#define REQUIRE_SM90_DEVICE()                                                                  \
  do {                                                                                         \
    TESSERA_REQUIRE_GPU();                                                                     \
    if (::tessera::cuda_test::sm90::device_arch() != "sm_90")                                  \
      GTEST_SKIP() << "the wgmma/TMA attention kernels need an sm_90 GPU (H100/H200); this "   \
                   << "device is " << ::tessera::cuda_test::sm90::device_arch();               \
  } while (0)

constexpr int64_t kB = 2, kH = 3;

struct Case {
  DType dtype;
  int64_t D, T, group;  // group: query heads per key/value head
  int64_t kv_heads() const { return kH / group; }
};

inline std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " D=" + std::to_string(c.D) +
         " T=" + std::to_string(c.T) + " H=" + std::to_string(kH) +
         " Hkv=" + std::to_string(c.kv_heads());
}

// The [B, n, T, D] heads first..first+n-1 of a [B, T, heads, D] buffer: q, k and v of one
// [B, T, H + 2 Hkv, D] buffer (for group 1 exactly a fused [B, T, 3, H, D] projection) have
// T strides of (H + 2 Hkv) D and head strides of D.
inline Tensor heads(const Tensor& x, int64_t first, int64_t n) {
  return raw::permute(raw::narrow(x, 2, first, n), {0, 2, 1, 3});
}

// Those heads of a host buffer as float64 [B, n, T, D] values (the reference's layout).
inline std::vector<double> host_bhtd(const Tensor& host, int64_t first, int64_t n) {
  return values(raw::contiguous(raw::to(heads(host, first, n), Device::cpu(), DType::f64)));
}

}  // namespace tessera::cuda_test::sm90
