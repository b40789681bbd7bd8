#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/engine/runner.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_run(const Args& args) {
  po::options_description opts("kiln run FILE [--set section.key=value]...\n\nBuilds the World from the pipeline, "
                               "runs setup, then train.steps steps, then shutdown.\n\noptions");
  std::string file;
  std::vector<std::string> sets;
  opts.add_options()("help,h", "show this help")("file", po::value(&file), "pipeline file")(
      "set", po::value(&sets)->composing(), "override a value: section.key=value (repeatable)");
  po::positional_options_description pos;
  pos.add("file", 1);
  po::variables_map vm;
  po::store(po::command_line_parser(args).options(opts).positional(pos).run(), vm);
  if (vm.count("help")) {
    std::cout << opts << "\n";
    return 0;
  }
  po::notify(vm);
  if (file.empty()) throw po::error("a pipeline FILE is required");
  auto p = load_pipeline(file, sets);
  if (!p->config.enabled("train"))
    throw ConfigError(cat(file, ": kiln run needs a [train] section (train.steps says how long to run)"));
  World world;
  world.emplace_resource<RankInfo>(RankInfo{0, 1, 0, file});
  install_pipeline(world, p->config, p->registry);
  run_pipeline(world);
  const auto& ctl = world.resource<RunControl>();
  std::cout << "done: " << ctl.stop_reason << "\n";
  return 0;
}

}  // namespace kiln::app
