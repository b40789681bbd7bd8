#include "loader.hpp"

#include <cstring>
#include <functional>
#include <iostream>

#include "agreement.hpp"
#include "held_tensors.hpp"
#include "kiln/checkpoint/reader.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/state.hpp"
#include "topology_info.hpp"

namespace kiln::checkpoint {

namespace {

std::string layout_text(const std::map<std::string, std::int64_t>& t) {
  std::string s;
  for (const char* k : {"tp", "dp", "pp", "cp", "ep", "fsdp_shards"}) {
    auto it = t.find(k);
    if (it != t.end()) s += cat(s.empty() ? "" : " ", k, "=", it->second);
  }
  return s;
}

// Reads everything this rank needs and checks it; returns what applies it.
std::function<void()> prepare(World& w, const std::string& dir) {
  CheckpointReader reader(dir);
  const Manifest& m = reader.manifest();
  auto& be = w.resource<ops::ActiveBackend>().get();
  auto& store = w.resource<nn::ParamStore>();
  auto& ts = w.resource<train::TrainingState>();
  const int rank = w.resource<RankInfo>().rank;

  std::vector<std::string> names = {"model"};
  std::vector<std::function<TensorView()>> views = {[&store] { return store.master_flat(); }};
  for (auto& h : ts.held) {
    names.push_back(h.name);
    views.push_back(h.view);
  }
  // The held buffers as they will be, padding zero, in host memory first.
  const std::size_t per = static_cast<std::size_t>(store.held()) * 4;
  auto staging = std::make_shared<Buffer>(be.alloc_host(per * names.size()));
  std::memset(staging->data(), 0, per * names.size());
  float* base = static_cast<float*>(staging->data());
  for (auto& t : held_tensors(w, names)) {
    const TensorEntry& entry = reader.tensor(t.name, t.shape);
    for (auto& p : t.pieces) reader.read(entry, p.piece, base + t.family * store.held() + t.held_at(p));
  }

  std::vector<std::pair<const train::TrainingState::Counter*, std::int64_t>> counters;
  for (auto& c : ts.counters) {
    auto it = m.counters.find(c.name);
    if (it == m.counters.end()) {
      if (rank == 0) std::cout << "checkpoint: " << dir << " has no counter '" << c.name << "'; it keeps its value\n";
      continue;
    }
    counters.emplace_back(&c, it->second);
  }

  const bool same_layout = m.topology == topology_of(w);
  if (!same_layout && rank == 0)
    std::cout << "checkpoint: " << dir << " was saved with " << layout_text(m.topology) << ", this run has "
              << layout_text(topology_of(w)) << ": the weights and optimizer state are resharded\n";
  std::vector<std::function<void()>> blobs;
  for (auto& b : ts.blobs) {
    train::SavedBlobs saved;
    saved.checkpoint = dir;
    saved.same_layout = same_layout;
    std::string own;
    bool have_own = false;
    for (auto& r : m.ranks)
      if (const BlobEntry* e = r.blob(b.name)) {
        saved.all.push_back(reader.blob(*e));
        if (same_layout && r.rank == rank) {
          own = saved.all.back();
          have_own = true;
        }
      }
    if (have_own) saved.own = &own;
    blobs.push_back(b.prepare(saved));
  }

  return [&w, &be, &store, staging, views, per, counters, blobs = std::move(blobs), step = m.step] {
    for (std::size_t f = 0; f < views.size(); ++f)
      held_from_host(be, views[f](), static_cast<float*>(staging->data()) + f * per / 4);
    for (const auto& [act, master] : store.act_copies()) be.convert(act, master);
    for (auto& [c, v] : counters) c->set(v);
    for (auto& apply : blobs) apply();
    be.synchronize();
    w.resource<RunControl>().step = step;
    w.resource<train::TrainingState>().resumed_from = step;
    w.events().publish(nn::ParamsLoaded{step});
  };
}

}  // namespace

std::int64_t load_checkpoint(World& w, const std::string& dir) {
  std::function<void()> apply;
  std::exception_ptr failed;
  try {
    apply = prepare(w, dir);
  } catch (...) {
    failed = std::current_exception();
  }
  const std::string who = failing_ranks(w, failed != nullptr);
  if (failed) std::rethrow_exception(failed);
  if (!who.empty()) KILN_FILE_ERROR("rank ", who, " could not load checkpoint ", dir, " (its error says why)");
  apply();
  return w.resource<RunControl>().step;
}

}  // namespace kiln::checkpoint
