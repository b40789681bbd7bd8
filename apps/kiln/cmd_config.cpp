#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_config(const Args& args) {
  po::options_description opts("kiln config FILE [--set section.key=value]...\n\n"
                               "Prints the complete effective configuration as TOML: every enabled module,\n"
                               "every field with defaults filled in, docs as comments. The output reads\n"
                               "back to the same text.\n\noptions");
  std::string file;
  std::vector<std::string> sets;
  opts.add_options()("help,h", "show this help")("file", po::value(&file), "pipeline file")(
      "set", po::value(&sets)->composing(), "override a value: section.key=value (repeatable)");
  po::positional_options_description pos;
  pos.add("file", 1);
  if (!parse_args(args, opts, pos)) return 0;
  if (file.empty()) throw po::error("a pipeline FILE is required");
  auto p = load_pipeline(file, sets);
  std::cout << config::to_toml(p->config, p->registry);
  return 0;
}

}  // namespace kiln::app
