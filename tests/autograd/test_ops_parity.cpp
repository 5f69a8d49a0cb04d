// The new ops against PyTorch on the CPU (tests/autograd/torch_ops_reference.py): forward
// values and gradients for random upstream gradients, on non-contiguous (transposed) inputs,
// in f64, f32, bf16 and f16.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>

#include "../nn/python_reference.h"
#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/core/safetensors.h"

namespace tessera {
namespace {

struct OpCase {
  std::string op;      // the reference script's name
  std::string params;  // JSON object
  std::vector<Shape> shapes;
  std::function<Tensor(const std::vector<Tensor>&)> fn;
  double low = 0, high = 0;  // uniform inputs when low < high, else N(0, 1)
  Tensor index;              // gather / scatter_add / index_select
};

std::vector<OpCase> op_cases() {
  const Tensor gather_index =
      from_vector<int64_t>({4, 0, 2, 2, 1, 3, 0, 4, 4, 1, 3, 0}, {6, 2}, {.dtype = DType::i64});
  const Tensor rows = from_vector<int64_t>({2, 0, 2, 1}, {4}, {.dtype = DType::i64});
  return {
      {"sin", "{}", {{6, 5}}, [](auto& x) { return sin(x[0]); }},
      {"cos", "{}", {{6, 5}}, [](auto& x) { return cos(x[0]); }},
      {"expm1", "{}", {{6, 5}}, [](auto& x) { return expm1(x[0]); }},
      {"log1p", "{}", {{6, 5}}, [](auto& x) { return log1p(x[0]); }, 0.1, 3.0},
      {"reciprocal", "{}", {{6, 5}}, [](auto& x) { return reciprocal(x[0]); }, 0.5, 2.0},
      {"silu", "{}", {{6, 5}}, [](auto& x) { return silu(x[0]); }},
      {"swiglu", "{}", {{6, 5}, {6, 5}}, [](auto& x) { return swiglu(x[0], x[1]); }},
      {"clamp",
       R"({"min": -0.5, "max": 0.8})",
       {{6, 5}},
       [](auto& x) { return clamp(x[0], -0.5, 0.8); }},
      {"var",
       R"({"dims": [1], "correction": 1, "keepdim": false})",
       {{6, 5}},
       [](auto& x) { return var(x[0], {1}, 1.0); }},
      {"std",
       R"({"dims": [0], "correction": 0, "keepdim": true})",
       {{6, 5}},
       [](auto& x) { return std_dev(x[0], {0}, 0.0, true); }},
      {"logsumexp",
       R"({"dims": [1], "keepdim": false})",
       {{6, 5}},
       [](auto& x) { return logsumexp(x[0], {1}); }},
      {"prod",
       R"({"dim": 1, "keepdim": false})",
       {{6, 5}},
       [](auto& x) { return prod(x[0], {1}); },
       0.5,
       1.5},
      {"cumsum", R"({"dim": 0})", {{6, 5}}, [](auto& x) { return cumsum(x[0], 0); }},
      {"max",
       R"({"dim": 1, "keepdim": false})",
       {{6, 5}},
       [](auto& x) { return max(x[0], 1).values; }},
      {"min",
       R"({"dim": 0, "keepdim": true})",
       {{6, 5}},
       [](auto& x) { return min(x[0], 0, true).values; }},
      {"topk",
       R"({"k": 3, "dim": 1, "largest": true})",
       {{6, 5}},
       [](auto& x) { return topk(x[0], 3, 1).values; }},
      {"gather",
       R"({"dim": 1})",
       {{6, 5}},
       [=](auto& x) { return gather(x[0], 1, gather_index); },
       0,
       0,
       gather_index},
      {"scatter_add",
       R"({"dim": 1})",
       {{6, 5}, {6, 2}},
       [=](auto& x) { return scatter_add(x[0], 1, gather_index, x[1]); },
       0,
       0,
       gather_index},
      {"index_select",
       R"({"dim": 0})",
       {{3, 5}},
       [=](auto& x) { return index_select(x[0], 0, rows); },
       0,
       0,
       rows},
      {"rms_norm",
       R"({"eps": 1e-5})",
       {{6, 8}, {8}},
       [](auto& x) { return rms_norm(x[0], x[1], 1e-5); }},
      {"rope",
       R"({"theta": 10000.0})",
       {{2, 3, 4, 8}},
       [](auto& x) {
         return rotary_embedding(x[0], ops::rope_tables(0, 3, 8, 10000.0, x[0].dtype()));
       }},
      // Last, so the cases above keep the inputs their seeds drew before these were added.
      {"erf", "{}", {{6, 5}}, [](auto& x) { return erf(x[0]); }},
      {"gelu_erf", "{}", {{6, 5}}, [](auto& x) { return gelu_erf(x[0]); }},
  };
}

// A leaf of `shape` in `dtype`: the transposed view of a stored tensor when 2-D or more.
Tensor make_input(const Shape& shape, DType dtype, const OpCase& c, uint64_t seed) {
  Generator gen(seed);
  Shape stored = shape;
  const bool transpose = shape.size() >= 2;
  if (transpose) std::swap(stored[stored.size() - 1], stored[stored.size() - 2]);
  TensorOptions f64{.dtype = DType::f64};
  Tensor values =
      c.low < c.high ? uniform(stored, c.low, c.high, f64, &gen) : randn(stored, f64, &gen);
  Tensor t = ops::to(values, Device::cpu(), dtype);
  if (transpose) t = ops::transpose(t, -1, -2);
  t.requires_grad_(true);
  return t;
}

double tolerance(DType t) {
  switch (t) {
    case DType::f64:
      return 1e-10;
    case DType::f32:
      return 2e-5;
    case DType::f16:
      return 1e-2;
    default:
      return 5e-2;  // bf16: composed ops round every intermediate to 8 bits
  }
}

const char* short_name(DType t) {
  switch (t) {
    case DType::f64:
      return "f64";
    case DType::f32:
      return "f32";
    case DType::f16:
      return "f16";
    default:
      return "bf16";
  }
}

TEST(OpsParity, MatchPyTorchInEveryDtype) {
  if (!test::python_can_import("torch, numpy")) GTEST_SKIP() << "no torch for the reference";
  const auto dir = std::filesystem::path(TESSERA_BINARY_DIR) / "test_scratch" / "ops_parity";
  std::filesystem::create_directories(dir);
  struct Result {
    std::string name;
    DType dtype;
    Tensor out;
    std::vector<Tensor> grads;
  };
  std::vector<Result> results;
  std::vector<std::pair<std::string, Tensor>> files;
  std::string cases = "[";
  uint64_t seed = 1;
  for (DType dtype : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    for (const OpCase& c : op_cases()) {
      const std::string name = c.op + "_" + short_name(dtype);
      std::vector<Tensor> xs;
      for (size_t i = 0; i < c.shapes.size(); ++i) {
        xs.push_back(make_input(c.shapes[i], dtype, c, seed++));
        files.emplace_back(name + "/x" + std::to_string(i),
                           ops::to(xs.back(), Device::cpu(), DType::f64));
      }
      if (c.index.defined()) files.emplace_back(name + "/index", c.index);
      Tensor out = c.fn(xs);
      Generator gen(seed++);
      Tensor dy = ops::to(randn(out.shape(), {.dtype = DType::f64}, &gen), Device::cpu(), dtype);
      files.emplace_back(name + "/dy", ops::to(dy, Device::cpu(), DType::f64));
      out.backward(dy);
      Result r{name, dtype, out.detach(), {}};
      for (const Tensor& x : xs) r.grads.push_back(x.grad());
      results.push_back(r);
      cases += std::string(cases.size() > 1 ? ", " : "") + "{\"name\": \"" + name +
               "\", \"op\": \"" + c.op + "\", \"dtype\": \"" + short_name(dtype) +
               "\", \"params\": " + c.params + ", \"n_inputs\": " + std::to_string(xs.size()) + "}";
    }
  }
  cases += "]";
  std::ofstream((dir / "cases.json").string()) << cases;
  save_safetensors((dir / "inputs.safetensors").string(), files);
  const std::string cmd = test::python_interpreter() +
                          " " TESSERA_SOURCE_DIR "/tests/autograd/torch_ops_reference.py --cases " +
                          (dir / "cases.json").string() + " --inputs " +
                          (dir / "inputs.safetensors").string() + " --out " +
                          (dir / "ref.safetensors").string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const SafetensorsContents ref = load_safetensors((dir / "ref.safetensors").string());
  for (const Result& r : results) {
    const double tol = tolerance(r.dtype);
    const double out_err = ops::max_rel_error(r.out, ref.at(r.name + "/out"));
    EXPECT_LE(out_err, tol) << r.name << " forward";
    for (size_t i = 0; i < r.grads.size(); ++i) {
      ASSERT_TRUE(r.grads[i].defined()) << r.name << " grad " << i;
      EXPECT_EQ(r.grads[i].dtype(), r.dtype) << r.name;
      const double err =
          ops::max_rel_error(r.grads[i], ref.at(r.name + "/grad" + std::to_string(i)));
      EXPECT_LE(err, tol) << r.name << " gradient of input " << i;
    }
  }
}

}  // namespace
}  // namespace tessera
