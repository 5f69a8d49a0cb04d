// tessera_ladders: the kernel ladders, each rung checked against a float64 CPU reference and
// timed next to the device's ceilings. See ladders/README.md.
//   usage: tessera_ladders [--check-only] [--own-kernels] [all | <ladder>...]   (--list names them)
// --check-only runs only the small odd shapes, untimed: what compute-sanitizer runs;
// --own-kernels leaves out the rungs that call a library (production entry, cuBLAS, cuDNN).
// Exit status: 0 when every rung matches its reference (or when there is no CUDA device:
// the program then prints "no CUDA device, skipped"), 1 on a mismatch or a CUDA error,
// 2 on a bad argument.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "ladder_harness.cuh"

namespace ladders {
int layernorm_forward_ladder();
int layernorm_backward_ladder();
int softmax_ladder();
int cross_entropy_ladder();
int adamw_ladder();
int gemm_ladder();
int attention_forward_ladder();
}  // namespace ladders

namespace {

struct Entry {
  const char* name;
  int (*run)();
  const char* what;
};
constexpr Entry kLadders[] = {
    {"layernorm_forward", ladders::layernorm_forward_ladder, "LayerNorm over rows, bf16"},
    {"layernorm_backward", ladders::layernorm_backward_ladder, "dx, dweight, dbias of LayerNorm"},
    {"softmax", ladders::softmax_ladder, "softmax over rows, bf16"},
    {"cross_entropy", ladders::cross_entropy_ladder, "loss and dlogits over a 50k vocabulary"},
    {"adamw", ladders::adamw_ladder, "one AdamW step, f32"},
    {"gemm", ladders::gemm_ladder, "C = A B, bf16 in, f32 accumulation"},
    {"attention_forward", ladders::attention_forward_ladder, "causal attention, head size 64"},
};

int usage(const char* bad) {
  if (bad != nullptr) std::fprintf(stderr, "tessera_ladders: unknown ladder '%s'\n", bad);
  std::fprintf(
      stderr,
      "usage: tessera_ladders [--check-only] [--own-kernels] [all | <ladder>...]\nladders:\n");
  for (const Entry& e : kLadders) std::fprintf(stderr, "  %-20s %s\n", e.name, e.what);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a log cut short by a timeout keeps every line
  std::vector<const Entry*> chosen;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--list") || !std::strcmp(argv[i], "--help"))
      return usage(nullptr), 0;
    if (!std::strcmp(argv[i], "--check-only")) {
      ladders::set_check_only(true);
      continue;
    }
    if (!std::strcmp(argv[i], "--own-kernels")) {
      ladders::set_own_kernels_only(true);
      continue;
    }
    if (!std::strcmp(argv[i], "all")) {
      for (const Entry& e : kLadders) chosen.push_back(&e);
      continue;
    }
    const Entry* found = nullptr;
    for (const Entry& e : kLadders)
      if (!std::strcmp(argv[i], e.name)) found = &e;
    if (found == nullptr) return usage(argv[i]);
    chosen.push_back(found);
  }
  if (chosen.empty())
    for (const Entry& e : kLadders) chosen.push_back(&e);

  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("no CUDA device, skipped (%s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "none visible");
    return 0;
  }
  int failures = 0;
  try {
    if (!ladders::check_only()) ladders::ceilings();
    for (const Entry* e : chosen) failures += e->run();
  } catch (const std::exception& e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
  if (!ladders::table_rows().empty()) {
    std::printf(
        "\nmarkdown rows (ladders/README.md):\n| ladder | shape | rung | ms | rate | of ceiling "
        "|\n");
    for (const std::string& row : ladders::table_rows()) std::printf("%s\n", row.c_str());
  }
  if (failures > 0) {
    std::printf("\n%d rung(s) do not match the float64 reference\n", failures);
    return 1;
  }
  std::printf("\nevery rung matches the float64 reference\n");
  return 0;
}
