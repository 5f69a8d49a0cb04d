// Accuracy of Tessera's float32 reductions (sum, mean, var) over 1e3 ... 1e8 elements, next to
// PyTorch's on the same values (benchmarks/reduction_accuracy_torch.py, when torch imports):
// relative errors against float64 computed from the same float32 inputs.
//
//   bench_reduction_accuracy [max_elements=1e8] [distribution=uniform|offset]
// uniform: U(0, 1); offset: 1000 + N(0, 1) (a large mean, where var's cancellation shows).
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"

using namespace tessera;

namespace {

struct Errors {
  double sum = NAN, mean = NAN, var = NAN;
};

// float64 references from the float32 values (pairwise-exact enough: long double sums).
Errors tessera_errors(const Tensor& x) {
  const std::vector<float> v = x.to_vector<float>();
  long double s = 0;
  for (float f : v) s += f;
  const long double m = s / v.size();
  long double ss = 0;
  for (float f : v) ss += (f - m) * (f - m);
  const double ref_sum = static_cast<double>(s), ref_mean = static_cast<double>(m);
  const double ref_var = static_cast<double>(ss / (v.size() - 1));
  auto rel = [](double got, double ref) { return std::fabs(got - ref) / std::fabs(ref); };
  return {rel(ops::sum(x).item(), ref_sum), rel(ops::mean(x).item(), ref_mean),
          rel(var(x).item(), ref_var)};
}

// PyTorch's errors on the same values, or NaNs when torch is not importable.
Errors torch_errors(const Tensor& x) {
  const auto path = std::filesystem::temp_directory_path() / "tessera_reduction_accuracy.f32";
  {
    std::ofstream out(path, std::ios::binary);
    out.write(static_cast<const char*>(x.raw_data()), static_cast<std::streamsize>(x.nbytes()));
  }
  const std::string cmd = "/usr/bin/python3 " TESSERA_SOURCE_DIR
                          "/benchmarks/reduction_accuracy_torch.py " +
                          path.string() + " 2>/dev/null";
  Errors e;
  if (FILE* pipe = popen(cmd.c_str(), "r")) {
    char line[512] = {0};
    if (std::fgets(line, sizeof line, pipe)) {
      std::sscanf(line, "{\"sum\": %lf, \"mean\": %lf, \"var\": %lf}", &e.sum, &e.mean, &e.var);
    }
    pclose(pipe);
  }
  std::filesystem::remove(path);
  return e;
}

}  // namespace

int main(int argc, char** argv) {
  const double max_n = argc > 1 ? std::atof(argv[1]) : 1e8;
  const std::string distribution = argc > 2 ? argv[2] : "uniform";
  std::printf("float32 reductions, %s values: relative error against float64\n",
              distribution.c_str());
  std::printf("%10s | %10s %10s %10s | %10s %10s %10s\n", "n", "sum", "mean", "var", "torch sum",
              "torch mean", "torch var");
  Generator gen(2024);
  for (double n = 1e3; n <= max_n * 1.0001; n *= 10) {
    const Shape shape{static_cast<int64_t>(n)};
    const Tensor x = distribution == "offset"
                         ? normal(shape, 1000.0, 1.0, {.dtype = DType::f32}, &gen)
                         : uniform(shape, 0.0, 1.0, {.dtype = DType::f32}, &gen);
    const Errors t = tessera_errors(x), p = torch_errors(x);
    std::printf("%10.0e | %10.2e %10.2e %10.2e | %10.2e %10.2e %10.2e\n", n, t.sum, t.mean, t.var,
                p.sum, p.mean, p.var);
  }
  return 0;
}
