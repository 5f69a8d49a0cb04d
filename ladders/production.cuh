// The last rung of each ladder is the production kernel of kernels/cuda, called through its
// public entry (the dispatch table or tessera::cuda::...) on the same device memory as the
// other rungs: these wrap a DeviceArray as a contiguous Tensor without copying.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "ladder_harness.cuh"
#include "tessera/core/tensor.h"

namespace ladders {

template <class T>
constexpr tessera::DType dtype_of() {
  if constexpr (std::is_same_v<T, bf16>)
    return tessera::DType::bf16;
  else if constexpr (std::is_same_v<T, float>)
    return tessera::DType::f32;
  else {
    static_assert(std::is_same_v<T, int32_t>, "a DeviceArray of bf16, float or int32");
    return tessera::DType::i32;
  }
}

template <class T>
tessera::Tensor as_tensor(const DeviceArray<T>& array, const tessera::Shape& shape) {
  if (tessera::shape_numel(shape) != static_cast<int64_t>(array.size()))
    throw std::runtime_error("as_tensor: shape " + tessera::shape_str(shape) + " does not hold " +
                             std::to_string(array.size()) + " elements");
  return tessera::from_blob(array.get(), shape, dtype_of<T>(), tessera::Device::cuda(0));
}

}  // namespace ladders
