// `tessera version` (one line) and `tessera env` (what `accelerate env` reports: the build,
// the machine and the active launch config, for bug reports).
#include <sys/utsname.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "tessera/cli/command.h"
#include "tessera/cli/launch_config.h"
#include "tessera/core/allocator.h"

namespace tessera::cli {
namespace {

const char* built(bool yes) { return yes ? "built" : "not built"; }

const RegisterCommand version("version", "Print the version and what this build supports", [](CLI::App& sub) {
  sub.callback([] {
    std::cout << "tessera " << TESSERA_VERSION_TEXT << " (cuda: " << built(TESSERA_WITH_CUDA)
              << ", devices visible: " << cuda_device_count() << ", mpi: " << built(TESSERA_WITH_MPI)
              << ")\n";
  });
});

void print_environment(const std::string& config_file) {
  utsname system{};
  ::uname(&system);
  const double ram_gib = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                         static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024 * 1024);
  std::cout << "\nCopy-and-paste the text below in your GitHub issue\n\n"
            << "- `Tessera` version: " << TESSERA_VERSION_TEXT << "\n"
            << "- Platform: " << system.sysname << "-" << system.release << "-" << system.machine << "\n"
            << "- CPU count: " << std::thread::hardware_concurrency() << "\n"
            << "- System RAM: " << std::fixed;
  std::cout.precision(2);
  std::cout << ram_gib << " GB\n"
            << "- CUDA backend: " << built(TESSERA_WITH_CUDA) << "; GPUs visible: " << cuda_device_count() << "\n"
            << "- NCCL: " << built(TESSERA_WITH_NCCL) << "\n"
            << "- MPI: " << built(TESSERA_WITH_MPI) << "\n";
  const std::string path = config_file.empty() ? default_config_path() : config_file;
  std::ifstream in(path);
  if (!in.good()) {
    std::cout << "- Tessera/Accelerate config: not found (" << path << ")\n";
    return;
  }
  std::cout << "- Tessera/Accelerate config (" << path << "):\n";
  for (std::string line; std::getline(in, line);) std::cout << "\t" << line << "\n";
}

const RegisterCommand env("env", "Print the version, the machine, the backends built and the launch config "
                                 "(as `accelerate env`)",
                          [](CLI::App& sub) {
                            auto config_file = std::make_shared<std::string>();
                            sub.add_option("--config-file,--config_file", *config_file,
                                           "the config to show (default: " + default_config_path() + ")");
                            sub.callback([config_file] { print_environment(*config_file); });
                          });

}  // namespace
}  // namespace tessera::cli
