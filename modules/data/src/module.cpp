#include "kiln/data/module.hpp"

#include <algorithm>

#include "kiln/engine/engine_module.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/rng/philox.hpp"
#include "kiln/rng/seed_policy.hpp"
#include "kiln/train/state.hpp"
#include "kiln/train/train.hpp"

namespace kiln::data {

namespace {

std::unique_ptr<WindowIndex> open_split(const std::string& pattern, ShardFormat format, int T, const char* what) {
  std::vector<TokenShard> shards;
  for (auto& path : expand_glob(pattern, what)) shards.emplace_back(path, format);
  return std::make_unique<WindowIndex>(std::move(shards), T);
}

// Window w of `index` into sequence i of `b` (sized already), with its document starts when `b`
// takes them.
void read_window(const WindowIndex& index, std::uint64_t w, train::Batch& b, int i) {
  const int T = b.T;
  index.read(w, b.inputs.data() + i * T, b.targets.data() + i * T, 0,
             b.doc_start.empty() ? nullptr : b.doc_start.data() + i * T);
}

void size_batch(train::Batch& b, int count, int T, bool documents) {
  b.B = count;
  b.T = T;
  b.inputs.resize(static_cast<std::size_t>(count) * T);
  b.targets.resize(b.inputs.size());
  b.doc_start.resize(documents ? b.inputs.size() : 0);
}

// Fills `b` with `count` samples starting at global sample `first`.
void fill(train::Batch& b, DataState& st, std::uint64_t first, int count, int T, bool documents) {
  size_batch(b, count, T, documents);
  for (int i = 0; i < count; ++i) read_window(*st.train, st.order->window(first + i), b, i);
}

void fill_synthetic(train::Batch& b, std::uint64_t seed, std::uint64_t first, int count, int T, int vocab) {
  size_batch(b, count, T, false);
  for (int i = 0; i < count; ++i)
    for (int t = 0; t <= T; ++t) {
      auto tok = static_cast<std::int32_t>(rng::philox_u32(seed, (first + i) * (T + 1), t) % vocab);
      if (t < T) b.inputs[i * T + t] = tok;
      if (t > 0) b.targets[i * T + t - 1] = tok;
    }
}

// The targets trained on in the global batch of samples [position, position + batch_size): every
// rank reads the loss masks of the whole batch (a byte per token), so all agree on the mean's
// divisor without communicating. 0 without masks (all of them).
std::int64_t step_targets(World& world, std::uint64_t position) {
  auto& st = world.resource<DataState>();
  if (!st.train || !st.train->masked()) return 0;
  if (st.counted_at != position) {
    const auto batch = static_cast<std::uint64_t>(world.resource<train::TrainConfig>().batch_size);
    std::int64_t n = 0;
    for (std::uint64_t i = 0; i < batch; ++i) n += st.train->trained_targets(st.order->window(position + i));
    st.counted_at = position;
    st.counted = std::max<std::int64_t>(n, 1);  // none trained on: the loss is 0 (every target -1), not 0/0
  }
  return st.counted;
}

void install(World& w, const DataConfig& cfg) {
  const auto& tc = w.resource<train::TrainConfig>();
  const int T = static_cast<int>(tc.seq_len);
  auto& st = w.emplace_resource<DataState>();
  // The global position (samples consumed by all ranks): a checkpoint restores it under any layout.
  w.resource<train::TrainingState>().counters.push_back(
      {"data.position", [&st] { return static_cast<std::int64_t>(st.position); },
       [&st](std::int64_t v) { st.position = static_cast<std::uint64_t>(v); }});
  const std::uint64_t data_seed = rng::mix64(tc.seed ^ 0x64617461ull);  // "data"
  if (cfg.synthetic_vocab == 0) {
    st.train = open_split(cfg.train_files, cfg.format, T, "data.train_files");
    st.order = std::make_unique<SampleOrder>(st.train->windows(), data_seed, cfg.shuffle);
    auto& ts = w.resource<train::TrainState>();
    ts.loss_mask = st.train->masked();
    ts.documents = st.train->masked() && cfg.attend_within_documents;
  }

  w.systems().add({"data.load_validation", Phase::setup, [cfg, T](World& world) {
                     if (cfg.val_files.empty() || cfg.val_batches == 0) return;
                     auto index = open_split(cfg.val_files, cfg.format, T, "data.val_files");
                     const auto& ts = world.resource<train::TrainState>();
                     const auto& par = world.resource<parallel::ParallelState>();
                     auto& val = world.resource<train::ValidationSet>();
                     // Each DP rank evaluates its own val_batches micro-batches, in file order.
                     const int mbs = ts.micro_batch_size;
                     const std::uint64_t per_rank = static_cast<std::uint64_t>(cfg.val_batches) * mbs;
                     const std::uint64_t base = per_rank * par.dp_rank();
                     // Validation shards mark documents as the training ones do (kiln tokenize writes both).
                     const bool documents = index->masked() && cfg.attend_within_documents;
                     for (int b = 0; b < cfg.val_batches; ++b) {
                       train::Batch batch;
                       size_batch(batch, mbs, T, documents);
                       for (int i = 0; i < mbs; ++i) read_window(*index, (base + b * mbs + i) % index->windows(), batch, i);
                       val.batches.push_back(std::move(batch));
                     }
                   }});

  // This rank's micro-batch starting at global sample `first` of the step's global batch at
  // `position`.
  auto make = [cfg, T, data_seed](World& world, std::uint64_t position, std::uint64_t first, train::Batch& batch) {
    auto& st = world.resource<DataState>();
    const auto& ts = world.resource<train::TrainState>();
    const int count = ts.micro_batch_size;
    if (cfg.synthetic_vocab > 0)
      fill_synthetic(batch, data_seed, first, count, T, cfg.synthetic_vocab);
    else
      fill(batch, st, first, count, T, ts.documents);
    batch.step_targets = step_targets(world, position);
  };
  // The step's global batch is samples [position, position + batch_size); DP rank d takes the d-th
  // slice of it, one micro-batch at a time.
  auto first_of = [](World& world, std::uint64_t position, int micro_batch) {
    const auto& ts = world.resource<train::TrainState>();
    const auto& par = world.resource<parallel::ParallelState>();
    const auto& tc = world.resource<train::TrainConfig>();
    const std::uint64_t per_rank = static_cast<std::uint64_t>(tc.batch_size / par.dp_size());
    return position + per_rank * par.dp_rank() + static_cast<std::uint64_t>(micro_batch) * ts.micro_batch_size;
  };
  w.systems().add({"data.next_batch", Phase::data, [make, first_of](World& world) {
                     auto& st = world.resource<DataState>();
                     const std::uint64_t first = first_of(world, st.position, world.resource<RunControl>().micro_batch);
                     auto& batch = world.resource<train::Batch>();
                     if (st.prefetched_first == first)
                       std::swap(batch, st.prefetched);
                     else
                       make(world, st.position, first, batch);
                     st.prefetched_first.reset();
                     batch.global_index = static_cast<std::int64_t>(first - st.position);
                   }});
  // The next step's first micro-batch, made on the host while the device runs the end of this step
  // (its optimizer: instead of after the step's end, with the device idle: ~0.35 ms of GPT-2 124M's
  // step for synthetic tokens): first at the step's end, before anything there waits for the device.
  w.systems().add({"data.prefetch", Phase::step_end,
                   [make, first_of](World& world) {
                     auto& st = world.resource<DataState>();
                     const auto next = st.position + static_cast<std::uint64_t>(world.resource<train::TrainConfig>().batch_size);
                     const std::uint64_t first = first_of(world, next, 0);
                     make(world, next, first, st.prefetched);
                     st.prefetched_first = first;
                   },
                   {},
                   {kAllSystems}});

  w.systems().add({"data.advance", Phase::step_end, [](World& world) {
                     world.resource<DataState>().position +=
                         static_cast<std::uint64_t>(world.resource<train::TrainConfig>().batch_size);
                   }});
}

}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<DataConfig>("data", "token shards: seeded training windows and a fixed validation set",
                                       {"train", "parallel"}, install));
}

}  // namespace kiln::data
