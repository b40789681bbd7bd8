#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>

#include <nlohmann/json.hpp>

#include "kiln/engine/engine_module.hpp"
#include "kiln/log/log.hpp"
#include "kiln/train/layout.hpp"
#include "kiln/train/state.hpp"
#include "kiln/train/train.hpp"

namespace kiln::log {

std::string format_step_line(std::int64_t step, std::int64_t steps, double loss, double lr, double grad_norm,
                             double tokens_per_s, double mfu, double step_ms, std::optional<double> val_loss) {
  char buf[256];
  const int width = static_cast<int>(std::to_string(steps).size());
  std::string tps = tokens_per_s >= 1e6   ? cat(std::round(tokens_per_s / 1e4) / 100, "M")
                    : tokens_per_s >= 1e3 ? cat(std::round(tokens_per_s / 1e2) / 10, "k")
                                          : cat(std::round(tokens_per_s));
  std::string mfu_text = mfu > 0 ? cat(std::round(mfu * 1000) / 10, "%") : "-";
  std::snprintf(buf, sizeof buf, "step %*lld/%lld | loss %.4f | lr %.2e | norm %.4f | %s tok/s | MFU %s | %.2f ms",
                width, static_cast<long long>(step), static_cast<long long>(steps), loss, lr, grad_norm, tps.c_str(),
                mfu_text.c_str(), step_ms);
  std::string line = buf;
  if (val_loss) {
    std::snprintf(buf, sizeof buf, " | val %.4f", *val_loss);
    line += buf;
  }
  return line;
}

namespace {

struct MetricsFile {
  std::unique_ptr<std::ofstream> out;
};

// Opens the metrics file at the first step. A run resumed from a checkpoint at step s continues
// the file: the lines of steps up to s stay, later ones (written after that checkpoint by the run
// that stopped) go, so the file reads as one run.
void open_metrics(MetricsFile& mf, const std::string& path, std::int64_t resumed_from) {
  std::string kept;
  if (resumed_from > 0) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      const auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
          j["step"].get<std::int64_t>() <= resumed_from)
        kept += line + "\n";
    }
  }
  mf.out = std::make_unique<std::ofstream>(path, std::ios::trunc);
  if (!*mf.out) KILN_THROW("log.metrics: cannot open '", path, "' for writing");
  *mf.out << kept;
}

void install(World& w, const LogConfig& cfg) {
  const bool rank0 = w.resource<RankInfo>().rank == 0;
  w.emplace_resource<MetricsFile>();
  if (cfg.metrics && rank0 && !std::ofstream(*cfg.metrics, std::ios::app))  // appending changes nothing yet
    KILN_THROW("log.metrics: cannot open '", *cfg.metrics, "' for writing");
  w.systems().add({"log.step",
                   Phase::step_end,
                   [cfg, rank0](World& world) {
                     auto& ts = world.resource<train::TrainState>();
                     const auto steps = world.resource<train::TrainConfig>().steps;
                     const bool last = ts.step >= steps;
                     if (cfg.val_every > 0 && (ts.step % cfg.val_every == 0 || last))
                       world.events().publish(train::EvaluationRequested{ts.step});
                     if (cfg.sample_every > 0 && (ts.step % cfg.sample_every == 0 || last)) {
                       ts.sample.reset();
                       world.events().publish(train::SampleRequested{ts.step, cfg.sample_prompt, cfg.sample_tokens});
                       if (rank0 && ts.sample) std::cout << "sample (step " << ts.step << "): " << *ts.sample << std::endl;
                     }
                     if (!rank0) return;
                     if (ts.step == 1 || last || ts.step % cfg.every == 0 || ts.val_loss)
                       std::cout << format_step_line(ts.step, steps, ts.loss, ts.lr, ts.grad_norm, ts.tokens_per_s,
                                                     ts.mfu, ts.step_ms, ts.val_loss)
                                 << std::endl;
                     auto& mf = world.resource<MetricsFile>();
                     if (cfg.metrics && !mf.out) open_metrics(mf, *cfg.metrics, world.resource<train::TrainingState>().resumed_from);
                     if (mf.out) {  // non-finite values are written as null
                       nlohmann::ordered_json j = {{"step", ts.step},         {"loss", ts.loss},
                                                   {"lr", ts.lr},             {"grad_norm", ts.grad_norm},
                                                   {"tokens_per_s", ts.tokens_per_s}, {"step_ms", ts.step_ms},
                                                   {"mfu", ts.mfu},           {"tokens", ts.tokens_seen},
                                                   {"elapsed_s", ts.elapsed_s}};
                       if (ts.val_loss) j["val_loss"] = *ts.val_loss;
                       for (const auto& [name, value] : ts.metrics) j[name] = value;
                       *mf.out << j.dump() << "\n";
                       mf.out->flush();
                     }
                   },
                   {"train.step_end"}});
  if (cfg.timeline) {
    // Every rank writes its own file of the step's passes.
    const std::string path = cat(*cfg.timeline, ".rank", w.resource<RankInfo>().rank);
    if (!std::ofstream(path, std::ios::app)) KILN_THROW("log.timeline: cannot open '", path, "' for writing");
    w.emplace_resource<train::PassTimeline>();
    w.systems().add({"log.timeline_begin", Phase::step_begin, [cfg](World& world) {
                       auto& tl = world.resource<train::PassTimeline>();
                       tl.record = world.resource<RunControl>().step == cfg.timeline_step;
                       tl.passes.clear();
                     }});
    w.systems().add({"log.timeline", Phase::step_end,
                     [path](World& world) {
                       auto& tl = world.resource<train::PassTimeline>();
                       if (!tl.record) return;
                       tl.record = false;
                       const auto* layout = world.try_resource<train::ParallelLayout>();
                       std::ofstream out(path, std::ios::trunc);
                       for (const auto& p : tl.passes) {
                         const nlohmann::ordered_json j = {
                             {"rank", world.resource<RankInfo>().rank}, {"pp_rank", layout ? layout->pp_rank : 0},
                             {"step", world.resource<RunControl>().step}, {"pass", p.forward ? "F" : "B"},
                             {"micro_batch", p.micro_batch}, {"chunk", p.chunk}, {"start_s", p.start_s},
                             {"end_s", p.end_s}};
                         out << j.dump() << "\n";
                       }
                       if (!out) KILN_THROW("log.timeline: cannot write '", path, "'");
                     },
                     {"train.step_end"}});
  }
  w.systems().add({"log.summary", Phase::shutdown, [rank0](World& world) {
                     if (!rank0) return;
                     const auto& ts = world.resource<train::TrainState>();
                     if (ts.peak_device_memory > 0)
                       std::printf("peak device memory %.2f GiB (%.0f MiB, rank 0)\n",
                                   static_cast<double>(ts.peak_device_memory) / (1024.0 * 1024.0 * 1024.0),
                                   static_cast<double>(ts.peak_device_memory) / (1024.0 * 1024.0));
                   }});
}

}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<LogConfig>("log", "per-step log lines and a JSONL metrics file", {"train"}, install));
}

}  // namespace kiln::log
