#include "saver.hpp"

#include <chrono>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>

#include "agreement.hpp"
#include "held_tensors.hpp"
#include "kiln/checkpoint/files.hpp"
#include "kiln/checkpoint/reader.hpp"
#include "kiln/checkpoint/shard_file.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/state.hpp"
#include "topology_info.hpp"

namespace kiln::checkpoint {

namespace fs = std::filesystem;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Every family of held buffers: the master weights, then those the modules registered.
std::vector<std::pair<std::string, TensorView>> held_families(World& w) {
  std::vector<std::pair<std::string, TensorView>> out = {{"model", w.resource<nn::ParamStore>().master_flat()}};
  for (auto& h : w.resource<train::TrainingState>().held) out.emplace_back(h.name, h.view());
  return out;
}

parallel::Communicator& world_comm(World& w) { return *w.resource<parallel::Communicators>().world; }

}  // namespace

Saver::~Saver() {
  if (writing_.valid()) writing_.wait();
}

double Saver::reserve() {
  const double t0 = now_s();
  const std::size_t need = static_cast<std::size_t>(w_.resource<nn::ParamStore>().held()) * 4 * held_families(w_).size();
  if (staging_.bytes() < need) {
    staging_ = Buffer();
    staging_ = w_.resource<ops::ActiveBackend>().get().alloc_host(need);
  }
  return now_s() - t0;
}

void Saver::stage() {
  auto& be = w_.resource<ops::ActiveBackend>().get();
  const auto& store = w_.resource<nn::ParamStore>();
  const auto families = held_families(w_);
  const std::size_t per = static_cast<std::size_t>(store.held()) * 4;
  reserve();
  for (std::size_t f = 0; f < families.size(); ++f)
    held_to_host(be, static_cast<float*>(staging_.data()) + f * per / 4, families[f].second);
  be.synchronize();
}

void Saver::start(std::int64_t step) {
  if (pending()) complete(true);
  const double t0 = now_s();
  const auto& info = w_.resource<RankInfo>();
  step_ = step;
  const std::string tmp = cfg_.dir + "/" + step_directory_name(step) + ".tmp";
  if (info.rank == 0) {
    std::error_code ec;
    fs::create_directories(cfg_.dir, ec);
    if (ec) KILN_FILE_ERROR("checkpoint.dir: cannot create ", cfg_.dir, ": ", ec.message());
    // Directories of saves that never completed (a process killed while saving) go first.
    for (auto& e : fs::directory_iterator(cfg_.dir)) {
      const std::string name = e.path().filename().string();
      if (name.rfind("step_", 0) == 0 && name.size() > 4 && name.substr(name.size() - 4) == ".tmp")
        fs::remove_all(e.path(), ec);
    }
    fs::create_directories(tmp, ec);
    if (ec) KILN_FILE_ERROR("cannot create ", tmp, ": ", ec.message());
  }
  world_comm(w_).barrier();

  stage();
  const auto& store = w_.resource<nn::ParamStore>();
  const auto families = held_families(w_);
  std::vector<std::string> names;
  for (auto& f : families) names.push_back(f.first);
  ShardFile file;
  const float* base = static_cast<const float*>(staging_.data());
  for (auto& t : held_tensors(w_, names)) {
    if (!t.writes) continue;
    for (auto& p : t.pieces) file.add_piece(t.name, t.shape, p.piece, base + t.family * store.held() + t.held_at(p));
  }
  auto& ts = w_.resource<train::TrainingState>();
  for (auto& b : ts.blobs)
    if (!b.saved_here || b.saved_here()) file.add_blob(b.name, b.save());
  counters_.clear();
  for (auto& c : ts.counters) counters_[c.name] = c.get();
  const std::string name = cat("rank_", std::setfill('0'), std::setw(5), info.rank, ".bin");
  writing_ = std::async(std::launch::async, [file = std::move(file), tmp, name, rank = info.rank,
                                             coords = coords_of(w_)]() { return file.write(tmp, name, rank, coords).to_json(); });
  started_ = t0;
  blocked_s_ = now_s() - t0;
  if (!cfg_.async) complete(true);
}

void Saver::complete(bool wait) {
  if (!pending()) return;
  if (wait) writing_.wait();
  const bool ready = writing_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  if (sum_over_ranks(w_, ready ? 0 : 1) > 0) return;  // some rank is still writing: try at the next step

  std::string fragment;
  std::exception_ptr failed;
  try {
    fragment = writing_.get();
  } catch (...) {
    failed = std::current_exception();
  }
  const std::string who = failing_ranks(w_, failed != nullptr);
  if (!who.empty()) {
    if (failed) std::rethrow_exception(failed);
    KILN_FILE_ERROR("rank ", who, " could not write its part of checkpoint ", cfg_.dir, "/", step_directory_name(step_),
                    " (its error says why); the previous checkpoint is intact");
  }
  finalize(fragment);
}

void Saver::finalize(const std::string& fragment) {
  auto& comm = world_comm(w_);
  const int rank = w_.resource<RankInfo>().rank;
  std::int32_t longest = static_cast<std::int32_t>(fragment.size());
  comm.all_reduce(TensorView(&longest, {1}, DType::i32, Device::cpu), parallel::ReduceOp::max, nullptr);
  const std::int64_t words = (longest + 3) / 4 + 1;  // a zero word ends every part
  std::vector<std::int32_t> mine(static_cast<std::size_t>(words), 0), all(static_cast<std::size_t>(words * comm.size()));
  std::memcpy(mine.data(), fragment.data(), fragment.size());
  comm.all_gather(TensorView(all.data(), {words * comm.size()}, DType::i32, Device::cpu),
                  TensorView(mine.data(), {words}, DType::i32, Device::cpu), nullptr);

  const std::string final_dir = cfg_.dir + "/" + step_directory_name(step_), tmp = final_dir + ".tmp";
  std::exception_ptr failed;
  if (rank == 0) {
    try {
      std::vector<Manifest> parts;
      for (int r = 0; r < comm.size(); ++r) {
        const char* p = reinterpret_cast<const char*>(all.data() + r * words);
        parts.push_back(Manifest::parse(std::string(p), cat("rank ", comm.members()[r], "'s part of the manifest")));
      }
      Manifest m = Manifest::merge(std::move(parts));
      m.kiln_version = KILN_VERSION;
      m.step = step_;
      m.topology = topology_of(w_);
      m.counters = counters_;
      m.config = w_.has_resource<ConfigSources>() ? w_.resource<ConfigSources>().effective : "";
      OutputFile out(tmp + "/manifest.json");
      const std::string text = m.to_json();
      out.write(text.data(), text.size());
      out.close();
      sync_directory(tmp);
      // A directory goes by renaming it to a .tmp name first, so that one half removed never
      // looks complete (the next save clears .tmp directories).
      auto retire = [&](const std::string& dir) {
        const std::string gone = dir + ".retired.tmp";
        std::error_code ec;
        fs::remove_all(gone, ec);
        rename_path(dir, gone);
        return gone;
      };
      std::string replaced;
      if (fs::exists(final_dir)) replaced = retire(final_dir);  // a save of this step before (a rerun)
      rename_path(tmp, final_dir);
      sync_directory(cfg_.dir);
      write_file_atomically(cfg_.dir + "/latest", step_directory_name(step_) + "\n");
      std::error_code ec;
      if (!replaced.empty()) fs::remove_all(replaced, ec);
      if (cfg_.keep > 0) {
        auto done = complete_checkpoints(cfg_.dir);
        for (std::size_t i = 0; i + static_cast<std::size_t>(cfg_.keep) < done.size(); ++i)
          if (done[i].path != final_dir) fs::remove_all(retire(done[i].path), ec);
      }
    } catch (...) {
      failed = std::current_exception();
    }
  }
  if (sum_over_ranks(w_, failed ? 1 : 0) > 0) {
    if (failed) std::rethrow_exception(failed);
    KILN_FILE_ERROR("rank 0 could not complete checkpoint ", final_dir, " (its error says why)");
  }
  last_saved_ = step_;
  writing_ = {};
  if (rank == 0) {
    const std::uint64_t all_bytes = [&] {
      std::uint64_t n = 0;
      std::error_code ec;
      for (auto& e : fs::directory_iterator(final_dir, ec)) n += e.is_regular_file() ? e.file_size() : 0;
      return n;
    }();
    std::cout << "checkpoint: saved " << final_dir << " (" << std::fixed << std::setprecision(1)
              << static_cast<double>(all_bytes) / (1 << 20) << " MiB; the step waited " << std::setprecision(3)
              << (cfg_.async ? blocked_s_ : now_s() - started_) << " s, " << (cfg_.async ? "written in the background in " : "written in ")
              << now_s() - started_ << " s)\n"
              << std::defaultfloat;
  }
}

}  // namespace kiln::checkpoint
