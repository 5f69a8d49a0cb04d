#include <iostream>

#include "tessera/cli/command.h"
#include "tessera/core/allocator.h"

namespace tessera::cli {
namespace {
const RegisterCommand reg("version", "Print the version and what this build supports", [](CLI::App& sub) {
  sub.callback([] {
    std::cout << "tessera 0.1.0 (cuda: " << (TESSERA_WITH_CUDA ? "built" : "not built")
              << ", devices visible: " << cuda_device_count()
              << ", mpi: " << (TESSERA_WITH_MPI ? "built" : "not built") << ")\n";
  });
});
}  // namespace
}  // namespace tessera::cli
