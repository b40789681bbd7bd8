// GptModel: the stack of parts, its activation table, the forward and backward passes in order.
#include "kiln/model/gpt.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

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

// This rank's blocks (the others null), each registering its parameters in the order of the stack.
std::vector<std::unique_ptr<TransformerBlock>> make_blocks(ModelContext& ctx, const ModelSpec& spec,
                                                           const PipelinePlan& plan) {
  std::vector<std::unique_ptr<TransformerBlock>> blocks(static_cast<std::size_t>(ctx.cfg.n_layer));
  for (int c = 0; c < plan.chunks(); ++c)
    for (int l = plan.begin(c); l < plan.end(c); ++l) {
      const std::string name = "blocks." + std::to_string(l);
      blocks[static_cast<std::size_t>(l)] =
          std::make_unique<TransformerBlock>(LayerBuilder(ctx, l + 1, nn::LayerKind::block, l, name), l, spec);
    }
  return blocks;
}

LayerBuilder head_layer(ModelContext& ctx, const ModelSpec& spec) {
  return LayerBuilder(ctx, ctx.cfg.n_layer + 1, nn::LayerKind::final_norm, -1, std::string(spec.norm_stem()) + "f");
}

std::optional<parallel::PipelineParallel> pipeline_group(World& world, const PipelinePlan& plan) {
  if (!plan.pipelined()) return std::nullopt;
  return parallel::pipeline_parallel(world);
}

}  // namespace

GptModel::GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches)
    : GptModel(world, cfg, B, T, micro_batches, PipelinePlan::single(cfg.n_layer, micro_batches)) {}

// The parameters are made in the order of the stack (the initialisation draws follow it): the
// embeddings, each block, the final norm and the head.
GptModel::GptModel(World& world, const ModelConfig& cfg, int B, int T, int micro_batches, PipelinePlan plan)
    : ctx_(make_context(world, cfg, B, T)),
      plan_(std::move(plan)),
      pipe_(pipeline_group(world, plan_)),
      dp_(parallel::data_parallel(world)),
      slots_(micro_batches) {
  const ModelSpec spec = model_spec(cfg);
  KILN_CHECK(plan_.starts.size() == static_cast<std::size_t>(plan_.virtual_stages()) + 1 &&
                 plan_.starts.back() == cfg.n_layer,
             "a pipeline plan of ", plan_.starts.size() - 1, " chunks ending at block ", plan_.starts.back(), " for ",
             cfg.n_layer, " blocks");
  if (pipe_)
    stage_.emplace(
        plan_, *pipe_, [this](const parallel::PipelineMessage& msg, bool send) { return transfer_buffer(msg, send); },
        ctx_.be.stream());
  if (plan_.holds_embedding())
    embedding_ = std::make_unique<Embedding>(LayerBuilder(ctx_, 0, nn::LayerKind::embedding, -1, "embeddings"),
                                             spec.positions == Positions::learned);
  blocks_ = make_blocks(ctx_, spec, plan_);
  if (plan_.holds_head()) {
    LayerBuilder b = head_layer(ctx_, spec);
    std::optional<Entity> tied;
    if (spec.tie_embeddings) tied = embedding_ ? embedding_->token_table() : Embedding::table_copy(b);
    head_ = spec.make_head(b, tied);
    if (tied && !embedding_) tied_ = tied;
  }
  if (spec.tie_embeddings && plan_.pipelined() && embedding_) tied_ = embedding_->token_table();
  // A table tied over two stages: the first stage's is the original, the last's its copy.
  if (tied_)
    ctx_.world.emplace<nn::TiedAcrossStages>(*tied_, nn::TiedAcrossStages{embedding_ ? plan_.shape.pp - 1 : 0, !embedding_});
  learn_part_state_layout();
}

void GptModel::allocate_activations() {
  KILN_CHECK(!allocated_, "the model's activations are allocated once");
  const DType act = ctx_.act();
  const std::int64_t N = ctx_.N, Nl = ctx_.Nl, C = ctx_.cfg.n_embd;
  const bool sp = ctx_.tp.sequence_parallel();
  const int I = plan_.pipelined() ? slots_ : 1;  // the micro-batches whose inputs are kept
  auto rows = table_.model();
  rows.own(tokens_all_, DType::i32, {I, N});
  rows.own(targets_all_, DType::i32, {I, N});
  rows.own(doc_all_, DType::i32, {I, ctx_.B, ctx_.T});  // packed documents' starts, when a batch has them
  rows.own(losses_, DType::f32, {static_cast<std::int64_t>(slots_), N});
  inputs_.assign(static_cast<std::size_t>(I), Inputs{});
  std::int64_t stats = 0;
  for (auto& block : blocks_)
    if (block)
      for (auto& [name, mixer] : block->mixers()) stats += mixer->device_stats();
  if (stats > 0) rows.own(part_stats_, DType::f32, {stats});
  for (auto& block : blocks_)
    if (block) block->declare(table_);
  // The residual streams of this rank's chunks; the whole input of a block that keeps only its rows'
  // part of it lives in one of two tensors taken in turn (needed from its forward to the next
  // block's, and again after its recompute gathered it).
  residuals_.assign(blocks_.size() + 1, TensorView{});
  for (int c = 0; c < plan_.chunks(); ++c)
    for (int l = plan_.begin(c); l <= plan_.end(c); ++l) {
      const auto i = static_cast<std::size_t>(l);
      if (l < plan_.end(c) && blocks_[i]->distributes_input())
        rows.scratch(residuals_[i], cat("block.input.", l % 2), act, {N, C});
      else
        rows.kept(residuals_[i], act, {Nl, C});
    }
  StreamTensors& s = ctx_.stream;
  rows.own(s.row_out, act, {N, C});
  // Under sequence parallelism the output gradient a mixer is given (dropout's, else the residual
  // stream's) is this rank's rows of `full`, into which a row-parallel backward gathers every
  // rank's: the gather moves the other ranks' rows only, no copy of this rank's first. (Nothing
  // else writes `full` while a backward pass holds it: the embedding's forward fills it.)
  const bool dropout = ctx_.cfg.dropout > 0;
  if (!sp || dropout) rows.own(s.dres, act, {Nl, C});
  if (sp) {
    rows.own(s.local, act, {Nl, C});
    rows.own(s.full, act, {N, C});
  }
  rows.own(s.col_dx, act, {N, C});  // also the LM head's input gradient: not in the logits
  if (dropout && !sp) rows.backward_scratch(s.ddrop, "dropout.dx", act, {Nl, C});
  if (plan_.pipelined()) {
    rows.own(grad_in_, act, {Nl, C});
    rows.own(grad_out_, act, {Nl, C});
  }
  // The blocks' backward scratch at the end of the logits, beside what the blocks' linears may
  // borrow (the head makes its logits' memory large enough for both, which a head of a few rows'
  // chunks needs); without the head, in memory of its own.
  std::size_t borrow = 0;
  for (const auto& block : blocks_)
    if (block) borrow = std::max(borrow, block->scratch_bytes());
  if (head_) head_->declare(table_, borrow + table_.backward_scratch_bytes());
  if (!head_) rows.own(lent_host_, DType::u8, {static_cast<std::int64_t>(std::max<std::size_t>(borrow, 1))});
  table_.allocate(ctx_.be, plan_.copies);
  for (auto& block : blocks_)
    if (block) block->placed(table_);
  std::int64_t at = 0;
  for (auto& block : blocks_)
    if (block)
      for (auto& [name, mixer] : block->mixers()) {
        const std::int64_t n = mixer->device_stats();
        if (n > 0) mixer->bind_device_stats(part_stats_.rows(at, n));
        at += n;
      }
  if (!sp) s.local = s.full = s.row_out;  // without sequence parallelism local rows are all rows
  if (sp) (dropout ? s.ddrop : s.dres) = ctx_.tp.row_part(s.full);
  lent_ = table_.place_backward_scratch(ctx_.be, head_ ? head_->logits() : lent_host_, borrow);
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
  const int i = inputs_index(slot);
  Inputs& in = inputs_[static_cast<std::size_t>(i)];
  auto host = [](const std::vector<std::int32_t>& v, const Shape& shape) {
    return TensorView(const_cast<std::int32_t*>(v.data()), shape, DType::i32, Device::cpu);
  };
  ctx_.be.copy(tokens_all_.rows(i, 1).reshape({N}), host(batch.inputs, {N}));
  ctx_.be.copy(targets_all_.rows(i, 1).reshape({N}), host(batch.targets, {N}));
  in.tokens = batch.inputs;
  in.seq_offset = batch.global_index;
  in.documents = !batch.doc_start.empty();
  if (in.documents) {
    KILN_CHECK(static_cast<std::int64_t>(batch.doc_start.size()) == N, "batch of ", N, " tokens with ",
               batch.doc_start.size(), " document starts");
    ctx_.be.copy(doc_all_.rows(i, 1).reshape({ctx_.B, ctx_.T}), host(batch.doc_start, {ctx_.B, ctx_.T}));
  }
  use(slot);
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

void GptModel::use(int m) {
  const Inputs& in = inputs_[static_cast<std::size_t>(inputs_index(m))];
  ctx_.seq_offset = in.seq_offset;
  ctx_.doc_start = in.documents ? doc_all_.rows(inputs_index(m), 1).reshape({ctx_.B, ctx_.T}) : TensorView{};
  table_.select_copy(plan_.copy_of(m));
  ctx_.copy = plan_.copy_of(m);
}

rng::RngSnapshot GptModel::states_before_block(int l) const {
  rng::RngSnapshot s = step_rng_;
  for (int b = 0; b < l && b < static_cast<int>(block_draws_.size()); ++b) {
    const auto& d = block_draws_[static_cast<std::size_t>(b)];
    s.default_state.offset += d[0];
    for (std::size_t k = 0; k < s.states.size(); ++k) s.states[k].second.offset += d[k + 1];
  }
  return s;
}

void GptModel::forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker) {
  load(batch, slot, training, tracker);
  forward_loaded(slot, training, tracker);
}

void GptModel::forward_loaded(int slot, bool training, rng::RngStatesTracker* tracker) {
  KILN_CHECK(!plan_.pipelined(), "a pipeline stage runs the model a chunk a pass (forward_pass)");
  KILN_CHECK(allocated_, "forward before allocate_activations()");
  KILN_CHECK(slot >= 0 && slot < slots_, "loss slot ", slot, " of ", slots_);
  forward_chunk(0, slot, training, tracker);
  have_forward_ = training;
}

void GptModel::forward_chunk(int chunk, int m, bool training, rng::RngStatesTracker* tracker) {
  use(m);
  const float p = training ? ctx_.cfg.dropout : 0.0f;
  ctx_.training = training;
  auto& bus = ctx_.world.events();
  const int begin = plan_.begin(chunk), end = plan_.end(chunk);
  if (plan_.first(chunk)) {
    bus.publish(nn::LayerForwardBegin{0, training});
    embedding_->forward(tokens_all_.rows(inputs_index(m), 1).reshape({ctx_.N}),
                        residuals_[static_cast<std::size_t>(begin)]);
    bus.publish(nn::LayerForwardEnd{0, training});
  }
  // The blocks draw where one rank's blocks before them would have left the states.
  const bool draws = training && tracker;
  if (draws && plan_.pipelined()) tracker->set_states(states_before_block(begin));
  for (int l = begin; l < end; ++l) {
    TransformerBlock& block = *blocks_[static_cast<std::size_t>(l)];
    bus.publish(nn::LayerForwardBegin{block.unit(), training});
    block.forward(residuals_[static_cast<std::size_t>(l)], residuals_[static_cast<std::size_t>(l) + 1], p, tracker,
                  training);
    bus.publish(nn::LayerForwardEnd{block.unit(), training});
  }
  if (draws && plan_.pipelined()) tracker->set_states(states_before_block(ctx_.cfg.n_layer));
  if (plan_.last(chunk)) {
    const int head_unit = ctx_.cfg.n_layer + 1;
    bus.publish(nn::LayerForwardBegin{head_unit, training});
    head_->forward(residuals_[static_cast<std::size_t>(end)], losses_.rows(m, 1).reshape({ctx_.N}),
                   targets_all_.rows(inputs_index(m), 1).reshape({ctx_.N}), dloss_);
    bus.publish(nn::LayerForwardEnd{head_unit, training});
    head_forward_ = m;
  }
}

void GptModel::backward(const train::Batch&) {
  KILN_CHECK(!plan_.pipelined(), "a pipeline stage runs the model a chunk a pass (backward_pass)");
  KILN_CHECK(have_forward_, "backward without a training forward");
  have_forward_ = false;
  backward_chunk(0, head_forward_);
}

void GptModel::backward_chunk(int chunk, int m) {
  use(m);
  auto& bus = ctx_.world.events();
  const int begin = plan_.begin(chunk), end = plan_.end(chunk);
  // The residual stream's gradient (ctx_.stream.dres) holds this rank's rows: all of them without
  // sequence parallelism.
  if (plan_.last(chunk)) {
    KILN_CHECK(head_forward_ == m, "the head holds micro-batch ", head_forward_, "'s gradients, not ", m,
               "'s (a schedule must run the last stage's backward right after its forward)");
    const int head_unit = ctx_.cfg.n_layer + 1;
    bus.publish(nn::LayerBackwardBegin{head_unit});
    head_->backward(residuals_[static_cast<std::size_t>(end)]);
    bus.publish(nn::LayerBackwardEnd{head_unit});
  } else {
    ctx_.be.copy(ctx_.stream.dres, grad_in_);  // received from the next stage
  }
  for (int l = end; l-- > begin;) {
    TransformerBlock& block = *blocks_[static_cast<std::size_t>(l)];
    bus.publish(nn::LayerBackwardBegin{block.unit()});
    block.backward(residuals_[static_cast<std::size_t>(l)]);
    bus.publish(nn::LayerBackwardEnd{block.unit()});
  }
  if (plan_.first(chunk)) {
    bus.publish(nn::LayerBackwardBegin{0});
    embedding_->backward(tokens_all_.rows(inputs_index(m), 1).reshape({ctx_.N}),
                         inputs_[static_cast<std::size_t>(inputs_index(m))].tokens.data(), ctx_.stream.dres);
    bus.publish(nn::LayerBackwardEnd{0});
  } else {
    stage_->gradient_buffer_free();  // the previous gradient sent from grad_out_ has left
    ctx_.be.copy(grad_out_, ctx_.stream.dres);  // for the previous stage
  }
}

TensorView GptModel::transfer_buffer(const parallel::PipelineMessage& msg, bool send) {
  if (!msg.activation) return send ? grad_out_ : grad_in_;
  // An activation leaves a chunk's last block, or enters another's first, in its micro-batch's copy.
  const int chunk = (send ? msg.from : msg.to()) / plan_.shape.pp;
  table_.select_copy(plan_.copy_of(msg.micro_batch));
  return residuals_[static_cast<std::size_t>(send ? plan_.end(chunk) : plan_.begin(chunk))];
}

void GptModel::forward_pass(int m, int chunk, rng::RngStatesTracker* tracker) {
  if (stage_) stage_->begin(true, m, chunk);
  const double start = pass_clock();
  if (plan_.pipelined())
    forward_chunk(chunk, m, true, tracker);
  else
    forward_loaded(m, true, tracker);
  record_pass(true, m, chunk, start);
  if (stage_) stage_->end();
}

void GptModel::backward_pass(int m, int chunk) {
  if (stage_) stage_->begin(false, m, chunk);
  const double start = pass_clock();
  if (plan_.pipelined()) {
    backward_chunk(chunk, m);
  } else {
    KILN_CHECK(have_forward_, "backward without a training forward");
    have_forward_ = false;
    backward_chunk(0, m);
  }
  record_pass(false, m, chunk, start);
  if (stage_) stage_->end();
}

// With log.timeline, a timed step's passes: the device synchronised when a pass's inputs have
// arrived and at its end (steady-clock seconds; -1: not timed).
double GptModel::pass_clock() {
  const auto* tl = ctx_.world.try_resource<train::PassTimeline>();
  if (!tl || !tl->record) return -1;
  ctx_.be.synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void GptModel::record_pass(bool forward, int m, int chunk, double start) {
  if (start < 0) return;
  const double end = pass_clock();
  ctx_.world.resource<train::PassTimeline>().passes.push_back({forward, m, chunk, start, end});
}

void GptModel::learn_dropout_draws(rng::RngStatesTracker& tracker) {
  // Each block's draws in a training forward, from each state: this rank measures its own blocks
  // (drawing and putting the states back), the stages share what they measured.
  const int K = tracker.num_states(), L = ctx_.cfg.n_layer;
  std::vector<std::int64_t> mine(static_cast<std::size_t>(L * K), 0);
  const rng::RngSnapshot start = tracker.get_states();
  const bool was_training = ctx_.training;
  ctx_.training = true;  // as in a training forward (a mixture of experts draws its expert dropout then)
  for (int l = 0; l < L; ++l) {
    if (!blocks_[static_cast<std::size_t>(l)]) continue;
    blocks_[static_cast<std::size_t>(l)]->draw(&tracker, ctx_.cfg.dropout);
    const rng::RngSnapshot after = tracker.get_states();
    mine[static_cast<std::size_t>(l * K)] = static_cast<std::int64_t>(after.default_state.offset - start.default_state.offset);
    for (int k = 1; k < K; ++k)
      mine[static_cast<std::size_t>(l * K + k)] =
          static_cast<std::int64_t>(after.states[static_cast<std::size_t>(k - 1)].second.offset -
                                    start.states[static_cast<std::size_t>(k - 1)].second.offset);
    tracker.set_states(start);
  }
  ctx_.training = was_training;
  std::vector<std::int64_t> all = mine;
  if (pipe_)
    for (const auto& theirs : pipe_->gather(mine))
      for (std::size_t i = 0; i < all.size(); ++i) all[i] = std::max(all[i], theirs[i]);
  block_draws_.assign(static_cast<std::size_t>(L), std::vector<std::uint64_t>(static_cast<std::size_t>(K)));
  for (int l = 0; l < L; ++l)
    for (int k = 0; k < K; ++k)
      block_draws_[static_cast<std::size_t>(l)][static_cast<std::size_t>(k)] =
          static_cast<std::uint64_t>(all[static_cast<std::size_t>(l * K + k)]);
}

void GptModel::initialise(rng::RngStatesTracker& tracker) {
  auto& store = ctx_.world.resource<nn::ParamStore>();
  const TensorView master = store.master_flat();
  // Where each unit's draws start: after every earlier unit's, as one rank making the whole model
  // draws them (a stage learns the other stages' counts). A parameter draws its logical tensor,
  // ceil(numel / 4) Philox blocks; the last stage's copy of the tied table draws where the table
  // does (it is the embedding's first parameter: unit 0's first draw).
  const int units = ctx_.cfg.n_layer + 2;
  auto blocks_of = [](const nn::Param& p) { return (static_cast<std::uint64_t>(p.global_shape.numel()) + 3) / 4; };
  auto is_copy = [this](Entity e) {
    const auto* t = ctx_.world.try_get<nn::TiedAcrossStages>(e);
    return t && t->copy;
  };
  std::vector<std::int64_t> mine(static_cast<std::size_t>(units), 0);
  for (Entity e : store.order()) {
    const auto& p = ctx_.world.get<nn::Param>(e);
    if (p.init_std > 0 && !is_copy(e)) mine[static_cast<std::size_t>(p.unit)] += static_cast<std::int64_t>(blocks_of(p));
  }
  std::vector<std::int64_t> per_unit = mine;
  if (pipe_)
    for (const auto& theirs : pipe_->gather(mine))
      for (std::size_t u = 0; u < per_unit.size(); ++u) per_unit[u] = std::max(per_unit[u], theirs[u]);
  const std::uint64_t base = tracker.default_state().offset;
  std::vector<std::uint64_t> next(static_cast<std::size_t>(units) + 1, base);  // each unit's next draw
  for (int u = 0; u < units; ++u) next[static_cast<std::size_t>(u) + 1] = next[static_cast<std::size_t>(u)] + static_cast<std::uint64_t>(per_unit[static_cast<std::size_t>(u)]);
  const std::uint64_t end = next.back();
  const std::uint64_t table_at = next[0];
  for (Entity e : store.order()) {
    const auto& p = ctx_.world.get<nn::Param>(e);
    // One draw of the whole logical tensor from the default state, on every rank: element i of the
    // logical tensor is Philox element i of the draw, whatever part of it this rank holds (its
    // tensor-parallel shard, and of that its part of the unit under FSDP).
    rng::PhiloxArgs r{};
    if (p.init_std > 0) {
      std::uint64_t& at = next[static_cast<std::size_t>(p.unit)];
      tracker.default_state().offset = is_copy(e) ? table_at : at;
      r = tracker.draw(static_cast<std::uint64_t>(p.global_shape.numel()));
      if (!is_copy(e)) at += blocks_of(p);
    }
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
  tracker.default_state().offset = end;  // where one rank's draws of every parameter end
  for (const auto& [act, master] : store.act_copies()) ctx_.be.convert(act, master);
  learn_dropout_draws(tracker);
}

std::int64_t GptModel::sum_over_stages(std::int64_t local) const {
  if (!pipe_) return local;
  std::int64_t total = 0;
  for (const auto& v : pipe_->gather({local})) total += v.front();
  return total;
}

std::int64_t GptModel::parameter_count() const {
  std::int64_t n = 0;
  for (Entity e : ctx_.world.resource<nn::ParamStore>().order()) {
    const auto* t = ctx_.world.try_get<nn::TiedAcrossStages>(e);
    if (!t || !t->copy) n += ctx_.world.get<nn::Param>(e).global_shape.numel();
  }
  return sum_over_stages(n);
}

double GptModel::loss_sum(int slots, bool use_queued) {
  KILN_CHECK(!head_ || !head_->losses_pending(),
             "the LM head computes a training forward's losses in its backward pass (model.head_chunk_rows > 0): "
             "read them after backward()");
  KILN_CHECK(slots > 0 && slots <= slots_, "mean over ", slots, " loss slots of ", slots_);
  const std::int64_t n = slots * ctx_.N;
  std::vector<float> copied;
  const float* host = nullptr;
  if (use_queued && queued_loss_slots_ == slots) {  // queued behind the step's work: there once the stream is idle
    ctx_.be.synchronize();
    host = static_cast<const float*>(losses_host_.data());
  } else {
    copied.resize(static_cast<std::size_t>(n));
    ctx_.be.copy(TensorView(copied.data(), {n}, DType::f32, Device::cpu), losses_.rows(0, slots).reshape({n}));
    ctx_.be.synchronize();
    host = copied.data();
  }
  double sum = 0;
  for (std::int64_t i = 0; i < n; ++i) sum += host[i];
  return sum;
}

void GptModel::queue_loss_read(int slots) {
  queued_loss_slots_ = 0;
  if (!head_ || head_->losses_pending()) return;  // another stage's, or not written yet: mean_loss copies
  KILN_CHECK(slots > 0 && slots <= slots_, "loss read of ", slots, " slots of ", slots_);
  const std::int64_t n = slots * ctx_.N;
  const auto bytes = static_cast<std::size_t>(n) * sizeof(float);
  if (losses_host_.bytes() < bytes) losses_host_ = ctx_.be.alloc_host(static_cast<std::size_t>(slots_ * ctx_.N) * sizeof(float));
  ctx_.be.copy_to_host_async(TensorView(losses_host_.data(), {n}, DType::f32, Device::cpu),
                             losses_.rows(0, slots).reshape({n}));
  queued_loss_slots_ = slots;
}

double GptModel::mean_loss(int slots) {
  double mean = 0;
  if (head_) {  // the last stage's: the others hold no losses
    // The training losses' copy queue_loss_read made, if any (an evaluation since may have
    // overwritten the slots themselves).
    const double sum = loss_sum(slots, true);
    queued_loss_slots_ = 0;
    // Every DP rank saw its slice of the batch: its rows, or its share of the trained targets (masked
    // rows hold 0), so the mean over the replicas is the mean over the global batch's targets.
    const double per_rank = step_targets_ > 0 ? static_cast<double>(step_targets_) / dp_.size()
                                              : static_cast<double>(slots * ctx_.N);
    mean = dp_.mean(sum / per_rank);
  }
  return pipe_ ? pipe_->from_last(mean) : mean;
}

void GptModel::forward_stages(const train::Batch& batch) {
  load(batch, 0, false, nullptr);
  if (!pipe_) return forward_loaded(0, false, nullptr);
  // The chunks in the order the layers run, each stage's activation passed on to the next.
  for (int c = 0; c < plan_.chunks(); ++c) {
    const int v = plan_.virtual_stage(c);
    if (v > 0) {
      use(0);
      pipe_->receive_activation(v, residuals_[static_cast<std::size_t>(plan_.begin(c))], ctx_.be.stream());
    }
    forward_chunk(c, 0, false, nullptr);
    if (v < plan_.virtual_stages() - 1)
      pipe_->send_activation(v, residuals_[static_cast<std::size_t>(plan_.end(c))], ctx_.be.stream());
  }
}

double GptModel::evaluate(const std::vector<train::Batch>& batches) {
  KILN_CHECK(!batches.empty(), "no validation batches");
  std::int64_t targets = 0, rows = 0;
  for (auto& b : batches) {
    rows += static_cast<std::int64_t>(b.targets.size());
    targets += std::count_if(b.targets.begin(), b.targets.end(), [](std::int32_t t) { return t >= 0; });
  }
  // Only the last stage has losses; the others run their chunks, then take its answer.
  double result = 0;
  if (dp_.mean(static_cast<double>(rows - targets)) == 0) {  // no masked target on any rank
    double total = 0;
    for (auto& b : batches) {
      forward_stages(b);
      if (head_) total += dp_.mean(loss_sum(1) / static_cast<double>(ctx_.N));
    }
    result = total / static_cast<double>(batches.size());
  } else {
    double total = 0;
    for (auto& b : batches) {
      forward_stages(b);
      if (head_) total += loss_sum(1);
    }
    // The sum over every rank's batches over the count of their targets.
    const double all = dp_.mean(static_cast<double>(targets)) * dp_.size();
    const double sum = dp_.mean(total) * dp_.size();
    result = all > 0 ? sum / all : 0.0;
  }
  return pipe_ ? pipe_->from_last(result) : result;
}

std::vector<std::pair<std::string, double>> GptModel::step_metrics() {
  // Every part's device numbers in one read.
  std::vector<float> device(static_cast<std::size_t>(part_stats_ ? part_stats_.numel() : 0));
  if (!device.empty())
    ctx_.be.copy(TensorView(device.data(), {part_stats_.numel()}, DType::f32, Device::cpu), part_stats_);
  std::vector<float> sums;
  std::size_t read = 0;
  for (auto& block : blocks_)
    if (block)
      for (auto& [name, mixer] : block->mixers()) {
        const auto n = static_cast<std::size_t>(mixer->device_stats());
        mixer->collect_stats(std::span<const float>(device).subspan(read, n), sums);
        read += n;
      }
  std::vector<std::pair<std::string, double>> out;
  if (!sums.empty()) {
    dp_.sum(sums);
    std::size_t at = 0;
    for (auto& block : blocks_)
      if (block)
        for (auto& [name, mixer] : block->mixers()) at = mixer->end_step(sums, at, name, out);
  }
  return pipe_ ? merge_over_stages(out) : out;
}

std::vector<std::pair<std::string, double>> GptModel::merge_over_stages(
    const std::vector<std::pair<std::string, double>>& mine) const {
  // Each stage's numbers as words (a name's bytes, a zero, the value's bits), gathered; a name that
  // several stages report (the totals over the layers) is summed, in stage order.
  std::string bytes;
  for (const auto& [name, value] : mine) {
    bytes += name;
    bytes.push_back('\0');
    bytes.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  std::int64_t longest = 0;
  for (const auto& v : pipe_->gather({static_cast<std::int64_t>(bytes.size())})) longest = std::max(longest, v.front());
  std::vector<std::int64_t> words(static_cast<std::size_t>((longest + 7) / 8) + 1, 0);
  words[0] = static_cast<std::int64_t>(bytes.size());
  std::memcpy(words.data() + 1, bytes.data(), bytes.size());
  std::vector<std::pair<std::string, double>> out;
  for (const auto& theirs : pipe_->gather(words)) {
    const char* at = reinterpret_cast<const char*>(theirs.data() + 1);
    const char* end = at + theirs[0];
    while (at < end) {
      const std::string name(at);
      at += name.size() + 1;
      double value = 0;
      std::memcpy(&value, at, sizeof value);
      at += sizeof value;
      auto it = std::find_if(out.begin(), out.end(), [&](const auto& m) { return m.first == name; });
      if (it == out.end())
        out.push_back({name, value});
      else
        it->second += value;
    }
  }
  return out;
}

std::vector<float> GptModel::part_state() const {
  // Every block's state, in block order (a stage gathers the other stages' blocks').
  std::vector<std::int64_t> mine;
  for (const auto& block : blocks_)
    if (block)
      for (const auto& [name, mixer] : block->mixers())
        for (float v : mixer->state()) {
          std::int32_t bits = 0;
          std::memcpy(&bits, &v, sizeof v);
          mine.push_back(bits);
        }
  std::vector<float> all;
  auto append = [&all](const std::vector<std::int64_t>& words, std::size_t from, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
      const auto bits = static_cast<std::int32_t>(words[from + i]);
      float v = 0;
      std::memcpy(&v, &bits, sizeof v);
      all.push_back(v);
    }
  };
  if (!pipe_) {
    append(mine, 0, mine.size());
    return all;
  }
  // Each stage's values padded to the longest; then laid out by block.
  std::size_t longest = 0;
  for (const auto& n : block_state_sizes_by_stage_) longest = std::max(longest, n);
  mine.resize(longest, 0);
  const auto theirs = pipe_->gather(mine);
  std::vector<std::size_t> read(theirs.size(), 0);
  for (int l = 0; l < ctx_.cfg.n_layer; ++l) {
    const auto owner = static_cast<std::size_t>(block_state_owner_[static_cast<std::size_t>(l)]);
    const std::size_t n = block_state_sizes_[static_cast<std::size_t>(l)];
    append(theirs[owner], read[owner], n);
    read[owner] += n;
  }
  return all;
}

std::size_t GptModel::part_state_size() const {
  std::size_t n = 0;
  for (std::size_t s : block_state_sizes_) n += s;
  return n;
}

void GptModel::learn_part_state_layout() {
  // Each block's state size and the pipeline rank holding it (collective over the stages).
  const int L = ctx_.cfg.n_layer;
  std::vector<std::int64_t> mine(static_cast<std::size_t>(L), -1);
  for (int l = 0; l < L; ++l)
    if (const auto& block = blocks_[static_cast<std::size_t>(l)]) {
      std::size_t n = 0;
      for (const auto& [name, mixer] : block->mixers()) n += mixer->state().size();
      mine[static_cast<std::size_t>(l)] = static_cast<std::int64_t>(n);
    }
  const auto all = pipe_ ? pipe_->gather(mine) : std::vector<std::vector<std::int64_t>>{mine};
  block_state_sizes_.assign(static_cast<std::size_t>(L), 0);
  block_state_owner_.assign(static_cast<std::size_t>(L), 0);
  block_state_sizes_by_stage_.assign(all.size(), 0);
  for (std::size_t r = 0; r < all.size(); ++r)
    for (int l = 0; l < L; ++l)
      if (all[r][static_cast<std::size_t>(l)] >= 0) {
        block_state_sizes_[static_cast<std::size_t>(l)] = static_cast<std::size_t>(all[r][static_cast<std::size_t>(l)]);
        block_state_owner_[static_cast<std::size_t>(l)] = static_cast<int>(r);
        block_state_sizes_by_stage_[r] += static_cast<std::size_t>(all[r][static_cast<std::size_t>(l)]);
      }
}

void GptModel::set_part_state(std::span<const float> values) {
  // The whole model's state, in block order: this rank's blocks take theirs.
  KILN_CHECK(values.size() == part_state_size(), "the model's saved part state holds ", values.size(),
             " values, this model ", part_state_size());
  std::size_t at = 0;
  for (int l = 0; l < ctx_.cfg.n_layer; ++l) {
    if (auto& block = blocks_[static_cast<std::size_t>(l)])
      for (auto& [name, mixer] : block->mixers()) {
        const std::size_t n = mixer->state().size();
        mixer->set_state(values.subspan(at, n));
        at += n;
      }
    else
      at += block_state_sizes_[static_cast<std::size_t>(l)];
  }
}

std::int64_t GptModel::active_parameter_count() const {
  std::int64_t inactive = 0;
  for (const auto& block : blocks_)
    if (block)
      for (const auto& [name, mixer] : block->mixers()) inactive += mixer->inactive_parameters();
  return parameter_count() - sum_over_stages(inactive);
}

double GptModel::flops_per_token() const {
  double flops = head_ ? head_->flops_per_token() : 0.0;
  for (const auto& block : blocks_)
    if (block) flops += block->flops_per_token();
  if (!pipe_) return flops;
  // Whole numbers (6 per weight element, 12 T C per block): exact through the integer sum.
  return static_cast<double>(sum_over_stages(static_cast<std::int64_t>(std::llround(flops))));
}

}  // namespace kiln::model
