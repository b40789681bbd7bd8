// The fp8 engine module on the CPU backend: which linears it takes over, the once-per-step amax
// reduction and update, shared scales across ranks, and FP8 training that ends within 2% of the
// fp32 and bf16 runs' losses.
#include <doctest/doctest.h>

#include <boost/describe/enum_to_string.hpp>

#include <cmath>
#include <map>
#include <mutex>
#include <numeric>

#include "../model/model_fixture.hpp"
#include "fp8_test_util.hpp"
#include "kiln/data/tokenizer.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/fp8/module.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/nn/components.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/linear_impl.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/parallel/thread_ranks.hpp"
#include "kiln/parallel/module.hpp"
#include "kiln/train/train.hpp"
#include "kiln_test.hpp"

using namespace kiln;

namespace {

const char* kTiny = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 2
[train]
steps = 3
seed = 7
batch_size = 4
seq_len = 16
[model]
n_layer = 3
n_head = 2
n_embd = 32
vocab_size = 64
max_seq_len = 16
[optim]
[data]
synthetic_vocab = 64
[parallel]
timeout_s = 60
)";

std::vector<std::string> fp8_roles(World& w) {
  std::vector<std::string> out;
  for (Entity e : w.view<nn::Linear>())
    if (w.has<ops::LinearImpl>(e)) {
      CHECK(w.has<fp8::Fp8Meta>(e));
      const auto& l = w.get<nn::Linear>(e);
      out.push_back(std::to_string(l.unit) + ":" + boost::describe::enum_to_string(l.role, "?"));
    }
  return out;
}

std::vector<float> host_copy(const TensorView& v) { return std::vector<float>(v.as<float>(), v.as<float>() + v.numel()); }

}  // namespace

TEST_CASE("--set fp8.enabled=true turns the block linears into FP8 GEMMs, the LM head stays unless asked") {
  {
    test::Pipeline p(kTiny, {"fp8.enabled=true"});
    auto roles = fp8_roles(*p.world);
    CHECK(roles.size() == 12);  // 3 blocks x (qkv, attn_out, mlp_in, mlp_out)
    CHECK(std::find(roles.begin(), roles.end(), "4:lm_head") == roles.end());
    auto& st = p.world->resource<fp8::Fp8State>();
    CHECK(st.meta->size() == 36);
    CHECK(st.meta->history_len() == 1024);
    // Hybrid: inputs and weights E4M3, gradients E5M2.
    const auto& m = p.world->get<fp8::Fp8Meta>(st.entities[1]);
    CHECK(m.first_slot == 3);
    CHECK(m.formats[0] == fp8::Format::e4m3);
    CHECK(m.formats[1] == fp8::Format::e4m3);
    CHECK(m.formats[2] == fp8::Format::e5m2);
  }
  {
    test::Pipeline p(kTiny, {"fp8.enabled=true", "fp8.lm_head=true", "fp8.format=e4m3"});
    auto roles = fp8_roles(*p.world);
    CHECK(roles.size() == 13);
    CHECK(std::find(roles.begin(), roles.end(), "4:lm_head") != roles.end());
    auto& st = p.world->resource<fp8::Fp8State>();
    for (auto f : st.meta->formats()) CHECK(f == fp8::Format::e4m3);
  }
  {
    test::Pipeline p(kTiny, {"fp8.enabled=true", "fp8.first_last_bf16=true"});
    auto roles = fp8_roles(*p.world);
    CHECK(roles == std::vector<std::string>{"2:qkv", "2:attn_out", "2:mlp_in", "2:mlp_out"});
  }
  {
    test::Pipeline p(kTiny, {"fp8.enabled=false"});
    CHECK(fp8_roles(*p.world).empty());
    CHECK(!p.world->has_resource<fp8::Fp8State>());
  }
  {
    test::Pipeline p(kTiny);  // no [fp8] section: the module is not even installed
    CHECK(fp8_roles(*p.world).empty());
  }
  {  // An FP8 head takes chunks of rows (model.head_chunk_rows), as the backend's does.
    test::Pipeline p(kTiny, {"fp8.enabled=true", "fp8.lm_head=true", "model.head_chunk_rows=16"});
    p.world->systems().run(Phase::setup, *p.world);
    test::Pipeline blocks_only(kTiny, {"fp8.enabled=true", "model.head_chunk_rows=8"});
    blocks_only.world->systems().run(Phase::setup, *blocks_only.world);
  }
  CHECK_THROWS_WITH_AS(test::Pipeline(kTiny, {"fp8.enabled=true", "fp8.recipe=sometimes"}),
                       doctest::Contains("sometimes"), ConfigError);
  CHECK_THROWS_WITH_AS(test::Pipeline(kTiny, {"fp8.amax_history_len=0"}), doctest::Contains("amax_history_len"),
                       ConfigError);
}

TEST_CASE("an FP8 LM head a chunk of rows at a time: one chunk is the whole head bit for bit, smaller ones within "
          "FP8's rounding") {
  // kTiny's micro-batch is 64 tokens. Chunks of 48 (the last of 16) quantise each chunk's dlogits
  // apart: by its own amax (current scaling), or by the history's scale (delayed; at the first step,
  // before any history, by the first chunk's amax), their amaxes max-accumulated.
  auto losses = [](std::vector<std::string> sets) {
    test::Pipeline p(kTiny, sets);
    return test::step_losses(p);
  };
  for (const char* recipe : {"fp8.recipe=delayed", "fp8.recipe=current"}) {
    CAPTURE(recipe);
    const std::vector<std::string> head = {"fp8.enabled=true", "fp8.lm_head=true", recipe};
    const auto whole = losses(head);
    auto with = [&](const char* more) {
      auto s = head;
      s.emplace_back(more);
      return losses(s);
    };
    CHECK(with("model.head_chunk_rows=64") == whole);
    const auto chunks = with("model.head_chunk_rows=48");
    REQUIRE(chunks.size() == whole.size());
    for (std::size_t i = 0; i < whole.size(); ++i) CHECK(chunks[i] == doctest::Approx(whole[i]).epsilon(1e-3));
    CHECK(chunks != whole);  // the chunks did quantise apart
  }
  // An FP8 weight gradient's inner dimension is the chunk's tokens: a multiple of 16, said naming the key.
  test::Pipeline odd(kTiny, {"fp8.enabled=true", "fp8.lm_head=true", "model.head_chunk_rows=24"});
  CHECK_THROWS_WITH_AS(odd.world->systems().run(Phase::setup, *odd.world),
                       doctest::Contains("model.head_chunk_rows = 24"), ConfigError);
}

TEST_CASE("delayed scaling: one reduction and update per step, the history rolls once per step") {
  test::Pipeline p(kTiny, {"fp8.enabled=true", "fp8.amax_history_len=4", "train.micro_batch_size=2"});
  auto& w = *p.world;
  int events = 0;
  auto sub = w.events().subscribe<fp8::AmaxReduced>([&events](const fp8::AmaxReduced&) { ++events; });
  std::vector<std::vector<float>> history;
  w.systems().add({"test.meta", Phase::step_end, [&history](World& world) {
                     history.push_back(host_copy(world.resource<fp8::Fp8State>().meta->history()));
                   }});
  p.run();
  auto& st = w.resource<fp8::Fp8State>();
  CHECK(events == 3);
  CHECK(st.updates == 3);
  CHECK(w.resource<RunControl>().micro_batches == 2);
  REQUIRE(history.size() == 3);
  const int n = st.meta->size();
  // After step s, rows 1..s hold steps s..1 and every slot saw a non-zero amax; row 0 (step s + 1)
  // is empty but for the weights, whose FP8 copies for step s + 1 the optimizer's step already made.
  for (int i = 0; i < n; ++i) {
    if (i % fp8::kRolesPerLinear == static_cast<int>(fp8::TensorRole::weight))
      CHECK(history[2][i] > 0.0f);
    else
      CHECK(history[2][i] == 0.0f);
    CHECK(history[2][n + i] > 0.0f);
    CHECK(history[2][2 * n + i] == history[1][n + i]);
    CHECK(history[2][3 * n + i] == history[0][n + i]);
  }
  // Every scale was set from an amax: fp8_max / amax (margin 0) of the step history's max.
  const auto scales = host_copy(st.meta->scales());
  for (int i = 0; i < n; ++i) {
    float amax = 0;
    for (int h = 1; h < 4; ++h) amax = std::max(amax, history[2][h * n + i]);
    CHECK(scales[i] == fp8::compute_scale(st.meta->slot(i).fp8_max, amax, 0, 0.0f));
  }
}

TEST_CASE("the amaxes are reduced over the amax group: tp_dp ranks share every scale") {
  auto run = [](const std::string& group, bool sequence_parallel = false) {
    ModuleRegistry reg;
    register_builtin_modules(reg);
    auto doc = config::parse_toml_text(kTiny, "tiny.toml");
    config::apply_overrides(doc, {"parallel.tp=2", "backend.cpu_threads=1", "fp8.enabled=true",
                                  "fp8.amax_group=" + group,
                                  std::string("parallel.sequence_parallel=") + (sequence_parallel ? "true" : "false")});
    auto cfg = config::resolve(doc, "tiny.toml", reg);
    auto m = std::make_shared<std::mutex>();
    std::map<int, std::vector<float>> scales;
    auto outcomes = parallel::run_thread_ranks(4, cfg, reg, {}, [&](World& w) {
      std::lock_guard lk(*m);
      scales[w.resource<RankInfo>().rank] = host_copy(w.resource<fp8::Fp8State>().meta->scales());
    });
    INFO(parallel::describe_failures(outcomes));
    for (auto& o : outcomes) REQUIRE(o.ok);
    return scales;
  };
  auto shared = run("tp_dp");
  REQUIRE(shared.size() == 4);
  for (int r = 1; r < 4; ++r) CHECK(test::same_bits(shared[r], shared[0]));
  auto sp = run("tp_dp", true);  // sequence parallelism: the linears still see all tokens
  for (int r = 1; r < 4; ++r) CHECK(test::same_bits(sp[r], sp[0]));
  // Over tp only, the two data-parallel halves (ranks 0,1 and 2,3) saw different data.
  auto tp_only = run("tp");
  CHECK(test::same_bits(tp_only[1], tp_only[0]));
  CHECK(test::same_bits(tp_only[3], tp_only[2]));
  CHECK(!test::same_bits(tp_only[2], tp_only[0]));
}

TEST_CASE("FP8 training on the CPU ends within 2% of the fp32 and the bf16 runs' losses (delayed and current scaling)") {
  test::TempDir dir("fp8-train");
  const std::string shards = test::pattern_corpus(dir);
  const auto ref = test::train_losses(shards, 60);
  const auto delayed = test::train_losses(shards, 60, {"fp8.enabled=true"});
  const auto current = test::train_losses(shards, 60, {"fp8.enabled=true", "fp8.recipe=current"});
  REQUIRE(ref.size() == 60);
  const double r = test::tail_mean(ref, 5), d = test::tail_mean(delayed, 5), c = test::tail_mean(current, 5);
  MESSAGE("final loss (mean of the last 5 steps): fp32 " << r << ", fp8 delayed " << d << ", fp8 current " << c
                                                          << "; first losses " << ref[0] << " / " << delayed[0] << " / "
                                                          << current[0]);
  CHECK(ref.back() < ref.front() - 2.0);  // it learned
  CHECK(std::fabs(d - r) / r < 0.02);
  CHECK(std::fabs(c - r) / r < 0.02);
  // FP8 does change the numbers.
  CHECK(delayed != ref);

  // The same against the bf16 run: activations rounded to bf16 where the CUDA backend stores bf16,
  // in the reference and in both FP8 runs.
  const std::string bf16 = "backend.cpu_round_bf16=true";
  const double rb = test::tail_mean(test::train_losses(shards, 60, {bf16}), 5);
  const double db = test::tail_mean(test::train_losses(shards, 60, {bf16, "fp8.enabled=true"}), 5);
  const double cb = test::tail_mean(test::train_losses(shards, 60, {bf16, "fp8.enabled=true", "fp8.recipe=current"}), 5);
  MESSAGE("with bf16 activations: bf16 " << rb << ", fp8 delayed " << db << ", fp8 current " << cb);
  CHECK(std::fabs(db - rb) / rb < 0.02);
  CHECK(std::fabs(cb - rb) / rb < 0.02);
}

TEST_CASE("with backend.profile, the FP8 kernels appear in the per-op breakdown") {
  test::Pipeline p(kTiny, {"fp8.enabled=true", "backend.profile=true"});
  p.run();
  std::map<std::string, std::int64_t> calls;
  for (auto& t : p.world->resource<ops::ActiveBackend>().get().op_times()) calls[t.op] = t.calls;
  // Steps 2 and 3 (the first is left out): 12 FP8 linears, each with a forward GEMM and, in the
  // backward pass, a data-gradient and a weight-gradient GEMM. FC1 writes its pre-activation (a
  // plain GEMM with bias) and FC2 applies the GELU while quantising its input.
  CHECK(calls["fp8_gemm_forward"] == 2 * 12);
  CHECK(calls["fp8_gemm_forward_gelu"] == 0);
  CHECK(calls["fp8_gemm_wgrad"] == 2 * 12);
  CHECK(calls["fp8_gemm_dgrad"] == 2 * 12);
  // The inputs in the forward pass: QKV's and FC1's computed from the residual as they are read
  // (the LayerNorm's statistics first), the attention projection's quantised.
  CHECK(calls["fp8_quantize_rowwise"] == 2 * 3);
  CHECK(calls["fp8_layernorm_stats"] == 2 * 6);
  CHECK(calls["fp8_quantize_layernorm_rowwise"] == 2 * 6);
  CHECK(calls["fp8_quantize_gelu_rowwise"] == 2 * 3);  // FC2's: gelu(FC1's pre-activation)
  // The weights: the optimizer's step writes their FP8 copies (delayed scaling), once per step.
  CHECK(calls["fp8_quantize_both"] == 0);
  CHECK(calls["fp8_adamw_quantize"] == 2 * 12);
  // The output gradients with their bias gradients, FC1's with the dGELU of FC2's input gradient.
  CHECK(calls["fp8_quantize_grad_dbias"] == 2 * 9);
  CHECK(calls["fp8_quantize_grad_dgelu_dbias"] == 2 * 3);
  CHECK(calls["fp8_bias_grad"] == 0);
  CHECK(calls["fp8_dgelu"] == 0);
  CHECK(calls["gelu_forward"] == 0);  // no GELU output is recomputed either
  // The inputs again, transposed, for the weight gradient: QKV's and FC1's computed from the
  // LayerNorm's input and statistics as they are read (no LayerNorm output is recomputed).
  CHECK(calls["fp8_quantize_colwise"] == 2 * 3);
  CHECK(calls["fp8_quantize_layernorm_colwise"] == 2 * 6);
  CHECK(calls["layernorm_forward"] == 2 * 1);  // the final LayerNorm (before the bf16 LM head) alone
  CHECK(calls["fp8_quantize_gelu_colwise"] == 2 * 3);
  CHECK(calls["fp8_scale_update"] == 2);
  CHECK(calls["linear_forward"] > 0);  // the LM head stays in bf16
}

TEST_CASE("bf16 AdamW moments: the fused FP8 weight update equals the unfused one, and training stays close to f32 moments") {
  // optim.moments = "bf16": every update (the optimizer's flat AdamW, the fp8 module's fused
  // per-tensor, block-scaled and stacked experts' updates) reads the moments as f32 and stores them
  // rounded, so fusing changes nothing but the passes.
  test::TempDir dir("fp8-bf16-moments");
  const std::string shards = test::pattern_corpus(dir);
  const std::vector<std::string> half = {"optim.moments=bf16", "fp8.enabled=true"};
  const std::vector<std::vector<std::string>> runs = {
      {"fp8.recipe=delayed"},
      {"fp8.recipe=block", "backend.cpu_round_bf16=true"},
      {"model.arch=llama", "model.n_kv_head=1", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.hidden=32"}};
  for (const auto& run : runs) {
    INFO(run.front());
    auto with = [&](std::vector<std::string> sets) {
      sets.insert(sets.end(), run.begin(), run.end());
      return test::train_losses(shards, 8, sets);
    };
    auto bf16 = half;
    const auto base = with(bf16);
    REQUIRE(base.size() == 8);
    bf16.push_back("fp8.fuse_weight_update=false");
    CHECK(base == with(bf16));
    if (run.front() != "fp8.recipe=delayed") continue;
    // Not the f32 moments' run, but within rounding of it.
    const auto f32 = with({"fp8.enabled=true"});
    CHECK(base != f32);
    for (std::size_t i = 0; i < base.size(); ++i) CHECK(std::fabs(base[i] - f32[i]) < 1e-2 * f32[i]);
  }
}

TEST_CASE("fp8.keep_weight_transpose = false: the weights' rowwise codes alone give the same losses, in less memory") {
  // The compute copies of the FP8 weights are one byte (their rowwise codes, laid apart from the
  // act-dtype weights); each data gradient transposes them, which gives the very colwise codes the
  // kept copy holds: every loss the same bits.
  test::TempDir dir("fp8-no-transpose");
  const std::string shards = test::pattern_corpus(dir);
  const std::vector<std::vector<std::string>> runs = {
      {"fp8.recipe=delayed", "model.dropout=0.1", "activation_checkpoint.mode=full"},
      {"fp8.recipe=current"},
      {"fp8.fuse_weight_update=false", "optim.moments=bf16"},
      {"model.arch=llama", "model.n_kv_head=1", "model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.hidden=32"}};
  for (const auto& run : runs) {
    INFO(run.front());
    std::vector<std::string> sets = {"fp8.enabled=true"};
    sets.insert(sets.end(), run.begin(), run.end());
    const auto base = test::train_losses(shards, 8, sets);
    REQUIRE(base.size() == 8);
    sets.push_back("fp8.keep_weight_transpose=false");
    CHECK(base == test::train_losses(shards, 8, sets));
  }
  auto compute_bytes = [&](std::vector<std::string> sets) {
    sets.push_back("fp8.enabled=true");
    test::Pipeline p(kTiny, sets);
    p.run();
    const auto& store = p.world->resource<nn::ParamStore>();
    return std::pair{store.held_compute_bytes(DType::f32), store.held()};
  };
  const auto [kept, held] = compute_bytes({});
  const auto [apart, held_apart] = compute_bytes({"fp8.keep_weight_transpose=false"});
  MESSAGE("compute copy bytes: transposes kept " << kept << ", rowwise codes alone " << apart);
  CHECK(held == held_apart);
  CHECK(apart < kept);
  CHECK(kept - apart >= 3 * static_cast<std::size_t>(held) / 2);  // most of the weights are FP8: 3 of 4 bytes less
  // Block scaling keeps its own transposed codes: refused, naming the key.
  CHECK_THROWS_WITH(compute_bytes({"fp8.recipe=block", "fp8.keep_weight_transpose=false"}),
                    doctest::Contains("fp8.keep_weight_transpose"));
}

TEST_CASE("FP8 layers keep their inputs in FP8 where the model would store them in bf16: same losses, less memory") {
  // With recompute_norm / recompute_gelu off the model would keep the LayerNorm and GELU outputs in
  // act precision for QKV, FC1 and FC2 alone; FP8 layers keep their colwise FP8 copies instead (the
  // very codes the backward pass would quantise again), so training is bit-identical to the run that
  // recomputes those outputs, and the model stores less than without FP8.
  test::TempDir dir("fp8-keep");
  const std::string shards = test::pattern_corpus(dir);
  const std::vector<std::string> stored = {"model.recompute_norm=false", "model.recompute_gelu=false"};
  const int steps = test::equivalence_step_count(12);
  for (const char* recipe : {"delayed", "current"}) {
    INFO("recipe " << recipe);
    auto with = [&](std::vector<std::string> sets) {
      sets.insert(sets.end(), {"fp8.enabled=true", std::string("fp8.recipe=") + recipe});
      return test::train_losses(shards, steps, sets);
    };
    const auto base = with({});
    CHECK(base == with(stored));
    // The FP8 weights made from the master into the compute copy's memory: on the CPU the compute
    // copy equals the master, so nothing changes but where they live.
    CHECK(base == with({"fp8.weights_in_compute_copy=false"}));
    // The optimizer's step writing the FP8 weights (delayed scaling) changes nothing but the passes.
    CHECK(base == with({"fp8.fuse_weight_update=false"}));
    // Activation recompute on top: replays refill the kept copies with the same codes.
    for (const char* ckpt : {"activation_checkpoint.mode=full", "activation_checkpoint.selective=attention",
                             "activation_checkpoint.selective=mlp"}) {
      INFO(ckpt);
      auto sets = stored;
      sets.push_back(ckpt);
      if (std::string(ckpt).find("selective=") != std::string::npos) sets.push_back("activation_checkpoint.mode=selective");
      CHECK(base == with(sets));
    }
  }
  auto bytes = [&](std::vector<std::string> sets) {  // the model's activations and the layers' kept copies
    test::Pipeline p(kTiny, sets);
    p.run();
    std::size_t kept = 0;
    if (auto* st = p.world->try_resource<fp8::Fp8State>())
      for (const auto& l : st->linears) kept += l->kept_bytes();
    return p.world->resource<model::GptModel>().activation_bytes() + kept;
  };
  auto fp8_stored = stored;
  fp8_stored.push_back("fp8.enabled=true");
  const auto b_bf16 = bytes(stored), b_fp8 = bytes(fp8_stored), b_recompute = bytes({});
  MESSAGE("activation bytes: stored " << b_bf16 << ", FP8 kept " << b_fp8 << ", recomputed " << b_recompute);
  CHECK(b_recompute < b_fp8);
  CHECK(b_fp8 < b_bf16);
}
