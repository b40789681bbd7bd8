// Training-state checkpoints on CPU-thread ranks: a run stopped after its checkpoint and resumed
// continues bit-identically (one rank, TP x DP with dropout, FP8 delayed scaling, FSDP, async
// saves); a checkpoint loads under another layout; `keep`; partial saves; and every bad input.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/resource.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "../model/parallel_fixture.hpp"
#include "kiln/checkpoint/reader.hpp"
#include "kiln/model/hf.hpp"

using namespace kiln;
namespace fs = std::filesystem;

namespace {

using test::Trace;
using test::Sets;
using test::operator+;

const char* kTiny = R"(
[engine]
device = "cpu"
[backend]
cpu_threads = 1
[train]
steps = 8
seed = 11
batch_size = 8
seq_len = 32
[model]
n_layer = 2
n_head = 4
n_embd = 32
vocab_size = 96
max_seq_len = 32
dropout = 0.1
[optim]
lr = 3e-3
warmup_steps = 2
[data]
synthetic_vocab = 96
[parallel]
timeout_s = 60
)";

// A fresh folder for one test's checkpoints.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/kiln_ckpt_XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

Trace run(int nproc, const Sets& sets) { return test::run_ranks(kTiny, nproc, sets); }
std::string run_failing(int nproc, const Sets& sets) {
  std::string failures;
  test::run_ranks(kTiny, nproc, sets, nullptr, &failures);
  return failures;
}

Sets saving(const std::string& dir, const Sets& more = {}) { return Sets{"checkpoint.dir=" + dir} + more; }

// Runs `steps` with a checkpoint after step `stop` and an exit there, then resumes and runs to the
// end: returns the resumed run.
Trace stop_and_resume(int nproc_save, const Sets& save, int nproc_load, const Sets& load, const std::string& dir,
                      int stop) {
  run(nproc_save, save + saving(dir, {"train.exit_interval=" + std::to_string(stop)}));
  REQUIRE(checkpoint::latest_checkpoint(dir) == dir + "/" + checkpoint::step_directory_name(stop));
  return run(nproc_load, load + saving(dir));
}

void check_identical_from(const Trace& resumed, const Trace& ref, std::size_t first_step) {
  REQUIRE(resumed.loss.size() == ref.loss.size());
  for (std::size_t s = first_step; s <= ref.loss.size(); ++s) CHECK(resumed.loss[s - 1] == ref.loss[s - 1]);
  CHECK(resumed.weights == ref.weights);
}

double relative(double a, double b) { return std::fabs(a - b) / std::fabs(b); }

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void spit(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

}  // namespace

TEST_CASE("a run stopped after its checkpoint and resumed continues bit-identically: one rank, dropout") {
  TempDir d;
  const Trace ref = run(1, {});
  const Trace resumed = stop_and_resume(1, {}, 1, {}, d.path, 4);
  check_identical_from(resumed, ref, 5);
}

TEST_CASE("resumed bit-identically: TP=2 x DP=2 with dropout and sequence parallelism, async saves") {
  TempDir d;
  const Sets layout = {"parallel.tp=2", "parallel.sequence_parallel=true"};
  const Trace ref = run(4, layout);
  const Sets async = layout + Sets{"checkpoint.async=true"};
  const Trace resumed = stop_and_resume(4, async, 4, async, d.path, 4);
  check_identical_from(resumed, ref, 5);
}

TEST_CASE("resumed bit-identically: FP8 delayed scaling, the amax histories restored") {
  TempDir d;
  const Sets fp8 = {"fp8.recipe=\"delayed\"", "fp8.amax_history_len=4"};
  const Trace ref = run(1, fp8);
  const Trace resumed = stop_and_resume(1, fp8, 1, fp8, d.path, 3);
  check_identical_from(resumed, ref, 4);
  // TP=2: each rank's own scaling state back.
  TempDir d2;
  const Sets tp = fp8 + Sets{"parallel.tp=2"};
  check_identical_from(stop_and_resume(2, tp, 2, tp, d2.path, 3), run(2, tp), 4);
}

TEST_CASE("resumed bit-identically: FSDP full_shard on 4 ranks, and hybrid_shard 2 x 2") {
  for (const char* strategy : {"full_shard", "hybrid_shard"}) {
    CAPTURE(strategy);
    TempDir d;
    Sets fsdp = {std::string("fsdp.strategy=\"") + strategy + "\""};
    if (std::string(strategy) == "hybrid_shard") fsdp.push_back("fsdp.shard_size=2");
    check_identical_from(stop_and_resume(4, fsdp, 4, fsdp, d.path, 4), run(4, fsdp), 5);
  }
}

TEST_CASE("synchronous and asynchronous saves write the same files, each part once") {
  TempDir a, b;
  const Sets layout = {"parallel.tp=2", "train.steps=2"};
  run(4, layout + saving(a.path));
  run(4, layout + saving(b.path, {"checkpoint.async=true"}));
  const std::string da = a.path + "/step_000002", db = b.path + "/step_000002";
  for (int r = 0; r < 4; ++r) {
    const std::string name = "/rank_0000" + std::to_string(r) + ".bin";
    CHECK(slurp(da + name) == slurp(db + name));
  }
  // Every element of every tensor is in exactly one piece: the DP replicas split the writing.
  checkpoint::CheckpointReader reader(da);
  std::int64_t written = 0, total = 0;
  std::vector<std::uint64_t> per_file(4, 0);
  for (auto& t : reader.manifest().tensors) {
    std::int64_t n = 1;
    for (auto x : t.shape) n *= x;
    total += n;
    for (auto& p : t.pieces) {
      written += p.piece.numel();
      per_file[static_cast<std::size_t>(p.file)] += static_cast<std::uint64_t>(p.piece.numel());
    }
  }
  CHECK(written == total);
  for (auto n : per_file) CHECK(n > 0);  // both DP replicas of each TP rank write a share
  reader.verify_all();
}

TEST_CASE("a checkpoint loads under another layout: the next steps match the one-rank run to fp32 rounding") {
  const Trace ref = run(1, {});
  struct Case {
    int save_ranks;
    Sets save;
    int load_ranks;
    Sets load;
  };
  const std::vector<Case> cases = {
      {4, {"parallel.tp=2"}, 1, {}},
      {1, {}, 4, {"parallel.tp=4", "parallel.sequence_parallel=true"}},
      {4, {"fsdp.strategy=\"full_shard\""}, 2, {"fsdp.strategy=\"full_shard\""}},
      {4, {"parallel.tp=2", "fsdp.strategy=\"full_shard\""}, 4, {"parallel.tp=4", "parallel.vocab_parallel=true"}},
  };
  for (const auto& c : cases) {
    TempDir d;
    CAPTURE(c.save_ranks);
    CAPTURE(c.load_ranks);
    CAPTURE(c.load.empty() ? std::string() : c.load.front());
    const Trace resumed = stop_and_resume(c.save_ranks, c.save, c.load_ranks, c.load, d.path, 4);
    CHECK(relative(resumed.loss[4], ref.loss[4]) < 1e-6);
    for (std::size_t s = 4; s < ref.loss.size(); ++s) CHECK(relative(resumed.loss[s], ref.loss[s]) < 1e-5);
  }
}

TEST_CASE("keep removes older checkpoints once a newer one is complete, latest names the newest") {
  TempDir d;
  run(1, saving(d.path, {"checkpoint.every=2", "checkpoint.keep=2"}));
  const auto found = checkpoint::complete_checkpoints(d.path);
  REQUIRE(found.size() == 2);
  CHECK(found[0].step == 6);
  CHECK(found[1].step == 8);
  CHECK(slurp(d.path + "/latest") == "step_000008\n");
}

TEST_CASE("a save that never completed is not resumed from, and the next save clears it") {
  TempDir d;
  run(1, saving(d.path, {"train.steps=2"}));
  fs::create_directories(d.path + "/step_000009.tmp");
  spit(d.path + "/step_000009.tmp/rank_00000.bin", "partial");
  CHECK(checkpoint::latest_checkpoint(d.path) == d.path + "/step_000002");
  run(1, saving(d.path, {"train.steps=3"}));  // resumes at 2, saves 3
  CHECK(!fs::exists(d.path + "/step_000009.tmp"));
  CHECK(checkpoint::latest_checkpoint(d.path) == d.path + "/step_000003");
}

TEST_CASE("bad checkpoints are errors naming the file, tensor and rank, and change nothing") {
  TempDir d;
  run(2, saving(d.path, {"parallel.tp=2", "train.steps=2"}));
  const std::string ck = d.path + "/step_000002";
  const std::string manifest = slurp(ck + "/manifest.json");
  const std::string rank1 = slurp(ck + "/rank_00001.bin");
  const Sets resume = {"parallel.tp=2", "train.steps=3", "checkpoint.dir=" + d.path};
  auto restore = [&] {
    spit(ck + "/manifest.json", manifest);
    spit(ck + "/rank_00001.bin", rank1);
  };

  SUBCASE("a truncated shard file") {
    spit(ck + "/rank_00001.bin", rank1.substr(0, rank1.size() / 2));
    const auto e = run_failing(2, resume);
    CHECK(e.find("rank_00001.bin (rank 1's shard file) is ") != std::string::npos);
    CHECK(e.find("truncated") != std::string::npos);
  }
  SUBCASE("a flipped byte: a checksum mismatch naming the tensor") {
    std::string bad = rank1;
    bad[100] = static_cast<char>(bad[100] ^ 0x10);
    spit(ck + "/rank_00001.bin", bad);
    const auto e = run_failing(2, resume);
    CHECK(e.find("rank_00001.bin (rank 1's shard file): checksum mismatch in tensor 'model/") != std::string::npos);
  }
  SUBCASE("a missing rank's shard") {
    fs::remove(ck + "/rank_00001.bin");
    const auto e = run_failing(2, resume);
    CHECK(e.find("rank_00001.bin (rank 1's shard file) is missing") != std::string::npos);
  }
  SUBCASE("a checkpoint of another model shape") {
    const auto e = run_failing(2, resume + Sets{"model.n_embd=64"});
    CAPTURE(e);
    CHECK(e.find("tensor 'model/wte' has shape [128, 32], this model's is [128, 64]") != std::string::npos);
  }
  SUBCASE("a tensor of another dtype") {
    std::string bad = manifest;
    bad.replace(bad.find("\"f32\""), 5, "\"bf16\"");
    spit(ck + "/manifest.json", bad);
    const auto e = run_failing(2, resume);
    CHECK(e.find("manifest.json: tensor 'model/wte'.dtype: 'bf16' (only f32 is read)") != std::string::npos);
  }
  SUBCASE("a manifest that is not JSON") {
    spit(ck + "/manifest.json", manifest.substr(0, manifest.size() / 3));
    CHECK(run_failing(2, resume).find("manifest.json: not valid JSON") != std::string::npos);
  }
  SUBCASE("a directory without a manifest, named as the checkpoint to resume from") {
    fs::create_directories(d.path + "/elsewhere");
    const auto e = run_failing(2, {"parallel.tp=2", "checkpoint.resume=\"" + d.path + "/elsewhere\"", "checkpoint.dir=" + d.path});
    CHECK(e.find("has no manifest.json and holds no complete checkpoint") != std::string::npos);
  }
  // Nothing of the checkpoint was touched by the failed loads: put back, it loads.
  restore();
  checkpoint::CheckpointReader(ck).verify_all();
  CHECK(run_failing(2, resume).empty());
}

TEST_CASE("a full disk during a save is an error naming the file, the previous checkpoint stays complete") {
  TempDir d;
  run(1, saving(d.path, {"train.steps=2"}));
  // A file-size limit stands in for a full disk: writes past it fail with EFBIG.
  struct rlimit old {};
  getrlimit(RLIMIT_FSIZE, &old);
  auto previous = signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 64 * 1024;
  setrlimit(RLIMIT_FSIZE, &small);
  const auto e = run_failing(1, saving(d.path, {"train.steps=3"}));
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, previous);
  CHECK(e.find("no space left writing " + d.path + "/step_000003.tmp/rank_00000.bin") != std::string::npos);
  CHECK(checkpoint::latest_checkpoint(d.path) == d.path + "/step_000002");
  CHECK(!fs::exists(d.path + "/step_000003"));
  checkpoint::CheckpointReader(d.path + "/step_000002").verify_all();
}

TEST_CASE("exported to safetensors and read back with model.init_from, the weights are bit-identical (TP=2 too)") {
  TempDir d;
  run(1, saving(d.path, {"train.steps=2"}));
  checkpoint::CheckpointReader reader(d.path + "/step_000002");
  model::ModelConfig cfg;
  cfg.n_layer = 2;
  cfg.n_head = 4;
  cfg.n_embd = 32;
  cfg.vocab_size = 96;
  cfg.max_seq_len = 32;
  std::map<std::string, std::vector<float>> saved;
  for (auto& t : reader.manifest().tensors) {
    if (t.name.rfind("model/", 0) != 0) continue;
    checkpoint::Piece whole{std::vector<std::int64_t>(t.shape.size(), 0), t.shape, 0, 1};
    for (auto x : t.shape) whole.flat_end *= x;
    auto& v = saved[t.name.substr(6)];
    v.resize(static_cast<std::size_t>(whole.flat_end));
    reader.read(t, whole, v.data());
  }
  const std::string file = d.path + "/export/model.safetensors";
  fs::create_directories(d.path + "/export");
  interop::export_hf_gpt2(model::gpt2_shape(cfg), [&](const std::string& name) { return saved.at(name).data(); }, file);
  for (int tp : {1, 2}) {
    CAPTURE(tp);
    const Trace t = run(tp, {"parallel.tp=" + std::to_string(tp), "train.steps=0", "model.init_from=\"" + file + "\""});
    for (auto& [name, w] : saved) {
      const auto& got = t.weights.at(name);
      REQUIRE(got.size() == w.size());
      // The embedding's padding rows (vocabulary 96 padded to 128) are not exported; they start at zero.
      const std::size_t n = name == "wte" ? 96 * 32 : w.size();
      CHECK(std::equal(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(n), got.begin()));
      CHECK(std::all_of(got.begin() + static_cast<std::ptrdiff_t>(n), got.end(), [](float x) { return x == 0; }));
    }
  }
}

TEST_CASE("FP8 block scaling: resumed bit-identically, and checkpoints switch to and from delayed scaling") {
  const Sets block = {"fp8.enabled=true", "fp8.recipe=block"}, delayed = {"fp8.enabled=true", "fp8.amax_history_len=4"};
  TempDir d;
  const Trace ref = run(1, block);
  check_identical_from(stop_and_resume(1, block, 1, block, d.path, 3), ref, 4);
  // Block scaling keeps nothing in the checkpoint: a delayed-scaling checkpoint resumes under it
  // (its amax histories unread), and one of it resumes under delayed scaling, which starts afresh.
  TempDir d2, d3;
  for (const Trace& t : {stop_and_resume(1, delayed, 1, block, d2.path, 3), stop_and_resume(1, block, 1, delayed, d3.path, 3)}) {
    REQUIRE(t.loss.size() == ref.loss.size());
    for (double l : t.loss) CHECK(std::isfinite(l));
    CHECK(relative(t.loss.back(), ref.loss.back()) < 0.05);
  }
}

TEST_CASE("bf16 AdamW moments: resumed bit-identically (one rank, FSDP), checkpoints hold f32 and switch either way") {
  const Sets half = {"optim.moments=bf16"}, fsdp = half + Sets{"fsdp.strategy=\"full_shard\""};
  TempDir d, d2;
  const Trace ref = run(1, half);
  check_identical_from(stop_and_resume(1, half, 1, half, d.path, 4), ref, 5);
  check_identical_from(stop_and_resume(2, fsdp, 2, fsdp, d2.path, 4), run(2, fsdp), 5);
  // The checkpoint's moments are f32 whatever the run held: a bf16 run's are bf16 values widened.
  checkpoint::CheckpointReader reader(checkpoint::latest_checkpoint(d.path));
  std::vector<float> m;
  for (auto& t : reader.manifest().tensors) {
    if (t.name != "optimizer/exp_avg/wte") continue;
    checkpoint::Piece whole{std::vector<std::int64_t>(t.shape.size(), 0), t.shape, 0, 1};
    for (auto x : t.shape) whole.flat_end *= x;
    m.resize(static_cast<std::size_t>(whole.flat_end));
    reader.read(t, whole, m.data());
  }
  REQUIRE(!m.empty());
  std::size_t nonzero = 0;
  for (float x : m) {
    CHECK(round_bf16(x) == x);
    nonzero += x != 0.0f;
  }
  CHECK(nonzero > m.size() / 2);
  // An f32 run's checkpoint resumes with bf16 moments (rounded as they load) and a bf16 run's with
  // f32 moments (widened exactly): both continue close to the run that never switched.
  const Trace f32 = run(1, {});
  TempDir d3, d4;
  for (const Trace& t : {stop_and_resume(1, {}, 1, half, d3.path, 4), stop_and_resume(1, half, 1, {}, d4.path, 4)}) {
    REQUIRE(t.loss.size() == f32.loss.size());
    for (std::size_t s = 5; s <= t.loss.size(); ++s) CHECK(relative(t.loss[s - 1], f32.loss[s - 1]) < 1e-2);
  }
}

TEST_CASE("fp8.keep_weight_transpose = false: resumed bit-identically, the same run as with the transposes kept (TP=2 too)") {
  const Sets fp8 = {"fp8.recipe=\"delayed\"", "fp8.amax_history_len=4"}, apart = fp8 + Sets{"fp8.keep_weight_transpose=false"};
  TempDir d;
  const Trace ref = run(1, fp8);
  check_identical_from(stop_and_resume(1, apart, 1, apart, d.path, 3), ref, 4);
  const Sets tp = {"parallel.tp=2", "parallel.sequence_parallel=true"};
  const Trace tp_ref = run(2, fp8 + tp);
  const Trace tp_apart = run(2, apart + tp);
  CHECK(tp_apart.loss == tp_ref.loss);
  CHECK(tp_apart.weights == tp_ref.weights);
}

