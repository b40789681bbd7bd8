// GptModel: the stack of parts, its activation table, the forward and backward passes in order.
#include "kiln/model/gpt.hpp"

#include <algorithm>

#include "kiln/engine/engine_module.hpp"
#include "kiln/model/spec.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"

namespace kiln::model {

namespace {

// The context every part shares; creates the ParamStore the parts register their parameters in.
ModelContext make_context(World& world, const ModelConfig& cfg, int B, int T) {
  KILN_CHECK(T <= cfg.max_seq_len, "train.seq_len ", T, " exceeds model.max_seq_len ", cfg.max_seq_len);
  auto& be = world.resource<ops::ActiveBackend>().get();
  ModelContext ctx(world, cfg, be, parallel::tensor_parallel(world, be), B, T,
                   world.resource<train::TrainConfig>().batch_size);
  for (const auto& d : tensor_parallel_splits(cfg, ctx.N, ctx.tp.sequence_parallel(), ctx.tp.vocab_parallel()))
    ctx.tp.require(d);
  world.emplace_resource<nn::ParamStore>();
  return ctx;
}

std::vector<std::unique_ptr<TransformerBlock>> make_blocks(ModelContext& ctx, const ModelSpec& spec) {
  std::vector<std::unique_ptr<TransformerBlock>> blocks;
  for (int l = 0; l < ctx.cfg.n_layer; ++l) {
    const std::string name = "blocks." + std::to_string(l);
    blocks.push_back(std::make_unique<TransformerBlock>(LayerBuilder(ctx, l + 1, nn::LayerKind::block, l, name), l, spec));
  }
  return blocks;
}

LayerBuilder head_layer(ModelContext& ctx, const ModelSpec& spec) {
  return LayerBuilder(ctx, ctx.cfg.n_layer + 1, nn::LayerKind::final_norm, -1, std::string(spec.norm_stem()) + "f");
}

}  // namespace

// The parameters are made in the order of the stack (the initialisation draws follow it): the
// embeddings, each block, the final norm and the head.
GptModel::GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches)
    : ctx_(make_context(world, cfg, B, T)),
      dp_(parallel::data_parallel(world)),
      slots_(micro_batches),
      embedding_(LayerBuilder(ctx_, 0, nn::LayerKind::embedding, -1, "embeddings"),
                 model_spec(cfg).positions == Positions::learned),
      blocks_(make_blocks(ctx_, model_spec(cfg))),
      head_(head_layer(ctx_, model_spec(cfg)), model_spec(cfg),
            model_spec(cfg).tie_embeddings ? std::optional<Entity>(embedding_.token_table()) : std::nullopt) {}

void GptModel::allocate_activations() {
  KILN_CHECK(!allocated_, "the model's activations are allocated once");
  const DType act = ctx_.act();
  const std::int64_t N = ctx_.N, Nl = ctx_.Nl, C = ctx_.cfg.n_embd;
  const bool sp = ctx_.tp.sequence_parallel();
  auto rows = table_.model();
  rows.own(tokens_, DType::i32, {N});
  rows.own(targets_, DType::i32, {N});
  rows.own(doc_start_, DType::i32, {ctx_.B, ctx_.T});  // packed documents' starts, when a batch has them
  rows.own(losses_, DType::f32, {static_cast<std::int64_t>(slots_), N});
  std::int64_t stats = 0;
  for (auto& block : blocks_)
    for (auto& [name, mixer] : block->mixers()) stats += mixer->device_stats();
  if (stats > 0) rows.own(part_stats_, DType::f32, {stats});
  for (auto& block : blocks_) block->declare(table_);
  // The residual streams; the whole input of a block that keeps only its rows' part of it lives in
  // one of two tensors taken in turn (needed from its forward to the next block's, and again after
  // its recompute gathered it).
  residuals_.resize(blocks_.size() + 1);
  for (std::size_t l = 0; l < residuals_.size(); ++l) {
    if (l < blocks_.size() && blocks_[l]->distributes_input())
      rows.scratch(residuals_[l], cat("block.input.", l % 2), act, {N, C});
    else
      rows.own(residuals_[l], act, {Nl, C});
  }
  head_.declare(table_);
  StreamTensors& s = ctx_.stream;
  rows.own(s.row_out, act, {N, C});
  rows.own(s.dres, act, {Nl, C});
  if (sp) {
    rows.own(s.local, act, {Nl, C});
    rows.own(s.full, act, {N, C});
  }
  rows.own(s.col_dx, act, {N, C});  // also the LM head's input gradient: not in the logits
  if (ctx_.cfg.dropout > 0) rows.backward_scratch(s.ddrop, "dropout.dx", act, {Nl, C});
  table_.allocate(ctx_.be);
  std::int64_t at = 0;
  for (auto& block : blocks_)
    for (auto& [name, mixer] : block->mixers()) {
      const std::int64_t n = mixer->device_stats();
      if (n > 0) mixer->bind_device_stats(part_stats_.rows(at, n));
      at += n;
    }
  if (!sp) s.local = s.full = s.row_out;  // without sequence parallelism local rows are all rows
  // The blocks' backward scratch at the end of the logits, beside what the blocks' linears may borrow.
  std::size_t borrow = 0;
  for (const auto& block : blocks_) borrow = std::max(borrow, block->scratch_bytes());
  lent_ = table_.place_backward_scratch(ctx_.be, head_.logits(), borrow);
  allocated_ = true;
}

void GptModel::load(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker) {
  KILN_CHECK(batch.B == ctx_.B && batch.T == ctx_.T, "batch of ", batch.B, "x", batch.T,
             " but the model was built for ", ctx_.B, "x", ctx_.T);
  KILN_CHECK(allocated_, "forward before allocate_activations()");
  KILN_CHECK(slot >= 0 && slot < slots_, "loss slot ", slot, " of ", slots_);
  const std::int64_t N = ctx_.N;
  const int V = ctx_.cfg.vocab_size;
  for (std::int64_t n = 0; n < N; ++n) {
    if (batch.inputs[n] < 0 || batch.inputs[n] >= V)
      KILN_THROW("input token ", batch.inputs[n], " at position ", n, " is outside model.vocab_size = ", V);
    if (batch.targets[n] < -1 || batch.targets[n] >= V)
      KILN_THROW("target token ", batch.targets[n], " at position ", n, " is outside model.vocab_size = ", V);
  }
  ctx_.be.copy(tokens_, TensorView(const_cast<std::int32_t*>(batch.inputs.data()), {N}, DType::i32, Device::cpu));
  ctx_.be.copy(targets_, TensorView(const_cast<std::int32_t*>(batch.targets.data()), {N}, DType::i32, Device::cpu));
  ctx_.doc_start = {};
  if (!batch.doc_start.empty()) {
    KILN_CHECK(static_cast<std::int64_t>(batch.doc_start.size()) == N, "batch of ", N, " tokens with ",
               batch.doc_start.size(), " document starts");
    ctx_.be.copy(doc_start_, TensorView(const_cast<std::int32_t*>(batch.doc_start.data()), doc_start_.shape,
                                        DType::i32, Device::cpu));
    ctx_.doc_start = doc_start_;
  }
  ctx_.seq_offset = batch.global_index;
  if (training && batch.step_targets > 0) {
    // The mean over the step's trained targets; a global batch with none trains nothing (loss 0).
    step_targets_ = batch.step_targets;
    dloss_ = 1.0f / static_cast<float>(step_targets_);
  } else if (training && step_targets_ > 0) {
    KILN_THROW("a training batch without step_targets after one with them (loss masks on some steps only)");
  }
  if (training && tracker) {  // every micro-batch of the step draws from the same states
    if (slot == 0)
      step_rng_ = tracker->get_states();
    else
      tracker->set_states(step_rng_);
  }
}

void GptModel::forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker) {
  load(batch, slot, training, tracker);
  forward_loaded(slot, training, tracker);
}

void GptModel::forward_loaded(int slot, bool training, rng::RngStatesTracker* tracker) {
  KILN_CHECK(allocated_, "forward before allocate_activations()");
  KILN_CHECK(slot >= 0 && slot < slots_, "loss slot ", slot, " of ", slots_);
  const float p = training ? ctx_.cfg.dropout : 0.0f;
  ctx_.training = training;
  auto& bus = ctx_.world.events();
  bus.publish(nn::LayerForwardBegin{0});
  embedding_.forward(tokens_, residuals_.front());
  bus.publish(nn::LayerForwardEnd{0});
  for (std::size_t l = 0; l < blocks_.size(); ++l) {
    TransformerBlock& block = *blocks_[l];
    bus.publish(nn::LayerForwardBegin{block.unit()});
    block.forward(residuals_[l], residuals_[l + 1], p, tracker, training);
    bus.publish(nn::LayerForwardEnd{block.unit()});
  }
  const int head_unit = static_cast<int>(blocks_.size()) + 1;
  bus.publish(nn::LayerForwardBegin{head_unit});
  head_.forward(residuals_.back(), losses_.rows(slot, 1).reshape({ctx_.N}), targets_, dloss_);
  bus.publish(nn::LayerForwardEnd{head_unit});
  have_forward_ = training;
}

void GptModel::backward(const train::Batch& batch) {
  KILN_CHECK(have_forward_, "backward without a training forward");
  have_forward_ = false;
  auto& bus = ctx_.world.events();
  // The residual stream's gradient (ctx_.stream.dres) holds this rank's rows: all of them without
  // sequence parallelism.
  const int head_unit = static_cast<int>(blocks_.size()) + 1;
  bus.publish(nn::LayerBackwardBegin{head_unit});
  head_.backward(residuals_.back());
  bus.publish(nn::LayerBackwardEnd{head_unit});
  for (std::size_t l = blocks_.size(); l-- > 0;) {
    TransformerBlock& block = *blocks_[l];
    bus.publish(nn::LayerBackwardBegin{block.unit()});
    block.backward(residuals_[l]);
    bus.publish(nn::LayerBackwardEnd{block.unit()});
  }
  bus.publish(nn::LayerBackwardBegin{0});
  embedding_.backward(tokens_, batch.inputs.data(), ctx_.stream.dres);
  bus.publish(nn::LayerBackwardEnd{0});
}

void GptModel::initialise(rng::RngStatesTracker& tracker) {
  auto& store = ctx_.world.resource<nn::ParamStore>();
  const TensorView master = store.master_flat();
  for (Entity e : store.order()) {
    const auto& p = ctx_.world.get<nn::Param>(e);
    // One draw of the whole logical tensor from the default state, on every rank: element i of the
    // logical tensor is Philox element i of the draw, whatever part of it this rank holds (its
    // tensor-parallel shard, and of that its part of the unit under FSDP).
    const rng::PhiloxArgs r =
        p.init_std > 0 ? tracker.draw(static_cast<std::uint64_t>(p.global_shape.numel())) : rng::PhiloxArgs{};
    store.for_each_held(p, [&](const nn::HeldPart& part) {
      const TensorView held = nn::ParamStore::held_view(master, part);
      if (p.init_std == 0) {
        ctx_.be.fill(held, p.init_value);
        return;
      }
      p.shard.for_each_block(p.global_shape, part.first, part.first + part.count, [&](const TensorShard::Block& b) {
        ctx_.be.init_normal(held.flat_slice(b.local - part.first, b.count), p.init_std, r, b.global);
      });
    });
  }
  if (store.holds_act_copy()) ctx_.be.convert(store.compute_flat(), store.master_flat());
}

std::int64_t GptModel::parameter_count() const {
  std::int64_t n = 0;
  for (Entity e : ctx_.world.resource<nn::ParamStore>().order())
    n += ctx_.world.get<nn::Param>(e).global_shape.numel();
  return n;
}

double GptModel::loss_sum(int slots) {
  KILN_CHECK(slots > 0 && slots <= slots_, "mean over ", slots, " loss slots of ", slots_);
  const std::int64_t n = slots * ctx_.N;
  std::vector<float> host(static_cast<std::size_t>(n));
  ctx_.be.copy(TensorView(host.data(), {n}, DType::f32, Device::cpu), losses_.rows(0, slots).reshape({n}));
  ctx_.be.synchronize();
  double sum = 0;
  for (float v : host) sum += v;
  return sum;
}

double GptModel::mean_loss(int slots) {
  const double sum = loss_sum(slots);
  // Every DP rank saw its slice of the batch: its rows, or its share of the trained targets (masked
  // rows hold 0), so the mean over the replicas is the mean over the global batch's targets.
  const double per_rank = step_targets_ > 0 ? static_cast<double>(step_targets_) / dp_.size()
                                            : static_cast<double>(slots * ctx_.N);
  return dp_.mean(sum / per_rank);
}

double GptModel::evaluate(const std::vector<train::Batch>& batches) {
  KILN_CHECK(!batches.empty(), "no validation batches");
  std::int64_t targets = 0, rows = 0;
  for (auto& b : batches) {
    rows += static_cast<std::int64_t>(b.targets.size());
    targets += std::count_if(b.targets.begin(), b.targets.end(), [](std::int32_t t) { return t >= 0; });
  }
  double total = 0;
  if (dp_.mean(static_cast<double>(rows - targets)) == 0) {  // no masked target on any rank
    for (auto& b : batches) {
      forward(b, 0, false, nullptr);
      total += dp_.mean(loss_sum(1) / static_cast<double>(ctx_.N));
    }
    return total / static_cast<double>(batches.size());
  }
  for (auto& b : batches) {
    forward(b, 0, false, nullptr);
    total += loss_sum(1);
  }
  // The sum over every rank's batches over the count of their targets.
  const double all = dp_.mean(static_cast<double>(targets)) * dp_.size();
  return all > 0 ? dp_.mean(total) * dp_.size() / all : 0.0;
}

std::vector<std::pair<std::string, double>> GptModel::step_metrics() {
  // Every part's device numbers in one read.
  std::vector<float> device(static_cast<std::size_t>(part_stats_ ? part_stats_.numel() : 0));
  if (!device.empty())
    ctx_.be.copy(TensorView(device.data(), {part_stats_.numel()}, DType::f32, Device::cpu), part_stats_);
  std::vector<float> sums;
  std::size_t read = 0;
  for (auto& block : blocks_)
    for (auto& [name, mixer] : block->mixers()) {
      const auto n = static_cast<std::size_t>(mixer->device_stats());
      mixer->collect_stats(std::span<const float>(device).subspan(read, n), sums);
      read += n;
    }
  std::vector<std::pair<std::string, double>> out;
  if (sums.empty()) return out;
  dp_.sum(sums);
  std::size_t at = 0;
  for (auto& block : blocks_)
    for (auto& [name, mixer] : block->mixers()) at = mixer->end_step(sums, at, name, out);
  return out;
}

std::vector<float> GptModel::part_state() const {
  std::vector<float> all;
  for (const auto& block : blocks_)
    for (const auto& [name, mixer] : block->mixers()) {
      const std::vector<float> s = mixer->state();
      all.insert(all.end(), s.begin(), s.end());
    }
  return all;
}

void GptModel::set_part_state(std::span<const float> values) {
  std::size_t at = 0;
  for (auto& block : blocks_)
    for (auto& [name, mixer] : block->mixers()) {
      const std::size_t n = mixer->state().size();
      KILN_CHECK(at + n <= values.size(), "the model's saved part state holds ", values.size(), " values, fewer than ",
                 name, " needs");
      mixer->set_state(values.subspan(at, n));
      at += n;
    }
  KILN_CHECK(at == values.size(), "the model's saved part state holds ", values.size(), " values, this model ", at);
}

std::int64_t GptModel::active_parameter_count() const {
  std::int64_t n = parameter_count();
  for (const auto& block : blocks_)
    for (const auto& [name, mixer] : block->mixers()) n -= mixer->inactive_parameters();
  return n;
}

double GptModel::flops_per_token() const {
  double flops = head_.flops_per_token();
  for (const auto& block : blocks_) flops += block->flops_per_token();
  return flops;
}

}  // namespace kiln::model
