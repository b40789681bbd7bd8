#include <iomanip>
#include <iostream>

#include <boost/program_options.hpp>

#include "commands.hpp"
#include "kiln/model/config.hpp"
#include "kiln/model/pipeline_plan.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/parallel/pipeline_schedule.hpp"
#include "kiln/parallel/pipeline_split.hpp"  // split_starts
#include "kiln/train/train.hpp"

namespace po = boost::program_options;

namespace kiln::app {

namespace {

// The pipeline's stages and each pipeline rank's schedule, as `kiln run` would make them.
void print_schedule(const config::PipelineConfig& p, const parallel::ParallelConfig& par, const parallel::Topology& t,
                    const std::string& file) {
  const auto train = p.enabled("train") ? p.get<train::TrainConfig>("train") : train::TrainConfig{};
  const auto model = p.enabled("model") ? p.get<model::ModelConfig>("model") : model::ModelConfig{};
  const int dp = t.data_parallel_size(), pp = t.sizes().pp, vpp = par.vpp, S = pp * vpp;
  const std::int64_t per_rank = train.batch_size / dp;
  const std::int64_t mbs = train.micro_batch_size > 0 ? train.micro_batch_size : per_rank;
  if (train.batch_size % dp != 0 || per_rank % mbs != 0)
    throw ConfigError(cat(file, ": train.batch_size ", train.batch_size, " does not split into micro-batches of ", mbs,
                          " over ", dp, " data-parallel ranks"));
  const parallel::PipelineShape shape{pp, vpp, static_cast<int>(per_rank / mbs)};
  const model::PipelineLayers split = model::pipeline_layers(model, static_cast<int>(train.seq_len), shape, par.pp_layers);
  if (!split.problem.empty()) throw ConfigError(cat(file, ": ", split.key, ": ", split.problem));
  const std::vector<int> layers = pp == 1 ? std::vector<int>{model.n_layer} : split.layers;
  const auto starts = parallel::split_starts(layers);
  std::cout << "pipeline: pp " << pp << (vpp > 1 ? cat(" x vpp ", vpp, " (interleaved 1F1B)") : " (1F1B)") << ", "
            << shape.micro_batches << " micro-batches a step (train.batch_size " << train.batch_size << " / (dp " << dp
            << " x micro_batch_size " << mbs << "))\n";
  for (int r = 0; r < pp; ++r) {
    std::cout << "pp rank " << r << ":";
    for (int c = 0; c < vpp; ++c) {
      const int v = c * pp + r;
      const int first = starts[static_cast<std::size_t>(v)], last = starts[static_cast<std::size_t>(v) + 1] - 1;
      std::cout << (c ? ";" : "") << " stage " << v << " = " << (v == 0 ? "embedding, " : "")
                << (first == last ? cat("block ", first) : cat("blocks ", first, "-", last))
                << (v == S - 1 ? ", head and loss" : "");
    }
    const auto plan = parallel::pipeline_schedule(shape, r);
    std::cout << "\n  " << parallel::format_actions(plan) << "\n  micro-batches in flight at most: "
              << parallel::max_in_flight(plan) << "\n";
  }
  const double simulated = parallel::simulate_pipeline(shape, 1.0, 2.0).bubble;
  std::cout << std::fixed << std::setprecision(1) << "bubble: (pp - 1) / (vpp m + pp - 1) = " << pp - 1 << " / "
            << vpp * shape.micro_batches + pp - 1 << " = " << 100.0 * parallel::pipeline_bubble(shape)
            << "% of the step (simulated, backward = 2 x forward: " << 100.0 * simulated << "%)\n"
            << std::defaultfloat;
}

}  // namespace

int cmd_topology(const Args& args) {
  po::options_description opts("kiln topology FILE --world N [--schedule] [--set ...]\n\nPrints the tensor, context, "
                               "expert, data and pipeline parallel groups\nthe pipeline's [parallel] section gives for N "
                               "ranks; with --schedule also\nthe pipeline stages and each pipeline rank's schedule.\n\n"
                               "options");
  std::string file;
  int world = 0;
  bool schedule = false;
  std::vector<std::string> sets;
  opts.add_options()("help,h", "show this help")("file", po::value(&file), "pipeline file")(
      "world", po::value(&world), "number of ranks")("schedule", po::bool_switch(&schedule),
                                                      "print the pipeline stages and schedules")(
      "set", po::value(&sets)->composing(), "override a value");
  po::positional_options_description pos;
  pos.add("file", 1);
  if (!parse_args(args, opts, pos)) return 0;
  if (file.empty()) throw po::error("a pipeline FILE is required");
  if (world <= 0) throw po::error("--world N (a positive rank count) is required");
  auto p = load_pipeline(file, sets);
  parallel::ParallelConfig cfg;
  if (p->config.enabled("parallel")) cfg = p->config.get<parallel::ParallelConfig>("parallel");
  std::optional<parallel::Topology> t;
  try {
    t.emplace(world, cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.dp);
  } catch (const Error& e) {
    throw ConfigError(cat(file, ": [parallel] ", e.what()));
  }
  std::cout << t->describe();
  if (schedule) print_schedule(p->config, cfg, *t, file);
  return 0;
}

}  // namespace kiln::app
