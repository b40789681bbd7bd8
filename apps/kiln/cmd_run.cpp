#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/engine/runner.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/parallel/launch.hpp"

namespace po = boost::program_options;

namespace kiln::app {

int cmd_run(const Args& args) {
  po::options_description opts("kiln run FILE [--set section.key=value]... [--nproc N]\n\nBuilds the World from the "
                               "pipeline, runs setup, then train.steps steps, then shutdown.\n\noptions");
  std::string file;
  std::vector<std::string> sets;
  int nproc = 1;
  opts.add_options()("help,h", "show this help")("file", po::value(&file), "pipeline file")(
      "set", po::value(&sets)->composing(), "override a value: section.key=value (repeatable)")(
      "nproc", po::value(&nproc)->default_value(1), "number of local ranks (threads on the CPU backend)");
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
  if (nproc < 1) throw po::error("--nproc must be at least 1");
  auto p = load_pipeline(file, sets);
  if (!p->config.enabled("train"))
    throw ConfigError(cat(file, ": kiln run needs a [train] section (train.steps says how long to run)"));

  if (nproc == 1) {
    World world;
    world.emplace_resource<RankInfo>(RankInfo{0, 1, 0, file, 1});
    install_pipeline(world, p->config, p->registry);
    run_pipeline(world);
    std::cout << "done: " << world.resource<RunControl>().stop_reason << "\n";
    return 0;
  }

  const auto device = p->config.get<EngineConfig>("engine").device;
  if (device == DeviceKind::cuda || (device == DeviceKind::auto_ && ops::cuda_available()))
    throw ConfigError(cat(file, ": --nproc ", nproc, " on the CUDA backend (one process per GPU over NCCL) is not "
                          "implemented yet; set engine.device = \"cpu\" to run the ranks as threads"));
  auto outcomes = parallel::run_thread_ranks(nproc, p->config, p->registry);
  bool config_error = false, failed = false;
  for (auto& o : outcomes) {
    failed |= !o.ok;
    config_error |= o.config_error;
  }
  if (failed) {
    std::cerr << "kiln: " << (config_error ? "config error" : "error") << " (" << nproc << " ranks):\n"
              << parallel::describe_failures(outcomes) << "\n";
    return config_error ? 2 : 1;
  }
  std::cout << "done: " << nproc << " ranks finished train.steps\n";
  return 0;
}

}  // namespace kiln::app
