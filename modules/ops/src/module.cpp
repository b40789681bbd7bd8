#include "kiln/ops/module.hpp"

#include <algorithm>
#include <iomanip>
#include <iostream>
#include <thread>

#include "kiln/engine/engine_module.hpp"

namespace kiln::ops {

namespace {
void install(World& w, const BackendConfig& cfg) {
  const auto& engine = w.resource<EngineConfig>();
  const auto& rank = w.resource<RankInfo>();
  bool use_cuda = engine.device == DeviceKind::cuda || (engine.device == DeviceKind::auto_ && cuda_available());
  std::unique_ptr<Backend> b;
  if (use_cuda) {
    b = make_cuda_backend(cfg.cuda_device >= 0 ? cfg.cuda_device : rank.local_rank, {.gemm_autotune = cfg.gemm_autotune,
                                                                                        .gemm_autotune_any_order =
                                                                                            cfg.gemm_autotune_any_order,
                                                                                        .attention = cfg.attention,
                                                                                        .attention_deterministic =
                                                                                            cfg.attention_deterministic,
                                                                                        .grouped_gemm = cfg.grouped_gemm,
                                                                                        .grouped_gemm_tune =
                                                                                            cfg.grouped_gemm_tune});
  } else {
    int local = rank.local_world_size;
    int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    int threads = cfg.cpu_threads > 0 ? cfg.cpu_threads : std::max(1, hw / std::max(1, local));
    b = make_cpu_backend({.round_bf16 = cfg.cpu_round_bf16, .threads = threads});
  }
  b->set_profiling(cfg.profile);
  w.emplace_resource<ActiveBackend>(ActiveBackend{std::move(b)});
  if (cfg.profile) {
    // The first step (plan selection, first-touch allocations) is left out of the breakdown.
    w.systems().add({"backend.profile_warmup", Phase::step_end, [](World& world) {
                       if (world.resource<RunControl>().step == 1) world.resource<ActiveBackend>().get().reset_op_times();
                     }});
    w.systems().add({"backend.profile_report", Phase::shutdown, [](World& world) {
                       if (world.resource<RankInfo>().rank != 0) return;
                       const auto steps = std::max<std::int64_t>(1, world.resource<RunControl>().step - 1);
                       auto times = world.resource<ActiveBackend>().get().op_times();
                       double total = 0;
                       for (auto& t : times) total += t.ms;
                       std::cout << "op time breakdown per step (rank 0, mean of steps 2.." << steps + 1 << "):\n"
                                 << "  op                          calls/step   ms/step   share\n";
                       for (auto& t : times)
                         std::cout << "  " << std::left << std::setw(26) << t.op << std::right << std::setw(12)
                                   << std::fixed << std::setprecision(1) << double(t.calls) / steps << std::setw(10)
                                   << std::setprecision(3) << t.ms / steps << std::setw(7) << std::setprecision(1)
                                   << 100.0 * t.ms / std::max(total, 1e-9) << "%\n";
                       std::cout << "  " << std::left << std::setw(38) << "total (ops only)" << std::right << std::setw(10)
                                 << std::setprecision(3) << total / steps << "\n";
                     }});
  }
}
}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<BackendConfig>("backend", "the compute backend (CUDA or CPU) chosen by engine.device", {},
                                          install));
}

}  // namespace kiln::ops
