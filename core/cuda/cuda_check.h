// Status checks for every CUDA library call: a failure becomes a tessera::Error
// whose message names the call, the status and where it happened. A failed
// device allocation is an OutOfMemoryError. For use inside the library and
// its CUDA tests/benchmarks (needs the CUDA headers).
#pragma once
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "tessera/core/error.h"

namespace tessera::cuda::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call, const char* file,
                                          int line) {
  cudaGetLastError();  // clear the sticky-free error so later calls start clean
  std::string msg = ::tessera::detail::concat(call, " failed: ", cudaGetErrorName(status), " (",
                                              cudaGetErrorString(status), ") at ", file, ":", line);
  if (status == cudaErrorMemoryAllocation) throw OutOfMemoryError(msg);
  throw Error(msg);
}

inline const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    default: return "CUBLAS_STATUS_UNKNOWN";
  }
}

[[noreturn]] inline void throw_cublas_error(cublasStatus_t status, const char* call,
                                            const char* file, int line) {
  std::string msg = ::tessera::detail::concat(call, " failed: ", cublas_status_name(status),
                                              " at ", file, ":", line);
  if (status == CUBLAS_STATUS_ALLOC_FAILED) throw OutOfMemoryError(msg);
  throw Error(msg);
}

}  // namespace tessera::cuda::detail

#define TESSERA_CUDA_CHECK(call)                                                        \
  do {                                                                                  \
    cudaError_t tessera_status_ = (call);                                               \
    if (tessera_status_ != cudaSuccess)                                                 \
      ::tessera::cuda::detail::throw_cuda_error(tessera_status_, #call, __FILE__, __LINE__); \
  } while (0)

// After a kernel launch: reports bad launch configurations at the launch site.
#define TESSERA_KERNEL_CHECK(kernel_name)                                                   \
  do {                                                                                      \
    cudaError_t tessera_status_ = cudaGetLastError();                                       \
    if (tessera_status_ != cudaSuccess)                                                     \
      ::tessera::cuda::detail::throw_cuda_error(tessera_status_, "launch of " kernel_name, \
                                                __FILE__, __LINE__);                        \
  } while (0)

#define TESSERA_CUBLAS_CHECK(call)                                                          \
  do {                                                                                      \
    cublasStatus_t tessera_status_ = (call);                                                \
    if (tessera_status_ != CUBLAS_STATUS_SUCCESS)                                           \
      ::tessera::cuda::detail::throw_cublas_error(tessera_status_, #call, __FILE__, __LINE__); \
  } while (0)

#if __has_include(<cudnn.h>)
#include <cudnn.h>
#define TESSERA_CUDNN_CHECK(call)                                                          \
  do {                                                                                     \
    cudnnStatus_t tessera_status_ = (call);                                                \
    if (tessera_status_ != CUDNN_STATUS_SUCCESS)                                           \
      throw ::tessera::Error(::tessera::detail::concat(#call, " failed: ",                 \
                                                       cudnnGetErrorString(tessera_status_), \
                                                       " at ", __FILE__, ":", __LINE__));  \
  } while (0)
#endif

#if __has_include(<nccl.h>)
#include <nccl.h>
#define TESSERA_NCCL_CHECK(call)                                                           \
  do {                                                                                     \
    ncclResult_t tessera_status_ = (call);                                                 \
    if (tessera_status_ != ncclSuccess)                                                    \
      throw ::tessera::Error(::tessera::detail::concat(#call, " failed: ",                 \
                                                       ncclGetErrorString(tessera_status_), \
                                                       " at ", __FILE__, ":", __LINE__));  \
  } while (0)
#endif
