#include "tessera/core/dtype.h"

#include "tessera/core/error.h"

namespace tessera {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: case DType::i32: return 4;
    case DType::f64: case DType::i64: return 8;
    case DType::f16: case DType::bf16: return 2;
    case DType::u8: case DType::boolean: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f64: return "float64";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u8: return "uint8";
    case DType::boolean: return "bool";
  }
  return "?";
}

DType dtype_from_name(const std::string& n) {
  if (n == "f32" || n == "float32" || n == "fp32" || n == "float") return DType::f32;
  if (n == "f16" || n == "float16" || n == "fp16" || n == "half") return DType::f16;
  if (n == "bf16" || n == "bfloat16") return DType::bf16;
  if (n == "f64" || n == "float64" || n == "fp64" || n == "double") return DType::f64;
  if (n == "i32" || n == "int32") return DType::i32;
  if (n == "i64" || n == "int64" || n == "long") return DType::i64;
  if (n == "u8" || n == "uint8") return DType::u8;
  if (n == "bool") return DType::boolean;
  TESSERA_FAIL("dtype_from_name: unknown dtype '", n,
               "' (expected f32, f16, bf16, f64, i32, i64, u8 or bool)");
}

bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f16 || t == DType::bf16 || t == DType::f64;
}
bool is_integral(DType t) { return !is_floating(t); }

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if (is_floating(a) != is_floating(b)) return is_floating(a) ? a : b;
  if (is_floating(a)) {
    if (a == DType::f64 || b == DType::f64) return DType::f64;
    return DType::f32;  // f32 with f16/bf16, or f16 with bf16
  }
  auto rank = [](DType t) {
    switch (t) {
      case DType::boolean: return 0;
      case DType::u8: return 1;
      case DType::i32: return 2;
      default: return 3;
    }
  };
  return rank(a) > rank(b) ? a : b;
}

std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

}  // namespace tessera
