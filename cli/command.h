// Subcommands of the `tessera` program register themselves here, one file each
// (cli/train.cpp, cli/launch.cpp, ...), so adding one edits no shared file.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace tessera::cli {

struct Command {
  std::string name;
  std::string help;
  // Adds the subcommand's options and its callback to `sub`.
  std::function<void(CLI::App& sub)> setup;
};

std::vector<Command>& commands();

struct RegisterCommand {
  RegisterCommand(std::string name, std::string help, std::function<void(CLI::App&)> setup) {
    commands().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

}  // namespace tessera::cli
