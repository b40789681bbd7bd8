// The whole training step on CUDA against the CPU reference backend (which emulates bf16 rounding):
// same seed, so bit-identical initial weights; then loss and gradients within bf16 tolerance, and
// a few optimizer steps whose losses track each other.
#include <doctest/doctest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>

#include "kiln/checkpoint/reader.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/model/gpt.hpp"
#include "kiln/model/step_graph.hpp"
#include "kiln/nn/param_store.hpp"
#include "kiln/ops/module.hpp"
#include "kiln/train/train.hpp"
#include "kiln_test.hpp"
#include "model_fixture.hpp"

using namespace kiln;

namespace {
const char* const kModel = test::kSmallGpuModel;
}  // namespace

TEST_CASE("a CUDA training step matches the CPU reference step (GPT-2, Llama with grouped and multi-head attention)") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  const std::vector<std::vector<std::string>> archs = {
      {},
      {"model.arch=llama", "model.n_kv_head=2", "model.ffn_hidden=320", "model.tie_embeddings=false"},
      {"model.arch=llama", "model.n_kv_head=4", "model.rope_theta=500000"},
      // The LM head 100 of the 384 rows at a time (the last chunk 84), tied and untied.
      {"model.head_chunk_rows=100"},
      {"model.arch=llama", "model.n_kv_head=2", "model.tie_embeddings=false", "model.head_chunk_rows=100"},
      // The gradients held in bf16 (optim.grads), each op's contribution rounded once on both backends.
      {"optim.grads=bf16", "model.head_chunk_rows=100"},
      {"model.arch=llama", "model.n_kv_head=2", "optim.grads=bf16"}};
  for (const auto& arch : archs)
  for (const char* dropout : {"0.0", "0.1"}) {
    auto sets = [&](std::vector<std::string> s) {
      s.insert(s.end(), arch.begin(), arch.end());
      s.push_back(std::string("model.dropout=") + dropout);
      return s;
    };
    test::Pipeline cpu(kModel, sets({"engine.device=cpu", "backend.cpu_round_bf16=true"}));
    test::Pipeline gpu(kModel, sets({"engine.device=cuda"}));
    std::string what;
    for (const auto& s : sets({})) what += s + " ";
    const test::RunRecord c = test::run_recording(cpu), g = test::run_recording(gpu);
    // Initial weights are identical (init draws are bit-identical), so step 1's loss agrees closely.
    INFO(what << "losses cpu " << c.losses[0] << " gpu " << g.losses[0]);
    CHECK(g.losses[0] == doctest::Approx(c.losses[0]).epsilon(5e-3));
    const double gerr = test::rel_error(g.step1_grads, c.step1_grads);
    INFO(what << "gradient relative error " << gerr);
    CHECK(gerr < 3e-2);  // bf16 activations, different summation orders
    for (std::size_t s = 0; s < c.losses.size(); ++s) CHECK(g.losses[s] == doctest::Approx(c.losses[s]).epsilon(2e-2));
  }
}

TEST_CASE("a CUDA mixture-of-experts training step matches the CPU reference step (GELU and SwiGLU experts)") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  // A few tokens may choose another expert on one backend (bf16 against f32 activations near a tie):
  // the gradients agree more loosely than a dense model's.
  const std::vector<std::vector<std::string>> configs = {
      {"model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.hidden=256", "model.moe.capacity_factor=1.5"},
      {"model.arch=llama", "model.n_kv_head=2", "model.tie_embeddings=false", "model.moe.n_experts=8",
       "model.moe.top_k=2", "model.moe.hidden=192", "model.moe.shared_experts=1", "model.moe.expert_dropout=0.1",
       "model.dropout=0.1"},
      {"model.arch=llama", "model.n_kv_head=4", "model.moe.n_experts=6", "model.moe.top_k=3", "model.moe.hidden=128",
       "model.moe.router=sigmoid", "model.moe.every=2"}};
  for (const auto& config : configs) {
    std::string what;
    for (const auto& s : config) what += s + " ";
    auto sets = [&](std::vector<std::string> s) {
      s.insert(s.end(), config.begin(), config.end());
      return s;
    };
    test::Pipeline cpu(kModel, sets({"engine.device=cpu", "backend.cpu_round_bf16=true"}));
    test::Pipeline gpu(kModel, sets({"engine.device=cuda"}));
    const test::RunRecord c = test::run_recording(cpu), g = test::run_recording(gpu);
    INFO(what << "losses cpu " << c.losses[0] << " gpu " << g.losses[0]);
    CHECK(g.losses[0] == doctest::Approx(c.losses[0]).epsilon(5e-3));
    const double gerr = test::rel_error(g.step1_grads, c.step1_grads);
    MESSAGE(what << ": step-1 gradient relative error " << gerr << ", loss cpu " << c.losses[0] << " gpu " << g.losses[0]);
    CHECK(gerr < 6e-2);
    for (std::size_t s = 0; s < c.losses.size(); ++s) CHECK(g.losses[s] == doctest::Approx(c.losses[s]).epsilon(2e-2));
  }
}

TEST_CASE("CUDA weight initialisation is bit-identical to the CPU's (GPT-2 and Llama)") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  auto master = [](World& w) {
    auto& be = w.resource<ops::ActiveBackend>().get();
    auto flat = w.resource<nn::ParamStore>().master_flat();
    std::vector<float> h(static_cast<std::size_t>(flat.numel()));
    be.copy(TensorView(h.data(), {flat.numel()}, DType::f32, Device::cpu), flat);
    return h;
  };
  for (const std::string arch : {"gpt2", "llama"}) {
    const std::string kv = arch == "llama" ? "model.n_kv_head=2" : "model.n_kv_head=0";
    test::Pipeline cpu(kModel, {"engine.device=cpu", "model.arch=" + arch, kv});
    test::Pipeline gpu(kModel, {"engine.device=cuda", "model.arch=" + arch, kv});
    for (auto* p : {&cpu, &gpu}) p->world->systems().run(Phase::setup, *p->world);
    CHECK(master(*cpu.world) == master(*gpu.world));
  }
}

TEST_CASE("the experts' tuned GEMM algorithms change no number: losses and gradients bit-identical to the "
          "heuristic's choices (bf16 and FP8)") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  const std::vector<std::string> moe = {"engine.device=cuda",   "model.arch=llama",     "model.n_kv_head=2",
                                        "model.moe.n_experts=8", "model.moe.top_k=2", "model.moe.hidden=192"};
  for (const char* fp8 : {"fp8.enabled=false", "fp8.enabled=true"}) {
    auto sets = [&](const char* tune) {
      std::vector<std::string> s = moe;
      s.push_back(fp8);
      s.push_back(tune);
      return s;
    };
    test::Pipeline tuned(kModel, sets("backend.grouped_gemm_tune=true"));
    test::Pipeline plain(kModel, sets("backend.grouped_gemm_tune=false"));
    const test::RunRecord t = test::run_recording(tuned), p = test::run_recording(plain);
    INFO(fp8);
    CHECK(t.losses == p.losses);
    CHECK(t.step1_grads == p.step1_grads);
  }
}

// backend.cuda_graph: the captured and replayed steps compute exactly what eager steps do (losses and
// the final weights bit for bit over 6 steps, 4 of them replays), with dropout (so every replay drew
// fresh masks, as the eager steps did), two micro-batches (a graph each), recompute, FP8 and FSDP.
// On one rank the last micro-batch's graph holds the gradient clipping, the FP8 scale update and
// the optimizer too (the learning rate moves every step: cosine over 6 steps), FSDP's one-rank
// shard groups included (nothing to gather or reduce).
TEST_CASE("a captured CUDA graph of the whole step replays eager steps bit for bit") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  const std::vector<std::vector<std::string>> cases = {
      {"model.dropout=0.1"},
      {"model.dropout=0.1", "train.micro_batch_size=2"},
      {"model.dropout=0.1", "activation_checkpoint.mode=full"},
      {"fp8.enabled=true", "train.micro_batch_size=2"},
      {"fp8.enabled=true", "fp8.recipe=current", "model.dropout=0.1"},
      {"model.arch=llama", "model.n_kv_head=2", "fp8.enabled=true", "activation_checkpoint.mode=selective"},
      // An [fsdp] section on one rank (whole units, nothing gathered) no longer keeps the steps
      // eager; two ranks' FSDP is tests/parallel/gpu_graph_ranks_test.sh's.
      {"fsdp.strategy=full_shard", "model.dropout=0.1", "train.micro_batch_size=2"},
      {"fsdp.strategy=shard_grad_op", "fp8.enabled=true", "fsdp.reduce=step", "train.micro_batch_size=2"},
      {"model.head_chunk_rows=100", "fp8.enabled=true", "model.dropout=0.1", "train.micro_batch_size=2"},
      {"fp8.enabled=true", "fp8.recipe=block", "model.dropout=0.1"},
      {"fp8.enabled=true", "fp8.fuse_weight_update=false", "optim.warmup_steps=4"},
      // AdamW's moments in bf16: the flat AdamW and the fused FP8 updates, per-tensor and block.
      {"optim.moments=bf16", "fp8.enabled=true", "model.dropout=0.1"},
      {"optim.moments=bf16", "fp8.enabled=true", "fp8.recipe=block"},
      // The FP8 weights' rowwise codes alone, transposed in each backward.
      {"fp8.enabled=true", "fp8.keep_weight_transpose=false", "model.dropout=0.1", "train.micro_batch_size=2"},
      // Block-scaled layers keeping their inputs' transposes from the forward.
      {"fp8.enabled=true", "fp8.recipe=block", "model.recompute_norm=false", "model.recompute_gelu=false",
       "train.micro_batch_size=2"},
      // An FP8 LM head a chunk of rows at a time (112 of the 384 rows, the last chunk 48; of a micro-
      // batch's 192, the last 80), per-tensor and block-scaled.
      {"model.head_chunk_rows=112", "fp8.enabled=true", "fp8.lm_head=true", "train.micro_batch_size=2"},
      {"model.head_chunk_rows=112", "fp8.enabled=true", "fp8.lm_head=true", "fp8.recipe=block"},
      // The gradients held in bf16 (optim.grads): their zeroing, the bf16 GEMM and FP8 weight
      // gradients, the FP8 head's, the norm and the updates reading them.
      {"optim.grads=bf16", "model.dropout=0.1", "train.micro_batch_size=2"},
      {"optim.grads=bf16", "optim.moments=bf16", "fp8.enabled=true", "fp8.lm_head=true", "model.head_chunk_rows=112",
       "model.recompute_norm=false", "model.recompute_gelu=false"},
  };
  for (const auto& extra : cases) {
    auto sets = [&](bool graph) {
      std::vector<std::string> s = {"engine.device=cuda", graph ? "backend.cuda_graph=true" : "backend.cuda_graph=false"};
      s.insert(s.end(), extra.begin(), extra.end());
      return s;
    };
    std::string what;
    for (const auto& e : extra) what += e + " ";
    INFO(what);
    test::Pipeline graphed(kModel, sets(true));
    test::Pipeline eager(kModel, sets(false));
    const test::RunRecord g = test::run_recording(graphed), e = test::run_recording(eager);
    const auto* steps = graphed.world->try_resource<model::StepGraph>();
    REQUIRE(steps);
    CHECK(steps->graphs() == graphed.world->resource<RunControl>().micro_batches);
    CHECK(steps->through_optimizer());
    REQUIRE(g.losses.size() == 6);
    CHECK(g.losses == e.losses);
    CHECK(g.step1_grads == e.step1_grads);
    auto weights = [](World& w) {
      auto& be = w.resource<ops::ActiveBackend>().get();
      const TensorView flat = w.resource<nn::ParamStore>().master_flat();
      std::vector<float> h(static_cast<std::size_t>(flat.numel()));
      be.copy(TensorView(h.data(), {flat.numel()}, DType::f32, Device::cpu), flat);
      return h;
    };
    CHECK(weights(*graphed.world) == weights(*eager.world));
  }
}

// fp8.keep_weight_transpose = false: the FP8 weights' compute copies are their rowwise codes alone
// (one byte), each data gradient transposing them into scratch: the transposed codes are the kept
// colwise copy's, so the losses and every final weight are the same bits (weight by weight: the
// one-byte weights are laid out apart, so the flat buffers' orders differ).
TEST_CASE("FP8 weights held as their rowwise codes alone train the same bits on CUDA, in a smaller compute copy") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  const std::vector<std::vector<std::string>> cases = {
      {"model.dropout=0.1"},
      {"fp8.recipe=current", "train.micro_batch_size=2"},
      {"fp8.fuse_weight_update=false", "optim.moments=bf16"},
      {"model.arch=llama", "model.n_kv_head=2", "activation_checkpoint.mode=selective"},
  };
  for (const auto& extra : cases) {
    std::string what;
    for (const auto& e : extra) what += e + " ";
    INFO(what);
    auto sets = [&](bool kept) {
      std::vector<std::string> s = {"engine.device=cuda", "fp8.enabled=true",
                                    std::string("fp8.keep_weight_transpose=") + (kept ? "true" : "false")};
      s.insert(s.end(), extra.begin(), extra.end());
      return s;
    };
    test::Pipeline kept(kModel, sets(true)), apart(kModel, sets(false));
    const test::RunRecord a = test::run_recording(kept), b = test::run_recording(apart);
    REQUIRE(a.losses.size() == 6);
    CHECK(a.losses == b.losses);
    auto master = [](World& w) {
      auto& be = w.resource<ops::ActiveBackend>().get();
      const auto& store = w.resource<nn::ParamStore>();
      std::map<std::string, std::vector<float>> out;
      for (Entity e : store.order()) {
        const auto& p = w.get<nn::Param>(e);
        auto& h = out[p.name];
        h.resize(static_cast<std::size_t>(p.numel));
        be.copy(TensorView(h.data(), p.shape, DType::f32, Device::cpu), store.master_view(p));
      }
      return out;
    };
    CHECK(master(*kept.world) == master(*apart.world));
    const auto& ks = kept.world->resource<nn::ParamStore>();
    const auto& as = apart.world->resource<nn::ParamStore>();
    CHECK(as.held_compute_bytes(DType::bf16) < ks.held_compute_bytes(DType::bf16));
  }
}

// With recompute_norm / recompute_gelu off, the FP8 layers keep their inputs' FP8 copies (per-tensor:
// the colwise codes; block: the transpose in 1x128 blocks along the tokens, or 128x128) from the
// forward, computing a LayerNorm or the activation on load: the codes the backward would make, so the
// losses and the first step's gradients are the same bits on CUDA as where the inputs are recomputed.
TEST_CASE("FP8 layers keeping their inputs in FP8 train the same bits on CUDA as recomputing them") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  const std::vector<std::vector<std::string>> cases = {
      {"fp8.recipe=block"},
      {"fp8.recipe=block", "model.arch=llama", "model.n_kv_head=2", "train.micro_batch_size=2"},
      {"fp8.recipe=block", "fp8.block_2d_wgrad_input=true", "model.dropout=0.1"},
      {"fp8.recipe=delayed", "model.dropout=0.1"},
      {"fp8.recipe=current", "model.arch=llama", "model.n_kv_head=2"},
  };
  for (const auto& extra : cases) {
    std::string what;
    for (const auto& e : extra) what += e + " ";
    INFO(what);
    auto sets = [&](bool stored) {
      std::vector<std::string> s = {"engine.device=cuda", "fp8.enabled=true",
                                    std::string("model.recompute_norm=") + (stored ? "false" : "true"),
                                    std::string("model.recompute_gelu=") + (stored ? "false" : "true")};
      s.insert(s.end(), extra.begin(), extra.end());
      return s;
    };
    test::Pipeline recomputed(kModel, sets(false)), kept(kModel, sets(true));
    const test::RunRecord a = test::run_recording(recomputed), b = test::run_recording(kept);
    REQUIRE(a.losses.size() == 6);
    CHECK(a.losses == b.losses);
    CHECK(a.step1_grads == b.step1_grads);
  }
}

// The eager work a captured run does between replays: a validation pass every other step (the
// model's evaluation forward on the eager stream, the FP8 layers reading the copies the replayed
// optimizer wrote) and a training-state checkpoint at step 4 (the weights, moments and FP8 scaling
// state read back after a replay). Training and validation losses and the final weights equal the
// eager run's bit for bit; the checkpoint holds the same bytes.
TEST_CASE("a captured whole step with validation and a checkpoint between replays equals eager steps") {
  if (!ops::cuda_available()) KILN_SKIP_TEST("no CUDA device is visible");
  test::TempDir dir("graph-eager-between");
  const std::string train = test::pattern_corpus(dir);
  const std::string val = (dir.path() / "shards/val_*.bin").string();
  for (const char* fp8 : {"false", "true"}) {
    INFO("fp8 " << fp8);
    struct Run {
      std::vector<double> losses, val_losses;
      std::vector<float> weights;
      std::string checkpoint;
    };
    auto run = [&](bool graph) {
      const std::string ckpt = (dir.path() / (std::string("ckpt-") + fp8 + (graph ? "-graph" : "-eager"))).string();
      test::Pipeline p(kModel, {"engine.device=cuda", std::string("backend.cuda_graph=") + (graph ? "true" : "false"),
                                "data.synthetic_vocab=0", "data.train_files=" + train, "data.val_files=" + val,
                                "model.vocab_size=256", "log.val_every=2", "model.dropout=0.1",
                                std::string("fp8.enabled=") + fp8, "checkpoint.dir=" + ckpt, "checkpoint.every=4"});
      Run r;
      p.world->systems().add({"test.record", Phase::step_end,
                              [&r](World& world) {
                                const auto& ts = world.resource<train::TrainState>();
                                r.losses.push_back(ts.loss);
                                if (ts.val_loss) r.val_losses.push_back(*ts.val_loss);
                              },
                              {"train.step_end"}});
      p.run();
      if (graph) {
        const auto* steps = p.world->try_resource<model::StepGraph>();
        REQUIRE(steps);
        CHECK(steps->graphs() == 1);
        CHECK(steps->through_optimizer());
      }
      auto& be = p.world->resource<ops::ActiveBackend>().get();
      const TensorView flat = p.world->resource<nn::ParamStore>().master_flat();
      r.weights.resize(static_cast<std::size_t>(flat.numel()));
      be.copy(TensorView(r.weights.data(), {flat.numel()}, DType::f32, Device::cpu), flat);
      r.checkpoint = checkpoint::latest_checkpoint(ckpt);
      return r;
    };
    const Run g = run(true), e = run(false);
    REQUIRE(g.losses.size() == 6);
    CHECK(g.losses == e.losses);
    REQUIRE(g.val_losses.size() >= 3);
    CHECK(g.val_losses == e.val_losses);
    CHECK(g.weights == e.weights);
    REQUIRE(!g.checkpoint.empty());
    REQUIRE(!e.checkpoint.empty());
    auto bytes = [](const std::filesystem::path& f) {
      std::ifstream in(f, std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    };
    const std::string shard = "rank_00000.bin";  // every tensor and blob the one rank saved
    REQUIRE(std::filesystem::exists(std::filesystem::path(e.checkpoint) / shard));
    CHECK(bytes(std::filesystem::path(g.checkpoint) / shard) == bytes(std::filesystem::path(e.checkpoint) / shard));
  }
}

