// `tessera version` (one line) and `tessera env` (what `accelerate env` reports: the build,
// the machine and the active launch config, for bug reports; then every setting of
// core/settings.h with its value and source).
#include <sys/utsname.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "tessera/cli/command.h"
#include "tessera/cli/launch_config.h"
#include "tessera/core/allocator.h"
#include "tessera/core/error.h"
#include "tessera/core/settings.h"

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

// Every setting of core/settings.h with its value and where it came from; a refused value is
// shown with its error, and the command then fails naming every refused one.
void print_settings() {
  std::cout << "- Settings (docs/settings.md):\n";
  std::string refused;
  for (const SettingReport& s : current_settings()) {
    std::cout << "\t" << s.info->name << "=" << s.value.text
              << (s.value.text.empty() ? "(unset)" : "") << " ("
              << setting_source_name(s.value.source) << ")";
    if (!s.error.empty()) {
      std::cout << " REFUSED: " << s.error;
      refused += (refused.empty() ? "" : "; ") + s.error;
    }
    std::cout << "\n";
  }
  std::cout.flush();
  TESSERA_CHECK(refused.empty(), "tessera env: ", refused);
}

// The table of docs/settings.md, one row a setting (tests/cli checks that the page holds it).
void print_settings_markdown() {
  std::cout << "| variable | default | accepted values | read by | what it does |\n"
            << "| --- | --- | --- | --- | --- |\n";
  for (const SettingInfo& info : setting_table()) {
    const std::string default_value = *info.default_value
                                          ? detail::concat("`", info.default_value, "`")
                                          : std::string("unset");
    std::cout << "| `" << info.name << "` | " << default_value << " | " << accepted_values(info)
              << " | " << info.layer << " | " << info.description << " |\n";
  }
}

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
  } else {
    std::cout << "- Tessera/Accelerate config (" << path << "):\n";
    for (std::string line; std::getline(in, line);) std::cout << "\t" << line << "\n";
  }
  print_settings();
}

const RegisterCommand env("env", "Print the version, the machine, the backends built, the launch config "
                                 "(as `accelerate env`) and every TESSERA_* setting",
                          [](CLI::App& sub) {
                            auto config_file = std::make_shared<std::string>();
                            sub.add_option("--config-file,--config_file", *config_file,
                                           "the config to show (default: " + default_config_path() + ")");
                            auto markdown = std::make_shared<bool>(false);
                            sub.add_flag("--markdown", *markdown,
                                         "print only the table of settings of docs/settings.md");
                            sub.callback([config_file, markdown] {
                              if (*markdown)
                                print_settings_markdown();
                              else
                                print_environment(*config_file);
                            });
                          });

}  // namespace
}  // namespace tessera::cli
