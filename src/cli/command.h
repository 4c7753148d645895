// Subcommand registry of the kiln binary. Each cmd_*.cpp registers itself:
//
//   static kiln::cli::Registrar reg{"inspect", "Plan hardware for a model", [](CLI::App& app) {
//     auto opts = std::make_shared<Opts>();
//     app.add_option("--model-path", opts->model_path, "...");
//     return [opts]() -> int { ...; return 0; };   // runs when this subcommand is chosen
//   }};
//
// A kiln::Error escaping the run function is printed as one "error: ..." line, exit status 1.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>
#include <vector>

namespace kiln::cli {

using RunFn = std::function<int()>;
using SetupFn = std::function<RunFn(CLI::App&)>;

struct CommandSpec {
  std::string name;
  std::string help;
  SetupFn setup;
};

std::vector<CommandSpec>& registry();

struct Registrar {
  Registrar(std::string name, std::string help, SetupFn setup) {
    registry().push_back({std::move(name), std::move(help), std::move(setup)});
  }
};

}  // namespace kiln::cli
