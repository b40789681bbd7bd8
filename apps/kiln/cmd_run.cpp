#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/engine/runner.hpp"
#include "kiln/ops/backend.hpp"
#include "kiln/parallel/launch.hpp"
#include "kiln/parallel/thread_ranks.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/parallel/mpi_bootstrap.hpp"
#include "kiln/parallel/rendezvous.hpp"
#ifdef KILN_WITH_CUDA
#include "kiln/parallel/nccl.hpp"
#endif

namespace po = boost::program_options;

namespace kiln::app {

namespace {

bool uses_cuda(const LoadedPipeline& p) {
  const auto device = p.config.get<EngineConfig>("engine").device;
  return device == DeviceKind::cuda || (device == DeviceKind::auto_ && ops::cuda_available());
}

double timeout_of(const LoadedPipeline& p) {
  return p.config.enabled("parallel") ? p.config.get<parallel::ParallelConfig>("parallel").timeout_s : 300.0;
}

// This process is one rank of a multi-process job (kiln run --nproc, torchrun, mpirun or srun).
int run_as_rank(const parallel::LaunchEnv& env, LoadedPipeline& p) {
  if (!uses_cuda(p))
    throw ConfigError(cat(p.config.file, ": a ", env.world, "-process job (", env.launcher,
                          ") needs the CUDA backend (NCCL); on the CPU backend use kiln run --nproc N, which runs "
                          "the ranks as threads"));
#ifdef KILN_WITH_CUDA
  parallel::use_device(env.local_rank);
  const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(timeout_of(p) * 1000));
  const std::string id = env.rank == 0 ? parallel::NcclWorld::make_unique_id() : std::string();
  std::shared_ptr<parallel::Rendezvous> rendezvous;
  if (env.launcher == "mpirun") {  // the id (and where to meet) through MPI_Bcast
    std::string why_not;
    rendezvous = parallel::mpi_rendezvous(env, id, timeout, &why_not);
    if (!rendezvous && env.rank == 0)
      std::cerr << "kiln: launched by MPI, but " << why_not << "; using the TCP rendezvous at MASTER_ADDR "
                << env.master_addr << ":" << env.master_port << "\n";
  }
  if (!rendezvous)
    rendezvous = std::make_shared<parallel::Rendezvous>(env.master_addr, env.master_port, env.rank, env.world, id,
                                                        timeout);
  auto nccl = std::make_shared<parallel::NcclWorld>(env.rank, env.world, env.local_rank, rendezvous, timeout);
  {
    World world;
    world.emplace_resource<RankInfo>(RankInfo{env.rank, env.world, env.local_rank, p.config.file, env.local_world});
    world.emplace_resource<parallel::LaunchContext>(parallel::LaunchContext{nullptr, nccl});
    install_pipeline(world, p.config, p.registry);
    run_pipeline(world);
    if (env.rank == 0) std::cout << "done: " << env.world << " ranks: " << world.resource<RunControl>().stop_reason << "\n";
  }
  rendezvous->finish();
  return 0;
#else
  throw ConfigError("this kiln was built without CUDA; multi-process jobs need it");
#endif
}

// The arguments to pass to the ranks: ours, without --nproc.
std::vector<std::string> rank_arguments(const Args& args) {
  std::vector<std::string> out = {"run"};
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--nproc") {
      ++i;
      continue;
    }
    if (args[i].rfind("--nproc=", 0) == 0) continue;
    out.push_back(args[i]);
  }
  return out;
}

}  // namespace

int cmd_run(const Args& args) {
  po::options_description opts("kiln run FILE [--set section.key=value]... [--nproc N]\n\nBuilds the World from the "
                               "pipeline, runs setup, then train.steps steps, then shutdown. With --nproc N the "
                               "job has N local ranks: threads on the CPU backend, one process per GPU on CUDA. "
                               "Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), mpirun or "
                               "srun each process joins the same job.\n\noptions");
  std::string file;
  std::vector<std::string> sets;
  int nproc = 1;
  opts.add_options()("help,h", "show this help")("file", po::value(&file), "pipeline file")(
      "set", po::value(&sets)->composing(), "override a value: section.key=value (repeatable)")(
      "nproc", po::value(&nproc)->default_value(1), "number of local ranks");
  po::positional_options_description pos;
  pos.add("file", 1);
  if (!parse_args(args, opts, pos)) return 0;
  if (file.empty()) throw po::error("a pipeline FILE is required");
  if (nproc < 1) throw po::error("--nproc must be at least 1");
  auto p = load_pipeline(file, sets);
  if (!p->config.enabled("train"))
    throw ConfigError(cat(file, ": kiln run needs a [train] section (train.steps says how long to run)"));

  const auto env = parallel::detect_launch_env();
  if (env.world > 1) return run_as_rank(env, *p);

  if (nproc == 1) {
    World world;
    world.emplace_resource<RankInfo>(RankInfo{0, 1, 0, file, 1});
    install_pipeline(world, p->config, p->registry);
    run_pipeline(world);
    std::cout << "done: " << world.resource<RunControl>().stop_reason << "\n";
    return 0;
  }
  if (uses_cuda(*p)) return parallel::run_local_processes(nproc, rank_arguments(args), timeout_of(*p));

  auto outcomes = parallel::run_thread_ranks(nproc, p->config, p->registry);
  bool config_error = false, file_error = false, failed = false;
  for (auto& o : outcomes) {
    failed |= !o.ok;
    config_error |= o.config_error;
    file_error |= o.file_error;
  }
  if (failed) {
    std::cerr << "kiln: " << (config_error ? "config error" : "error") << " (" << nproc << " ranks):\n"
              << parallel::describe_failures(outcomes) << "\n";
    return config_error || file_error ? 2 : 1;
  }
  std::cout << "done: " << nproc << " ranks: " << outcomes.front().stop_reason << "\n";
  return 0;
}

}  // namespace kiln::app
