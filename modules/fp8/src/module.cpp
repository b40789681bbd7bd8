// The fp8 engine module: picks the linear layers, attaches their FP8 meta and LinearImpl, and
// schedules the once-per-step amax reduction and scaling update.
#include "kiln/fp8/module.hpp"

#include <algorithm>
#include <climits>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <thread>

#include <boost/describe/enum_to_string.hpp>

#include "kiln/engine/engine_module.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/events.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/grouped_linear_impl.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/state.hpp"
#include "kiln/train/train.hpp"
#include "profiled_ops.hpp"

namespace kiln::fp8 {

namespace {

// An FP8 layer's calls on chunks of rows (ops::LinearImpl::pair_rows_multiple) take a multiple of
// this many rows, on every backend: the weight gradient's inner dimension is the tokens, and
// cuBLASLt's FP8 GEMMs need it a multiple of 16.
constexpr std::int64_t kGemmRowsMultiple = 16;

std::unique_ptr<Fp8Ops> make_ops(World& w, const Fp8Config& cfg) {
  auto& be = w.resource<ops::ActiveBackend>().get();
  const auto& bc = w.resource<ops::BackendConfig>();
  std::unique_ptr<Fp8Ops> ops;
  if (be.device() == Device::cuda) {
    ops = make_cuda_ops(be.stream(), {.tune_grouped = bc.grouped_gemm_tune, .block_gemm = cfg.block_gemm});
  } else {  // the same threads and bf16 rounding as the CPU backend
    const int local = std::max(1, w.resource<RankInfo>().local_world_size);
    const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    ops = make_cpu_ops(
        {.round_bf16 = bc.cpu_round_bf16, .threads = bc.cpu_threads > 0 ? bc.cpu_threads : std::max(1, hw / local)});
  }
  // With backend.profile the FP8 kernels appear in the per-op breakdown.
  return bc.profile ? make_profiled_ops(std::move(ops), be) : std::move(ops);
}

parallel::Communicator* amax_communicator(World& w, AmaxGroup g) {
  auto& c = w.resource<parallel::Communicators>();
  switch (g) {
    case AmaxGroup::tp: return c.tp.get();
    case AmaxGroup::tp_dp: return c.tp_dp.get();
    case AmaxGroup::world: return c.world.get();
  }
  return nullptr;
}

// One all-reduce (max) of this step's amaxes of every FP8 tensor: history row 0 is one flat [n].
void reduce_amaxes(World& w) {
  auto& st = w.resource<Fp8State>();
  if (!st.amax_comm || st.amax_comm->size() == 1 || st.meta->size() == 0) return;
  const TensorView am = st.meta->amaxes();
  st.amax_comm->all_reduce(am, parallel::ReduceOp::max,
                           am.device == Device::cpu ? nullptr : w.resource<ops::ActiveBackend>().get().stream());
}

// With sharded masters: each gathered layer's part of its weight quantised into the held codes, with
// the weight scale; where that scale comes from the weight itself, from the largest amax of all its
// parts (one all-reduce over the ranks holding parts, for all the layers at once).
void quantize_weight_parts(World& w) {
  auto& st = w.resource<Fp8State>();
  const auto& store = w.resource<nn::ParamStore>();
  struct Part {
    Fp8Linear* lin;
    const nn::Param* param;
    nn::HeldPart held;
    bool here = false;
  };
  std::vector<Part> parts;
  bool agree = false;
  for (std::size_t i : st.gathered) {
    Part p{st.linears[i].get(), &w.get<nn::Param>(w.get<nn::Linear>(st.entities[i]).weight), {}};
    store.for_each_held(*p.param, [&](const nn::HeldPart& h) {
      p.held = h;
      p.here = true;
    });
    if (p.lin->weight_scale_from_tensor()) {
      agree = true;
      float* amax = p.lin->weight_amax();
      if (p.here) st.ops->amax(nn::ParamStore::held_view(store.master_flat(), p.held), amax);
    }
    parts.push_back(p);
  }
  if (agree) {
    auto& ranks = parallel::held_parts(w);
    const TensorView amaxes = st.recipe.kind == RecipeKind::current ? st.meta->amaxes_now() : st.meta->amaxes();
    if (ranks.size() > 1)
      ranks.all_reduce(amaxes, parallel::ReduceOp::max,
                       amaxes.device == Device::cpu ? nullptr : w.resource<ops::ActiveBackend>().get().stream());
    for (auto& p : parts)
      if (p.lin->weight_scale_from_tensor()) p.lin->weight_scale_from_amax();
  }
  for (auto& p : parts)
    if (p.here)
      p.lin->quantize_weight_part(nn::ParamStore::held_view(store.master_flat(), p.held),
                                  store.held_codes(*p.param, p.held));
}

// The optimizer step's hyperparameters for one weight; the caller names the tensors.
AdamWQuantizeArgs step_args(const nn::AdamWStep& e, const nn::Param& p) {
  AdamWQuantizeArgs u;
  u.lr = e.lr;
  u.beta1 = e.beta1;
  u.beta2 = e.beta2;
  u.eps = e.eps;
  u.weight_decay = p.weight_decay ? e.weight_decay : 0.0f;
  u.step = e.step;
  u.scalars = e.scalars;
  return u;
}

// The optimizer step's arguments for a whole weight (unsharded masters): its gradient and moments.
AdamWQuantizeArgs whole_weight_args(const nn::AdamWStep& e, const nn::Param& p, const nn::ParamStore& store) {
  AdamWQuantizeArgs u = step_args(e, p);
  u.grad = store.grad_view(p);
  u.m = nn::ParamStore::view_in(e.m, p);
  u.v = nn::ParamStore::view_in(e.v, p);
  return u;
}

// With sharded masters and the fused update: each rank's part of each weight left to us, updated by
// the optimizer's AdamW step (nn::AdamWStep) and quantised into its held codes in one pass.
void update_weight_parts(World& w, const nn::AdamWStep& e) {
  auto& st = w.resource<Fp8State>();
  const auto& store = w.resource<nn::ParamStore>();
  for (std::size_t i : st.fused) {
    const auto& p = w.get<nn::Param>(w.get<nn::Linear>(st.entities[i]).weight);
    store.for_each_held(p, [&](const nn::HeldPart& part) {
      AdamWQuantizeArgs u = step_args(e, p);
      u.param = nn::ParamStore::held_view(store.master_flat(), part);
      u.grad = nn::ParamStore::held_view(store.grads_flat(), part);
      u.m = nn::ParamStore::held_view(e.m, part);
      u.v = nn::ParamStore::held_view(e.v, part);
      // A whole weight (its codes apart in an unsharded store) in its shape: the tiled kernel.
      if (part.count == p.numel)
        for (TensorView* t : {&u.param, &u.grad, &u.m, &u.v}) *t = t->reshape(p.shape);
      st.linears[i]->update_weight_part(u, store.held_codes(p, part));
    });
  }
}

// The scaling state in training-state checkpoints. Under the layout that saved it each rank takes
// its own back; under another, the slot-wise union of every rank's (Fp8MetaSnapshot::combine).
void save_scaling_state(World& w, Fp8State& st) {
  w.resource<train::TrainingState>().blobs.push_back(
      {"fp8", [&st] { return st.meta->snapshot(*st.ops).serialize(); },
       [&w, &st](const train::SavedBlobs& saved) -> std::function<void()> {
         const bool rank0 = w.resource<RankInfo>().rank == 0;
         if (saved.all.empty()) {
           if (rank0) std::cout << "fp8: " << saved.checkpoint << " has no FP8 scaling state; scaling starts afresh\n";
           return [] {};
         }
         Fp8MetaSnapshot snap;
         try {
           if (saved.own) {
             snap = Fp8MetaSnapshot::deserialize(*saved.own);
           } else {
             std::vector<Fp8MetaSnapshot> all;
             for (auto& b : saved.all) all.push_back(Fp8MetaSnapshot::deserialize(b));
             snap = Fp8MetaSnapshot::combine(all);
           }
           // restore()'s checks, before anything changes.
           if (snap.n != st.meta->size() || snap.len != st.meta->history_len())
             throw Error(cat("FP8 scaling state of ", snap.n, " tensors with amax histories of ", snap.len,
                             " steps; this run has ", st.meta->size(), " tensors with ", st.meta->history_len(),
                             " (fp8.amax_history_len, or another model)"));
         } catch (const Error& e) {
           KILN_FILE_ERROR("checkpoint ", saved.checkpoint, ": ", e.what());
         }
         return [&st, snap, rank0, combined = !saved.own] {
           st.meta->restore(*st.ops, snap);
           if (combined && rank0)
             std::cout << "fp8: the layout changed: each tensor's amax history is the maximum over the ranks that "
                          "saved it\n";
         };
       }});
}

// The roles whose layers (Layer: nn::Linear or nn::GroupedLinear) keep the colwise FP8 copy of their
// input for the backward pass: where the model would otherwise store that input in bf16 for it alone
// (half the bytes, and no second quantisation), for a role only when every such layer of it is among
// `fp8` (otherwise the model stores them all anyway).
template <class Layer>
std::set<nn::LinearRole> roles_kept_in_fp8(World& w, const std::vector<Entity>& fp8) {
  std::map<nn::LinearRole, std::pair<int, int>> stored_fp8;  // role -> (stored for backward, of those FP8)
  for (Entity e : w.view<Layer>()) {
    const auto& l = w.get<Layer>(e);
    if (!l.input_stored_for_backward) continue;
    auto& c = stored_fp8[l.role];
    ++c.first;
    if (std::find(fp8.begin(), fp8.end(), e) != fp8.end()) ++c.second;
  }
  std::set<nn::LinearRole> roles;
  for (const auto& [role, c] : stored_fp8)
    if (c.first == c.second) roles.insert(role);
  return roles;
}

// Whether a layer of one of those roles keeps its input in FP8: not on a pipeline stage, where other
// micro-batches' forwards run between a forward and its backward and a layer keeps one input.
template <class Layer>
bool keeps_in_fp8(const Layer& l, const std::set<nn::LinearRole>& roles, bool pipelined) {
  return !pipelined && l.input_stored_for_backward && roles.count(l.role) > 0;
}

// Current scaling on a pipeline stage: a layer's backward quantises its saved input again with the
// scale its forward took from that input, but the schedule runs other micro-batches' forwards in
// between. Each unit's scales (and their inverses) are kept per micro-batch from the end of its
// forward to the start of its backward. (A unit's linears' slots are consecutive: the linears are
// made unit by unit.)
void keep_scales_per_micro_batch(World& w, Fp8State& st) {
  // unit -> its slot ranges [first, last): its linears', then its grouped linears' (each consecutive).
  std::map<int, std::vector<std::pair<int, int>>> slots;
  auto add = [&slots](int unit, int first) {
    auto& ranges = slots[unit];
    if (!ranges.empty() && ranges.back().second == first)
      ranges.back().second = first + kRolesPerLinear;
    else
      ranges.push_back({first, first + kRolesPerLinear});
  };
  for (std::size_t i = 0; i < st.entities.size(); ++i)
    add(w.get<nn::Linear>(st.entities[i]).unit, static_cast<int>(i) * kRolesPerLinear);
  for (std::size_t i = 0; i < st.grouped_entities.size(); ++i)
    add(w.get<nn::GroupedLinear>(st.grouped_entities[i]).unit,
        static_cast<int>(st.entities.size() + i) * kRolesPerLinear);
  const int n = st.meta->size(), m = w.resource<train::TrainState>().micro_batches;
  constexpr int S = Fp8MetaStore::kScaleInvStride;
  auto& be = w.resource<ops::ActiveBackend>().get();
  auto stash = std::make_shared<Buffer>(be.alloc(static_cast<std::size_t>(m) * n * (1 + S) * sizeof(float)));
  // Micro-batch k's copies: scales [n], then inverses [n, S]; `save`: live -> copy, else back.
  auto move = [&w, &st, stash, n](int k, const std::vector<std::pair<int, int>>& ranges, bool save) {
    auto& be = w.resource<ops::ActiveBackend>().get();
    const std::size_t at = static_cast<std::size_t>(k) * n * (1 + S) * sizeof(float);
    for (const auto& [first, last] : ranges) {
      const TensorView scale = stash->view(DType::f32, {last - first}, at + static_cast<std::size_t>(first) * sizeof(float));
      const TensorView inv = stash->view(DType::f32, {last - first, S},
                                         at + (static_cast<std::size_t>(n) + static_cast<std::size_t>(first) * S) * sizeof(float));
      const TensorView now = st.meta->scales().flat_slice(first, last - first);
      const TensorView now_inv = st.meta->scale_invs().rows(first, last - first);
      if (save) {
        be.copy(scale, now);
        be.copy(inv, now_inv);
      } else {
        be.copy(now, scale);
        be.copy(now_inv, inv);
      }
    }
  };
  st.subscriptions.push_back(w.events().subscribe<nn::LayerForwardEnd>([&w, slots, move](const nn::LayerForwardEnd& e) {
    if (const auto it = slots.find(e.unit); it != slots.end()) move(w.resource<RunControl>().micro_batch, it->second, true);
  }));
  st.subscriptions.push_back(w.events().subscribe<nn::LayerBackwardBegin>([&w, slots, move](const nn::LayerBackwardBegin& e) {
    if (const auto it = slots.find(e.unit); it != slots.end()) move(w.resource<RunControl>().micro_batch, it->second, false);
  }));
}

// After an optimizer step the FP8 weight copies are stale, unless its update wrote them (fused: then
// they are current). fp8.weights_changed is host bookkeeping alone, so a captured step replays it
// (StepGraph): after each replay through the optimizer (nn::PassesReplayed) the host does what the
// skipped systems would have done there: fp8.scale_update's count and event, the fused update's step
// mark (the replay's update wrote the copies as the captured one did, their versions left as the
// capture left them), and this.
void weights_changed(Fp8State& s, std::int64_t step) {
  if (s.fused_update_step != step) s.invalidate_weights();
  if (s.grouped_update_step != step) ++s.grouped_version;
}
void track_weight_updates(World& w, Fp8State& st, bool delayed_scaling) {
  w.systems().add({.name = "fp8.weights_changed",
                   .phase = Phase::optimizer,
                   .run = [](World& world) {
                     weights_changed(world.resource<Fp8State>(), world.resource<RunControl>().step);
                   },
                   .replayable = true});
  struct Captured {
    bool fused = false, grouped_fused = false;  // the captured step's updates wrote the copies
  };
  auto captured = std::make_shared<Captured>();
  st.subscriptions.push_back(w.events().subscribe<nn::PassesCaptureEnd>([&w, &st, captured](const nn::PassesCaptureEnd& e) {
    if (!e.through_optimizer) return;
    const std::int64_t step = w.resource<RunControl>().step;
    *captured = {st.fused_update_step == step, st.grouped_update_step == step};
  }));
  st.subscriptions.push_back(w.events().subscribe<nn::PassesReplayed>(
      [&w, &st, captured, delayed_scaling](const nn::PassesReplayed& e) {
        if (!e.through_optimizer || e.captured_now) return;
        const std::int64_t step = w.resource<RunControl>().step;
        if (delayed_scaling) {
          ++st.updates;
          w.events().publish(AmaxReduced{step});
        }
        if (captured->fused) st.fused_update_step = step;
        if (captured->grouped_fused) st.grouped_update_step = step;
        weights_changed(st, step);
      }));
}

// The blocks' FP8 scratch in the model's block scratch (its logits buffer): for when the LM head,
// which writes the logits, is not among the FP8 layers.
void lend_block_scratch(World& w) {
  w.systems().add({"fp8.scratch", Phase::setup,
                   [](World& world) {
                     if (const auto* s = world.try_resource<nn::BlockScratch>())
                       world.resource<Fp8State>().workspace->lend(s->data, s->bytes);
                   },
                   {"model.init"}});
}

// Block recipe, sharded masters: every rank's parts of the gathered weights quantised into its held
// codes with the tiles' scales the ranks agree on (each tile's amax the maximum of every part's).
void quantize_block_weight_parts(World& w) {
  auto& st = w.resource<Fp8State>();
  const auto& store = w.resource<nn::ParamStore>();
  st.ops->zero(st.block_tile_amax.data(), st.block_tile_amax.bytes());
  auto each_part = [&](auto&& f) {
    for (std::size_t i : st.gathered) {
      const auto& p = w.get<nn::Param>(w.get<nn::Linear>(st.entities[i]).weight);
      store.for_each_held(p, [&](const nn::HeldPart& h) { f(*st.block_linears[i], p, h); });
    }
  };
  each_part([&](Fp8BlockLinear& lin, const nn::Param&, const nn::HeldPart& h) {
    lin.weight_part_amax(nn::ParamStore::held_view(store.master_flat(), h), h.first);
  });
  auto& ranks = parallel::held_parts(w);
  const auto n = static_cast<std::int64_t>(st.block_tile_amax.bytes() / 4);
  const TensorView amaxes(st.block_tile_amax.data(), {n}, DType::f32, st.ops->device());
  if (ranks.size() > 1)
    ranks.all_reduce(amaxes, parallel::ReduceOp::max,
                     amaxes.device == Device::cpu ? nullptr : w.resource<ops::ActiveBackend>().get().stream());
  for (std::size_t i : st.gathered) st.block_linears[i]->scales_from_amax();
  each_part([&](Fp8BlockLinear& lin, const nn::Param& p, const nn::HeldPart& h) {
    lin.quantize_weight_part(nn::ParamStore::held_view(store.master_flat(), h), h.first, store.held_codes(p, h));
  });
}

// The report's line for a layer left in bf16 (its description; one without a reason of its own was
// left for its dimensions).
std::string skip_line(const std::string& s) {
  return s + (s.find(')') == std::string::npos ? " stays bf16 (dimensions not multiples of 16)" : " stays bf16");
}

// fp8.recipe = block: each selected linear (st.entities) gets an Fp8BlockLinear. No meta and no
// amax systems; the weights' codes are made once per weight version (every optimizer step, or a
// checkpoint load, makes a new one): by the layers or the fused optimizer step where the masters are
// whole, by every rank for its parts where they are sharded (see fp8.weights below).
void install_block(World& w, const Fp8Config& cfg, const std::vector<std::string>& skipped, bool pipelined) {
  auto& st = w.resource<Fp8State>();
  // Its GEMMs and quantisations write f32 weight and bias gradients: bf16 ones are refused before the
  // first step, naming the key.
  w.systems().add({"fp8.block_grads", Phase::setup, [](World& world) {
                     if (world.resource<nn::ParamStore>().grad_dtype() == DType::bf16)
                       throw config_error(world, "optim.grads",
                                          "is \"bf16\", which fp8.recipe = \"block\" does not support yet (its "
                                          "layers write f32 gradients): use optim.grads = \"f32\" or another recipe");
                   }});
  // E4M3 throughout, fp8.format notwithstanding (as DeepSeek-V3 and TransformerEngine's block recipe):
  // a scale per 128 values leaves E5M2's range nothing to do, and E4M3's extra mantissa bit shows in
  // the loss (gpt2-124m, 2,000 steps: validation +0.45% against bf16 with E5M2 gradients, -0.68%
  // with E4M3; docs/PERF.md).
  const BlockRecipe recipe{Format::e4m3, Format::e4m3, Format::e4m3, cfg.block_pow2_scales, cfg.block_2d_wgrad_input};
  // Tensor parallelism splits the column-parallel layers' outputs (their weights' 128x128 tiles
  // along OC) and the row-parallel layers' inputs (every 1x128 block along IC): each part must hold
  // whole blocks, or the ranks would scale blocks that the unsplit layer does not have.
  const int tp = w.resource<parallel::Communicators>().tp->size();
  if (tp > 1)
    for (Entity e : st.entities) {
      const auto& l = w.get<nn::Linear>(e);
      const bool row = l.role == nn::LinearRole::attn_out || l.role == nn::LinearRole::mlp_out;
      const int part = row ? l.in : l.out;
      if (part % kBlock != 0)
        throw ConfigError(cat(w.resource<RankInfo>().pipeline_file, ": fp8.recipe = \"block\" with parallel.tp = ", tp,
                              ": ", w.describe(e), " splits its ", row ? "input" : "output", " features into parts of ",
                              part, ", not a multiple of 128 (a block would straddle two ranks); use a model whose ",
                              "split dimensions are multiples of 128 x parallel.tp, or another fp8.recipe"));
    }
  // Tensor parallelism splits a mixture of experts' hidden features: FC1's outputs and FC2's inputs,
  // whole blocks each, as above.
  if (tp > 1)
    for (Entity e : st.grouped_entities) {
      const auto& g = w.get<nn::GroupedLinear>(e);
      const bool row = g.role == nn::LinearRole::mlp_out;
      const int part = row ? g.in : g.out;
      if (part % kBlock != 0)
        throw ConfigError(cat(w.resource<RankInfo>().pipeline_file, ": fp8.recipe = \"block\" with parallel.tp = ", tp,
                              ": ", w.describe(e), " splits the experts' ", row ? "input" : "output",
                              " features into parts of ", part,
                              ", not a multiple of 128 (a block would straddle two ranks); use a model.moe.hidden that "
                              "is a multiple of 128 x parallel.tp, or another fp8.recipe"));
    }
  st.workspace = std::make_unique<Fp8Workspace>(*st.ops);
  Fp8State* state = &st;
  // The experts' linears keep their inputs' transposes (the weight gradient's operand) in FP8 from the
  // forward where the model would store the input for them, as under per-tensor scaling (keeps_in_fp8).
  const std::set<nn::LinearRole> keep_grouped_roles = roles_kept_in_fp8<nn::GroupedLinear>(w, st.grouped_entities);
  for (Entity e : st.grouped_entities) {
    const auto* name = w.try_get<Name>(e);
    const auto& grouped = w.get<nn::GroupedLinear>(e);
    const bool keep = keeps_in_fp8(grouped, keep_grouped_roles, pipelined);
    st.block_grouped.push_back(std::make_unique<Fp8BlockGroupedLinear>(*st.ops, *st.workspace, recipe,
                                                                       name ? name->value : w.describe(e), keep));
    Fp8BlockGroupedLinear* lin = st.block_grouped.back().get();
    w.emplace<ops::GroupedLinearImpl>(
        e, ops::GroupedLinearImpl{.forward = [lin, state](const ops::GroupedLinearForward& a) {
                                    lin->forward(a, state->grouped_version);
                                  },
                                  .backward = [lin](const ops::GroupedLinearBackward& a) { lin->backward(a); },
                                  .prologues = Fp8BlockGroupedLinear::kPrologues,
                                  .keeps_input = keep});
  }
  // The linears keep their inputs' transposes (the weight gradient's operand) in FP8 from the forward
  // where the model would store the input for them, as under per-tensor scaling.
  const std::set<nn::LinearRole> keep_roles = roles_kept_in_fp8<nn::Linear>(w, st.entities);
  std::map<nn::LinearRole, int> kept_layers;  // for the report
  for (Entity e : st.entities) {
    const auto* name = w.try_get<Name>(e);
    const auto& linear = w.get<nn::Linear>(e);
    const bool keep = keeps_in_fp8(linear, keep_roles, pipelined);
    if (keep) ++kept_layers[linear.role];
    st.block_linears.push_back(
        std::make_unique<Fp8BlockLinear>(*st.ops, *st.workspace, recipe, name ? name->value : w.describe(e), keep));
    Fp8BlockLinear* lin = st.block_linears.back().get();
    w.emplace<ops::LinearImpl>(
        e, ops::LinearImpl{.forward = [lin, state](const ops::LinearForward& a) { lin->forward(a, state->weights_version); },
                           .backward = [lin](const ops::LinearBackward& a) { lin->backward(a); },
                           .prologues = Fp8BlockLinear::kPrologues,
                           .keeps_input = keep,
                           .pairs_on_rows = true,  // each call's blocks are its own
                           .pair_rows_multiple = kGemmRowsMultiple});
  }
  // The weights' codes in the memory of their compute copies, made from their f32 masters. Where the
  // masters are whole, the layers make them (with fp8.fuse_weight_update the optimizer's step writes
  // them: one pass over the master, its moments and the codes, Fp8Ops::adamw_quantize_blocks; the
  // optimizer leaves those weights to us, nn::UpdatedBy, marked here before the first step). Where
  // they are sharded (FSDP), the compute copies are one-byte codes (nn::ByteCompute): every rank
  // quantises its parts with the tiles' scales the ranks agree on, after each optimizer step, and
  // FSDP gathers the codes (quantize_block_weight_parts).
  if (cfg.weights_in_compute_copy) {
    for (Entity e : st.entities)
      if (w.get<nn::Linear>(e).role != nn::LinearRole::lm_head) w.emplace<nn::ByteCompute>(w.get<nn::Linear>(e).weight);
    w.systems().add({"fp8.weights", Phase::setup,
                     [fuse = cfg.fuse_weight_update](World& world) {
                       auto& s = world.resource<Fp8State>();
                       const auto& store = world.resource<nn::ParamStore>();
                       std::int64_t tiles = 0;
                       for (std::size_t i = 0; i < s.entities.size(); ++i) {
                         const auto& linear = world.get<nn::Linear>(s.entities[i]);
                         if (linear.role == nn::LinearRole::lm_head) continue;  // (may be tied to the embedding)
                         const auto& wp = world.get<nn::Param>(linear.weight);
                         if (store.sharded()) {
                           s.gathered.push_back(i);
                           tiles += Fp8BlockLinear::tile_count(wp.shape[0], wp.shape[1]);
                           continue;
                         }
                         s.block_linears[i]->use_master_weight(store.master_view(wp), store.compute_view(wp));
                         if (fuse && !world.try_get<nn::UpdatedBy>(linear.weight)) {
                           world.emplace<nn::UpdatedBy>(linear.weight, nn::UpdatedBy{"fp8"});
                           s.fused.push_back(i);
                         }
                       }
                       // The experts' weights' codes in their compute copies too where the masters are
                       // whole, written by the optimizer's step with fuse_weight_update (sharded, their
                       // compute copies are gathered in act precision and the layers quantise them).
                       if (!store.sharded())
                         for (std::size_t i = 0; i < s.block_grouped.size(); ++i) {
                           const Entity we = world.get<nn::GroupedLinear>(s.grouped_entities[i]).weight;
                           const auto& wp = world.get<nn::Param>(we);
                           s.block_grouped[i]->use_master_weight(store.master_view(wp), store.compute_view(wp));
                           if (fuse && !world.try_get<nn::UpdatedBy>(we)) {
                             world.emplace<nn::UpdatedBy>(we, nn::UpdatedBy{"fp8"});
                             s.grouped_fused.push_back(i);
                           }
                         }
                       if (s.gathered.empty()) return;
                       s.block_tile_amax = s.ops->alloc(static_cast<std::size_t>(tiles) * 4);
                       auto* at = static_cast<float*>(s.block_tile_amax.data());
                       for (std::size_t i : s.gathered) {
                         const auto& wp = world.get<nn::Param>(world.get<nn::Linear>(s.entities[i]).weight);
                         s.block_linears[i]->use_gathered_codes(wp.shape[0], wp.shape[1], at);
                         at += Fp8BlockLinear::tile_count(wp.shape[0], wp.shape[1]);
                       }
                       quantize_block_weight_parts(world);
                     },
                     {"params.allocate", "model.init"}});
  }
  st.subscriptions.push_back(w.events().subscribe<nn::AdamWStep>([&w, &st](const nn::AdamWStep& e) {
    if (!st.gathered.empty()) quantize_block_weight_parts(w);
    const auto& store = w.resource<nn::ParamStore>();
    if (!st.fused.empty()) {
      st.invalidate_weights();
      st.fused_update_step = w.resource<RunControl>().step;
      for (std::size_t i : st.fused)
        st.block_linears[i]->update_weight(
            whole_weight_args(e, w.get<nn::Param>(w.get<nn::Linear>(st.entities[i]).weight), store),
            st.weights_version);
    }
    if (st.grouped_fused.empty()) return;  // the experts' weights
    ++st.grouped_version;
    st.grouped_update_step = w.resource<RunControl>().step;
    for (std::size_t i : st.grouped_fused)
      st.block_grouped[i]->update_weight(
          whole_weight_args(e, w.get<nn::Param>(w.get<nn::GroupedLinear>(st.grouped_entities[i]).weight), store),
          st.grouped_version);
  }));
  st.subscriptions.push_back(w.events().subscribe<nn::ParamsLoaded>([&w, &st](const nn::ParamsLoaded&) {
    if (!st.gathered.empty()) quantize_block_weight_parts(w);
    st.invalidate_weights();
    ++st.grouped_version;
    st.fused_update_step = -1;
    st.grouped_update_step = -1;
  }));
  track_weight_updates(w, st, false);
  if (!cfg.lm_head) lend_block_scratch(w);
  const std::size_t n_fp8 = st.entities.size(), n_all = w.view<nn::Linear>().size(),
                    g_fp8 = st.grouped_entities.size(), g_all = w.view<nn::GroupedLinear>().size();
  w.systems().add({"fp8.report", Phase::setup, [n_fp8, n_all, g_fp8, g_all, recipe, skipped, kept_layers](World& world) {
                     if (world.resource<RankInfo>().rank != 0) return;
                     std::cout << "fp8: " << n_fp8 << " of " << n_all << " linear layers"
                               << (g_all > 0 ? cat(" and ", g_fp8, " of ", g_all, " grouped (expert) linears") : "")
                               << " in FP8 (block scaling: 1x128 activations and gradients, 128x128 weights, E4M3"
                               << (recipe.pow2 ? ", power-of-two scales" : "")
                               << (recipe.wgrad_input_2d ? ", the weight gradient's input in 128x128 blocks" : "") << ")\n";
                     for (const auto& [role, layers] : kept_layers)  // where the model would keep the input in bf16
                       std::cout << "fp8: the " << boost::describe::enum_to_string(role, "?")
                                 << " layers keep their input's transpose in FP8 with its block scales for the backward "
                                 << "pass (" << layers << " layers), not the input in bf16\n";
                     for (auto& s : skipped) std::cout << "fp8: " << skip_line(s) << "\n";
                   }});
}

void install(World& w, const Fp8Config& cfg) {
  if (!cfg.enabled) return;
  const auto& file = w.resource<RankInfo>().pipeline_file;
  const bool cuda = w.resource<ops::ActiveBackend>().get().device() == Device::cuda;
  auto& st = w.emplace_resource<Fp8State>();
  st.recipe = Fp8Recipe{cfg.recipe, cfg.amax_history_len, cfg.amax_compute_algo, cfg.margin, cfg.format,
                        cfg.forward_fast_accum};
  st.ops = make_ops(w, cfg);

  // Hopper FP8 GEMMs need every dimension (tokens, in, out) to be a multiple of 16.
  const std::int64_t tokens =
      static_cast<std::int64_t>(w.resource<train::TrainState>().micro_batch_size) * w.resource<train::TrainConfig>().seq_len;
  if (cuda && tokens % 16 != 0)
    throw ConfigError(cat(file, ": fp8 on CUDA needs the tokens of a micro-batch (micro_batch_size x train.seq_len = ",
                          tokens, ") to be a multiple of 16"));

  int first_unit = INT_MAX, last_unit = INT_MIN;
  for (Entity e : w.view<nn::Linear>()) {
    const auto& l = w.get<nn::Linear>(e);
    if (nn::in_block(l.role)) first_unit = std::min(first_unit, l.unit), last_unit = std::max(last_unit, l.unit);
  }
  // A pipeline stage holds some blocks: the model's first and last are over every stage's.
  const bool pipelined = w.try_resource<StepPasses>() != nullptr;
  if (pipelined && cfg.first_last_bf16) {
    float ends[2] = {-static_cast<float>(first_unit), static_cast<float>(last_unit)};
    w.resource<parallel::Communicators>().pp->all_reduce(TensorView(ends, {2}, DType::f32, Device::cpu),
                                                         parallel::ReduceOp::max, nullptr);
    first_unit = static_cast<int>(-ends[0]);
    last_unit = static_cast<int>(ends[1]);
  }
  std::vector<Format> formats;
  std::vector<std::string> skipped;
  for (Entity e : w.view<nn::Linear>()) {
    const auto& l = w.get<nn::Linear>(e);
    bool use = nn::in_block(l.role) || (cfg.lm_head && l.role == nn::LinearRole::lm_head);
    if (use && cfg.first_last_bf16 && nn::in_block(l.role) && (l.unit == first_unit || l.unit == last_unit))
      use = false;
    if (!use) continue;
    if (cuda && (l.in % 16 != 0 || l.out % 16 != 0)) {
      skipped.push_back(w.describe(e));
      continue;
    }
    st.entities.push_back(e);
    for (auto r : {TensorRole::input, TensorRole::weight, TensorRole::grad_output})
      formats.push_back(format_for(cfg.format, r));
  }
  // A mixture of experts' grouped linears (every block's).
  for (Entity e : w.view<nn::GroupedLinear>()) {
    const auto& g = w.get<nn::GroupedLinear>(e);
    if (!nn::in_block(g.role)) continue;
    if (cuda && (g.in % 16 != 0 || g.out % 16 != 0)) {
      skipped.push_back(w.describe(e));
      continue;
    }
    st.grouped_entities.push_back(e);
  }
  if (!cfg.keep_weight_transpose) {
    if (cfg.recipe == RecipeKind::block || !cfg.weights_in_compute_copy)
      throw config_error(w, "fp8.keep_weight_transpose",
                         "false needs the weights' codes in their compute copies (fp8.weights_in_compute_copy) "
                         "under delayed or current scaling (block scaling keeps its own transposed codes)");
    // The weights' compute copies one byte (their rowwise codes): laid apart from the act-dtype ones.
    w.resource<nn::ParamStore>().keep_codes_apart();
  }
  if (cfg.recipe == RecipeKind::block) return install_block(w, cfg, skipped, pipelined);  // (tokens % 16 == 0 covers its GEMMs' rows)
  // The grouped linears' meta: three slots each, after the linears'.
  // Which FP8 layers keep their input in FP8 for the backward pass.
  const std::set<nn::LinearRole> keep_roles = roles_kept_in_fp8<nn::Linear>(w, st.entities);
  struct Kept {
    std::size_t bytes = 0;
    int in = 0, layers = 0;
  };
  std::map<nn::LinearRole, Kept> kept;
  const std::set<nn::LinearRole> keep_grouped_roles = roles_kept_in_fp8<nn::GroupedLinear>(w, st.grouped_entities);
  for (std::size_t i = 0; i < st.grouped_entities.size(); ++i)
    for (auto r : {TensorRole::input, TensorRole::weight, TensorRole::grad_output})
      formats.push_back(format_for(cfg.format, r));
  st.meta = std::make_unique<Fp8MetaStore>(*st.ops, formats,
                                           cfg.recipe == RecipeKind::delayed ? cfg.amax_history_len : 1);
  st.workspace = std::make_unique<Fp8Workspace>(*st.ops);
  st.transposed = std::make_unique<Fp8Workspace>(*st.ops);
  for (std::size_t i = 0; i < st.entities.size(); ++i) {
    const Entity e = st.entities[i];
    const int first = static_cast<int>(i) * kRolesPerLinear;
    Fp8Meta meta{first, {}};
    for (int r = 0; r < kRolesPerLinear; ++r) meta.formats[static_cast<std::size_t>(r)] = formats[static_cast<std::size_t>(first + r)];
    w.emplace<Fp8Meta>(e, meta);
    const auto* name = w.try_get<Name>(e);
    const auto& linear = w.get<nn::Linear>(e);
    const bool keep = keeps_in_fp8(linear, keep_roles, pipelined);
    if (keep) {  // for the report: the colwise copy [in, tokens], one byte an element
      auto& k = kept[linear.role];
      k.bytes = static_cast<std::size_t>(tokens) * static_cast<std::size_t>(linear.in);
      k.in = linear.in;
      ++k.layers;
    }
    st.linears.push_back(std::make_unique<Fp8Linear>(*st.ops, *st.meta, first, *st.workspace, st.recipe,
                                                     name ? name->value : w.describe(e), keep));
    Fp8Linear* lin = st.linears.back().get();
    // The FP8 copies replace the compute copy of a weight only this layer reads (not the tied LM head).
    if (cfg.weights_in_compute_copy && linear.role != nn::LinearRole::lm_head) {
      st.in_compute_copy.push_back(i);  // bound once the parameters are allocated (fp8.weights)
      w.emplace<nn::ByteCompute>(linear.weight);  // gathered as FP8 codes where the masters are sharded
      // Delayed scaling knows the next forward's weight scale when the optimizer runs: the AdamW
      // step writes the FP8 copies (Fp8Linear::update_weight), the optimizer leaves the weight to us.
      if (cfg.fuse_weight_update && cfg.recipe == RecipeKind::delayed && !w.try_get<nn::UpdatedBy>(linear.weight)) {
        w.emplace<nn::UpdatedBy>(linear.weight, nn::UpdatedBy{"fp8"});
        st.fused.push_back(i);
      }
    }
    Fp8State* state = &st;
    w.emplace<ops::LinearImpl>(e, ops::LinearImpl{.forward =
                                                      [lin, state](const ops::LinearForward& a) {
                                                        lin->forward(a, state->weights_version, state->replaying);
                                                      },
                                                  .backward = [lin](const ops::LinearBackward& a) { lin->backward(a); },
                                                  .prologues = Fp8Linear::kPrologues,
                                                  .keeps_input = keep,
                                                  // A call's scale: its own amax (current scaling), or
                                                  // the history's, max-accumulating the calls' amaxes.
                                                  .pairs_on_rows = true,
                                                  .pair_rows_multiple = kGemmRowsMultiple,
                                                  .forward_pieces =
                                                      [lin, state](const ops::LinearForward& a,
                                                                   std::span<const ops::RowsOut> pieces,
                                                                   const ops::PieceQueued& queued) {
                                                        lin->forward_pieces(a, state->weights_version,
                                                                            state->replaying, pieces, queued);
                                                      },
                                                  .forward_gathered =
                                                      [lin, state](const ops::LinearForward& a, const TensorView& local,
                                                                   const ops::RowGather& g) {
                                                        lin->forward_gathered(a, local, state->weights_version,
                                                                              state->replaying, g);
                                                      }});
  }

  for (std::size_t i = 0; i < st.grouped_entities.size(); ++i) {
    const Entity e = st.grouped_entities[i];
    const int first = static_cast<int>(st.entities.size() + i) * kRolesPerLinear;
    const auto* name = w.try_get<Name>(e);
    const auto& grouped = w.get<nn::GroupedLinear>(e);
    const bool keep = keeps_in_fp8(grouped, keep_grouped_roles, pipelined);
    st.grouped.push_back(std::make_unique<Fp8GroupedLinear>(*st.ops, *st.meta, first, *st.workspace, st.recipe,
                                                            name ? name->value : w.describe(e), keep));
    Fp8GroupedLinear* lin = st.grouped.back().get();
    Fp8State* state = &st;
    w.emplace<ops::GroupedLinearImpl>(
        e, ops::GroupedLinearImpl{.forward =
                                      [lin, state](const ops::GroupedLinearForward& a) {
                                        lin->forward(a, state->grouped_version, state->replaying);
                                      },
                                  .backward = [lin](const ops::GroupedLinearBackward& a) { lin->backward(a); },
                                  .prologues = Fp8GroupedLinear::kPrologues,
                                  .keeps_input = keep});
  }

  // The optimizer's step of the weights left to us (nn::UpdatedBy), with its FP8 copies; or, with
  // sharded masters, the FP8 codes of every rank's parts of the updated weights. Runs after
  // fp8.scale_update (Phase::grad_sync), so the copies take the scales the next forward uses.
  if (!st.fused.empty() || !st.in_compute_copy.empty() || !st.grouped.empty())
    st.subscriptions.push_back(w.events().subscribe<nn::AdamWStep>([&w, &st](const nn::AdamWStep& e) {
      const auto& store = w.resource<nn::ParamStore>();
      if (!st.gathered.empty() && st.fused.empty()) {
        quantize_weight_parts(w);
      } else if (!st.gathered.empty()) {  // each rank's part of the weights, updated with its codes
        update_weight_parts(w, e);
      } else if (!st.fused.empty()) {
        st.invalidate_weights();
        st.fused_update_step = w.resource<RunControl>().step;
        for (std::size_t i : st.fused)
          st.linears[i]->update_weight(
              whole_weight_args(e, w.get<nn::Param>(w.get<nn::Linear>(st.entities[i]).weight), store),
              st.weights_version);
      }
      if (st.grouped_fused.empty()) return;  // the experts' weights (fp8.weights decides)
      ++st.grouped_version;
      st.grouped_update_step = w.resource<RunControl>().step;
      for (std::size_t i : st.grouped_fused)
        st.grouped[i]->update_weight(
            whole_weight_args(e, w.get<nn::Param>(w.get<nn::GroupedLinear>(st.grouped_entities[i]).weight), store),
            st.grouped_version);
    }));

  // A checkpoint loaded new weights and scales: the FP8 copies are made again from them.
  st.subscriptions.push_back(w.events().subscribe<nn::ParamsLoaded>([&w, &st](const nn::ParamsLoaded&) {
    if (!st.gathered.empty()) quantize_weight_parts(w);
    st.invalidate_weights();
    ++st.grouped_version;
    st.fused_update_step = -1;
    st.grouped_update_step = -1;
  }));
  save_scaling_state(w, st);

  if (pipelined && cfg.recipe == RecipeKind::current) keep_scales_per_micro_batch(w, st);

  // Activation recompute replays forwards: same scales, no second amax (see Fp8Linear).
  st.subscriptions.push_back(w.events().subscribe<nn::LayerRecomputeBegin>([&st](const nn::LayerRecomputeBegin&) {
    st.replaying = true;
  }));
  st.subscriptions.push_back(
      w.events().subscribe<nn::LayerRecomputeEnd>([&st](const nn::LayerRecomputeEnd&) { st.replaying = false; }));

  st.amax_comm = amax_communicator(w, cfg.amax_group);

  const std::size_t n_fp8 = st.entities.size(), n_all = w.view<nn::Linear>().size();
  const std::size_t g_fp8 = st.grouped.size(), g_all = w.view<nn::GroupedLinear>().size();
  w.systems().add({"fp8.report", Phase::setup, [n_fp8, n_all, g_fp8, g_all, cfg, skipped, kept, tokens](World& world) {
                     if (world.resource<RankInfo>().rank != 0) return;
                     std::cout << "fp8: " << n_fp8 << " of " << n_all << " linear layers"
                               << (g_all > 0 ? cat(" and ", g_fp8, " of ", g_all, " grouped (expert) linears") : "")
                               << " in FP8 (" << (cfg.recipe == RecipeKind::delayed ? "delayed" : "current")
                               << " scaling, " << (cfg.format == FormatPolicy::hybrid ? "hybrid E4M3/E5M2" : "E4M3")
                               << ")\n";
                     for (const auto& [role, k] : kept)  // where the model would keep the input in bf16
                       std::cout << "fp8: the " << boost::describe::enum_to_string(role, "?") << " layers keep their input in FP8 for the backward "
                                 << "pass (e4m3 [" << k.in << ", " << tokens << "]: "
                                 << static_cast<double>(k.bytes) / (1 << 20) << " MiB a layer, " << k.layers
                                 << " layers), not in bf16\n";
                     for (auto& s : skipped) std::cout << "fp8: " << skip_line(s) << "\n";
                   }});
  // The FP8 weight copies in the memory of the weights' compute copies, from their f32 masters.
  // Where the masters are sharded over ranks (nn::ParamStore::sharded), those weights' compute
  // copies are one-byte codes instead (nn::ByteCompute, attached above): every rank quantises its
  // part with the scale the ranks agree on, the parts are gathered as codes, and the layers read
  // them as the weight's rowwise copy (transposing them for the data gradient). After each optimizer
  // step the parts are quantised again (quantize_weight_parts), or, under delayed scaling with the
  // fused update, updated and quantised in one pass (update_weight_parts).
  //
  // The experts' weights (grouped linears) the same way where the masters are not sharded (sharded,
  // their compute copies are gathered in act precision and quantised by the layers), marked
  // nn::UpdatedBy here, before the first step, where their update is fused.
  const bool grouped_in_compute = cfg.weights_in_compute_copy,
             grouped_fused = cfg.weights_in_compute_copy && cfg.fuse_weight_update && cfg.recipe == RecipeKind::delayed;
  const bool parts_need_dp = cfg.recipe == RecipeKind::delayed && cfg.amax_group == AmaxGroup::tp;
  w.systems().add({"fp8.weights", Phase::setup,
                   [grouped_in_compute, grouped_fused, parts_need_dp](World& world) {
                     auto& s = world.resource<Fp8State>();
                     const auto& store = world.resource<nn::ParamStore>();
                     // Each rank records the amax of its part of a weight: the scale that quantises
                     // every part (and reads the gathered codes) needs their maximum.
                     if (store.sharded() && store.shards() > 1 && parts_need_dp && !s.in_compute_copy.empty())
                       throw ConfigError(cat(world.resource<RankInfo>().pipeline_file,
                                             ": fp8.amax_group = \"tp\" with FSDP under delayed scaling: each rank "
                                             "holds a part of every weight and would scale it by that part's amax "
                                             "alone; use \"tp_dp\" or \"world\""));
                     // Codes alone (sharded, or fp8.keep_weight_transpose = false): read as a
                     // gathered weight's, transposed for each data gradient.
                     if (store.codes_apart()) {
                       s.gathered = std::move(s.in_compute_copy);
                       s.in_compute_copy.clear();
                       for (std::size_t i : s.gathered) s.linears[i]->use_transpose_scratch(*s.transposed);
                       quantize_weight_parts(world);
                     }
                     for (std::size_t i : s.in_compute_copy) {
                       const auto& wp = world.get<nn::Param>(world.get<nn::Linear>(s.entities[i]).weight);
                       s.linears[i]->use_master_weight(store.master_view(wp), store.compute_view(wp));
                     }
                     if (store.sharded() || !grouped_in_compute) return;
                     for (std::size_t i = 0; i < s.grouped.size(); ++i) {
                       const Entity we = world.get<nn::GroupedLinear>(s.grouped_entities[i]).weight;
                       const auto& wp = world.get<nn::Param>(we);
                       s.grouped[i]->use_master_weight(store.master_view(wp), store.compute_view(wp));
                       if (grouped_fused && !world.try_get<nn::UpdatedBy>(we)) {
                         world.emplace<nn::UpdatedBy>(we, nn::UpdatedBy{"fp8"});
                         s.grouped_fused.push_back(i);
                       }
                     }
                   },
                   {"params.allocate", "model.init"}});
  // The blocks' FP8 scratch in the model's block scratch (its logits buffer), unless the LM head,
  // which writes the logits, runs in FP8 too.
  if (!cfg.lm_head) lend_block_scratch(w);
  // The scales are updated once the step's gradients are complete and synchronised (as before the
  // optimizer ran, which may now write the weights' FP8 copies with them): after the parallel
  // module's gradient collectives, so every rank issues its collectives in the same order.
  // Both replayable by a captured step (StepGraph): the amaxes' all-reduce is queued on the compute
  // stream, and the update is one kernel over the amax histories and scales on the device.
  if (cfg.recipe == RecipeKind::delayed) {
    w.systems().add({.name = "fp8.amax_reduce",
                     .phase = Phase::grad_sync,
                     .run = reduce_amaxes,
                     .after = {"parallel.tp_grad_sync"},
                     .replayable = true});
    w.systems().add({.name = "fp8.scale_update",
                     .phase = Phase::grad_sync,
                     .run = [algo = cfg.amax_compute_algo, margin = cfg.margin](World& world) {
                       auto& s = world.resource<Fp8State>();
                       s.meta->update(*s.ops, algo, margin);
                       ++s.updates;
                       world.events().publish(AmaxReduced{world.resource<RunControl>().step});
                     },
                     .after = {"fp8.amax_reduce"},
                     .replayable = true});
  }
  track_weight_updates(w, st, cfg.recipe == RecipeKind::delayed);
}

}  // namespace

void register_module(ModuleRegistry& registry) {
  registry.add(make_module<Fp8Config>("fp8", "FP8 linear layers: scaling recipes, amax reduction, FP8 GEMMs",
                                      {"model", "parallel", "backend", "train"}, install));
}

}  // namespace kiln::fp8
