// ModelBase: what every architecture shares (see model_base.hpp).
#include "kiln/model/model_base.hpp"

#include "kiln/core/error.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"

namespace kiln::model {

ModelBase::ModelBase(World& world, const ModelConfig& cfg, int B, int T, int micro_batches)
    : world_(world),
      cfg_(cfg),
      be_(world.resource<ops::ActiveBackend>().get()),
      tp_(parallel::tensor_parallel(world, be_)),
      dp_(parallel::data_parallel(world)),
      B_(B),
      T_(T),
      slots_(micro_batches),
      N_(static_cast<std::int64_t>(B) * T),
      batch_sequences_(world.resource<train::TrainConfig>().batch_size),
      Nl_(tp_.local_rows(N_)),
      backend_linear_(ops::backend_linear_impl(be_)) {
  KILN_CHECK(T <= cfg.max_seq_len, "train.seq_len ", T, " exceeds model.max_seq_len ", cfg.max_seq_len);
  world_.emplace_resource<nn::ParamStore>();
}

Entity ModelBase::make_layer(int unit, nn::LayerKind kind, int block, const std::string& name) {
  Entity e = world_.create(name);
  world_.emplace<nn::Layer>(e, nn::Layer{unit, block, kind, {}});
  layers_.push_back(e);
  return e;
}

Entity ModelBase::add_param(const std::string& name, Shape global_shape, const TensorShard& shard, int unit,
                            bool decay, float std, float value, std::vector<Entity>& layer_params) {
  nn::Param p;
  p.name = name;
  p.global_shape = global_shape;
  p.shard = shard;
  p.shape = shard.local_shape(global_shape);
  p.weight_decay = decay;
  p.init_std = std;
  p.init_value = value;
  p.unit = unit;
  const Entity e = world_.resource<nn::ParamStore>().add(world_, std::move(p));
  layer_params.push_back(e);
  return e;
}

Entity ModelBase::add_norm_param(const std::string& name, int unit, float value, std::vector<Entity>& layer_params) {
  Entity e = add_param(name, {cfg_.n_embd}, TensorShard{}, unit, false, 0, value, layer_params);
  world_.get<nn::Param>(e).tp_partial_grad = tp_.sequence_parallel();  // norms see this rank's rows only
  return e;
}

Entity ModelBase::add_linear(const std::string& name, nn::LinearRole role, int unit, Entity w,
                             std::optional<Entity> b, std::int64_t in, std::int64_t out) {
  Entity e = world_.create(name);
  world_.emplace<nn::Linear>(e, nn::Linear{role, unit, w, b, static_cast<int>(in), static_cast<int>(out)});
  return e;
}

const ops::LinearImpl& ModelBase::impl(Entity linear) const {
  const auto* attached = world_.try_get<ops::LinearImpl>(linear);
  return attached ? *attached : backend_linear_;
}

ops::LinearBackward ModelBase::backward_args(Entity linear, ops::LinearBackward a) const {
  const auto* run = world_.try_resource<RunControl>();
  a.dweight_overwrite =
      (!run || run->micro_batch == 0) && world_.has<nn::GradWrittenFirst>(world_.get<nn::Linear>(linear).weight);
  return a;
}

bool ModelBase::inputs_kept(const std::vector<Entity>& linears) const {
  if (linears.empty()) return false;
  for (Entity e : linears) {
    const auto* impl = world_.try_get<ops::LinearImpl>(e);
    if (!impl || !impl->keeps_input) return false;
  }
  return true;
}

void ModelBase::initialise(rng::RngStatesTracker& tracker) {
  auto& store = world_.resource<nn::ParamStore>();
  const TensorView master = store.master_flat();
  for (Entity e : store.order) {
    const auto& p = world_.get<nn::Param>(e);
    // One draw of the whole logical tensor from the default state, on every rank: element i of the
    // logical tensor is Philox element i of the draw, whatever part of it this rank holds (its
    // tensor-parallel shard, and of that its part of the unit under FSDP).
    const rng::PhiloxArgs r =
        p.init_std > 0 ? tracker.draw(static_cast<std::uint64_t>(p.global_shape.numel())) : rng::PhiloxArgs{};
    store.for_each_held(p, [&](const nn::HeldPart& part) {
      const TensorView held = nn::ParamStore::held_view(master, part);
      if (p.init_std == 0) {
        be_.fill(held, p.init_value);
        return;
      }
      p.shard.for_each_block(p.global_shape, part.first, part.first + part.count, [&](const TensorShard::Block& b) {
        be_.init_normal(held.flat_slice(b.local - part.first, b.count), p.init_std, r, b.global);
      });
    });
  }
  be_.convert(store.compute_flat(), store.master_flat());
}

TensorView ModelBase::tensor(Entity e, bool grad) const {
  if (e == kNoParam) return {};
  const auto& store = world_.resource<nn::ParamStore>();
  const auto& p = world_.get<nn::Param>(e);
  return grad ? store.grad_view(p) : store.compute_view(p);
}

ops::DropoutArgs ModelBase::hidden_dropout(float p, const rng::PhiloxArgs& r) const {
  ops::DropoutArgs d;
  d.p = p;
  // This rank's rows of the step's [batch tokens, C] tensor: its micro-batch's, under sequence
  // parallelism its part of them.
  d.row_offset = seq_offset_ * T_ + tp_.first_local_row(N_);
  d.rng = r;
  return d;
}

float ModelBase::begin_forward(const train::Batch& batch, int slot, bool training, rng::RngStatesTracker* tracker) {
  KILN_CHECK(batch.B == B_ && batch.T == T_, "batch of ", batch.B, "x", batch.T, " but the model was built for ", B_,
             "x", T_);
  KILN_CHECK(allocated_, "forward before allocate_activations()");
  KILN_CHECK(slot >= 0 && slot < slots_, "loss slot ", slot, " of ", slots_);
  const std::int64_t N = N_;
  for (std::int64_t n = 0; n < N; ++n) {
    if (batch.inputs[n] < 0 || batch.inputs[n] >= cfg_.vocab_size)
      KILN_THROW("input token ", batch.inputs[n], " at position ", n, " is outside model.vocab_size = ", cfg_.vocab_size);
    if (batch.targets[n] < -1 || batch.targets[n] >= cfg_.vocab_size)
      KILN_THROW("target token ", batch.targets[n], " at position ", n, " is outside model.vocab_size = ",
                 cfg_.vocab_size);
  }
  be_.copy(tokens_, TensorView(const_cast<std::int32_t*>(batch.inputs.data()), {N}, DType::i32, Device::cpu));
  be_.copy(targets_, TensorView(const_cast<std::int32_t*>(batch.targets.data()), {N}, DType::i32, Device::cpu));
  const float p = training ? cfg_.dropout : 0.0f;
  seq_offset_ = batch.global_index;
  if (p > 0 && tracker) {  // every micro-batch of the step draws from the same states
    if (slot == 0)
      step_rng_ = tracker->get_states();
    else
      tracker->set_states(step_rng_);
  }
  return p;
}

void ModelBase::request_io() {
  arena_.request(&tokens_, DType::i32, {N_});
  arena_.request(&targets_, DType::i32, {N_});
  arena_.request(&losses_, DType::f32, {static_cast<std::int64_t>(slots_), N_});
}

std::int64_t ModelBase::parameter_count() const {
  std::int64_t n = 0;
  for (Entity e : world_.resource<nn::ParamStore>().order) n += world_.get<nn::Param>(e).numel;
  return n;
}

double ModelBase::mean_loss(int slots) {
  KILN_CHECK(slots > 0 && slots <= slots_, "mean over ", slots, " loss slots of ", slots_);
  const std::int64_t N = N_;
  std::vector<float> host(static_cast<std::size_t>(slots * N));
  be_.copy(TensorView(host.data(), {slots * N}, DType::f32, Device::cpu), losses_.rows(0, slots).reshape({slots * N}));
  be_.synchronize();
  double sum = 0;
  for (float v : host) sum += v;
  return dp_.mean(sum / static_cast<double>(host.size()));  // every DP rank saw its slice of the batch
}

double ModelBase::evaluate(const std::vector<train::Batch>& batches) {
  KILN_CHECK(!batches.empty(), "no validation batches");
  double total = 0;
  for (auto& b : batches) {
    forward(b, 0, false, nullptr);
    total += mean_loss(1);
  }
  return total / static_cast<double>(batches.size());
}

}  // namespace kiln::model
