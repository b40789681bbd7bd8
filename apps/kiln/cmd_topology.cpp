#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/parallel/module.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_topology(const Args& args) {
  po::options_description opts("kiln topology FILE --world N [--set ...]\n\nPrints the tensor, context, expert, "
                               "data and pipeline parallel groups\nthe pipeline's [parallel] section gives for N "
                               "ranks.\n\noptions");
  std::string file;
  int world = 0;
  std::vector<std::string> sets;
  opts.add_options()("help,h", "show this help")("file", po::value(&file), "pipeline file")(
      "world", po::value(&world), "number of ranks")("set", po::value(&sets)->composing(), "override a value");
  po::positional_options_description pos;
  pos.add("file", 1);
  if (!parse_args(args, opts, pos)) return 0;
  if (file.empty()) throw po::error("a pipeline FILE is required");
  if (world <= 0) throw po::error("--world N (a positive rank count) is required");
  auto p = load_pipeline(file, sets);
  parallel::ParallelConfig cfg;
  if (p->config.enabled("parallel")) cfg = p->config.get<parallel::ParallelConfig>("parallel");
  try {
    parallel::Topology t(world, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.dp);
    std::cout << t.describe();
  } catch (const Error& e) {
    throw ConfigError(cat(file, ": [parallel] ", e.what()));
  }
  return 0;
}

}  // namespace kiln::app
