#pragma once
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string>

#include "tessera/core/half.h"

namespace tessera {

enum class DType : uint8_t { f32, f16, bf16, f64, i32, i64, u8, boolean };

size_t dtype_size(DType t);
const char* dtype_name(DType t);  // "float32", "float16", ... as PyTorch prints them
DType dtype_from_name(const std::string& name);  // accepts "f32", "float32", "fp16", "bf16", ...
bool is_floating(DType t);
bool is_integral(DType t);  // integer or bool
// Type promotion for binary ops (PyTorch's rules for tensors of equal rank category).
DType promote_types(DType a, DType b);
std::ostream& operator<<(std::ostream& os, DType t);

template <class T>
struct DTypeOf;
template <> struct DTypeOf<float> { static constexpr DType value = DType::f32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::f64; };
template <> struct DTypeOf<Half> { static constexpr DType value = DType::f16; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::bf16; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::i32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::i64; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::u8; };
template <> struct DTypeOf<bool> { static constexpr DType value = DType::boolean; };

// Calls fn(T{}) with T the C++ type of `t`; the one place a dtype becomes a type.
template <class Fn>
decltype(auto) visit_dtype(DType t, Fn&& fn) {
  switch (t) {
    case DType::f32: return fn(float{});
    case DType::f16: return fn(Half{});
    case DType::bf16: return fn(BFloat16{});
    case DType::f64: return fn(double{});
    case DType::i32: return fn(int32_t{});
    case DType::i64: return fn(int64_t{});
    case DType::u8: return fn(uint8_t{});
    case DType::boolean: return fn(bool{});
  }
  return fn(float{});
}

}  // namespace tessera
