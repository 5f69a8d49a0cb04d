#include <algorithm>
#include <iostream>

#include "tessera/cli/command.h"
#include "tessera/core/error.h"

namespace tessera::cli {
std::vector<Command>& commands() {
  static std::vector<Command> all;
  return all;
}
}  // namespace tessera::cli

int main(int argc, char** argv) {
  using namespace tessera::cli;
  CLI::App app{"tessera: train, evaluate and sample GPT-2 and Llama models; launch distributed jobs"};
  app.require_subcommand(1);
  std::sort(commands().begin(), commands().end(),
            [](const Command& a, const Command& b) { return a.name < b.name; });
  for (const Command& c : commands()) c.setup(*app.add_subcommand(c.name, c.help));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const tessera::Error& e) {
    std::cerr << "tessera: error: " << e.what() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "tessera: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
