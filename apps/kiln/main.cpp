// kiln: run TOML training pipelines, inspect their configuration and the registered modules.
#include <cstring>
#include <iostream>
#include <string>

#include <boost/program_options/errors.hpp>

#include "commands.hpp"
#include "kiln/core/error.hpp"

namespace {
const char* kUsage =
    "usage: kiln <command> [options]\n"
    "\n"
    "commands:\n"
    "  run FILE [--set section.key=value]...   train with a pipeline file\n"
    "  config FILE [--set ...]                 print the complete effective config as TOML\n"
    "  modules                                 list the registered modules and their config fields\n"
    "  topology FILE --world N [--schedule]    print the parallel groups (and pipeline schedules) for N ranks\n"
    "  tokenize TEXT... -o DIR                 turn text files into byte-level token shards\n"
    "  plot METRICS[=LABEL]... -o OUT.svg      plot metrics files (log.metrics) as an SVG line chart\n"
    "  export CHECKPOINT -o DIR                a model's weights in Hugging Face's layout (Llama, GPT-2)\n"
    "  generate MODEL --prompt TEXT            sample text from a checkpoint or a Hugging Face model\n"
    "  eval MODEL --data SHARDS                a model's loss and perplexity over token shards\n"
    "\n"
    "`kiln <command> --help` describes a command.\n";
}

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "help")) {
    std::cout << kUsage;
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  kiln::app::Args args(argv + 2, argv + argc);
  try {
    if (cmd == "run") return kiln::app::cmd_run(args);
    if (cmd == "config") return kiln::app::cmd_config(args);
    if (cmd == "modules") return kiln::app::cmd_modules(args);
    if (cmd == "tokenize") return kiln::app::cmd_tokenize(args);
    if (cmd == "topology") return kiln::app::cmd_topology(args);
    if (cmd == "plot") return kiln::app::cmd_plot(args);
    if (cmd == "export") return kiln::app::cmd_export(args);
    if (cmd == "generate") return kiln::app::cmd_generate(args);
    if (cmd == "eval") return kiln::app::cmd_eval(args);
    std::cerr << "kiln: unknown command '" << cmd << "'\n\n" << kUsage;
    return 2;
  } catch (const kiln::ConfigError& e) {
    std::cerr << "kiln: config error:\n" << e.what() << "\n";
    return 2;
  } catch (const kiln::FileError& e) {
    std::cerr << "kiln: error: " << e.what() << "\n";
    return 2;
  } catch (const boost::program_options::error& e) {
    std::cerr << "kiln " << cmd << ": " << e.what() << " (see `kiln " << cmd << " --help`)\n";
    return 2;
  } catch (const kiln::Error& e) {
    std::cerr << "kiln: error: " << e.what();
    if (!e.where().empty()) std::cerr << "\n  (raised at " << e.where() << ")";
    std::cerr << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "kiln: error: " << e.what() << "\n";
    return 1;
  }
}
