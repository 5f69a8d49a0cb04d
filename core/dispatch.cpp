#include "tessera/core/dispatch.h"

#include <array>

namespace tessera {

KernelTable& kernel_table(DeviceType type) {
  static std::array<KernelTable, kNumDeviceTypes> tables{};
  return tables[static_cast<int>(type)];
}

const char* unary_op_name(UnaryOp op) {
  static const char* names[] = {"neg",  "exp",  "log",        "sqrt",  "rsqrt", "abs",   "tanh",
                                "sigmoid", "relu", "gelu",    "sin",   "cos",   "square",
                                "reciprocal", "sign", "floor", "ceil", "round", "logical_not",
                                "log1p", "expm1", "erf"};
  return names[static_cast<int>(op)];
}

const char* binary_op_name(BinaryOp op) {
  static const char* names[] = {"add", "sub", "mul", "div", "pow", "maximum", "minimum", "eq",
                                "ne",  "lt",  "le",  "gt",  "ge",  "logical_and", "logical_or",
                                "gelu_backward"};
  return names[static_cast<int>(op)];
}

const char* reduce_op_name(ReduceOp op) {
  static const char* names[] = {"sum", "mean", "max", "min", "prod"};
  return names[static_cast<int>(op)];
}

}  // namespace tessera
