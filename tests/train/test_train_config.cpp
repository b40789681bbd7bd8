// The train section: validation when the pipeline is read (each error names the key and its line),
// and the checks that need the ranks, made when the module is installed.
#include <doctest/doctest.h>

#include <string>

#include "kiln/parallel/thread_ranks.hpp"
#include "train_fixture.hpp"

using namespace kiln;

namespace {

// The ConfigError of reading a pipeline ("" if it reads).
std::string read_error(const std::string& toml) {
  try {
    test::train_config(toml);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// Every rank's outcome of running the pipeline on `nproc` CPU-thread ranks.
std::vector<parallel::RankOutcome> run_on(int nproc, const std::string& toml) {
  return parallel::run_thread_ranks(nproc, test::train_config(toml), test::train_registry());
}

}  // namespace

TEST_CASE("the defaults of the train section read without error") {
  CHECK(read_error("[train]\n") == "");
  const auto cfg = test::train_config("[train]\nsteps = 0\nbatch_size = 3\nmicro_batch_size = 1\n");
  CHECK(cfg.get<train::TrainConfig>("train").batch_size == 3);
  CHECK(cfg.enabled("parallel"));  // the train module depends on it
}

TEST_CASE("negative steps are reported with the key and its line") {
  CHECK(read_error("[train]\nseq_len = 8\nsteps = -1\n").find("p.toml:3:1: train.steps: must be >= 0") !=
        std::string::npos);
}

TEST_CASE("a batch size that is not positive is reported with the key and its line") {
  CHECK(read_error("[train]\nbatch_size = 0\n").find("p.toml:2:1: train.batch_size: must be positive") !=
        std::string::npos);
}

TEST_CASE("a micro-batch size that does not divide the batch size is reported with the key and its line") {
  const auto m = read_error("[train]\nbatch_size = 12\n\nmicro_batch_size = 5\n");
  CHECK(m.find("p.toml:4:1: train.micro_batch_size: must divide train.batch_size") != std::string::npos);
  CHECK(read_error("[train]\nmicro_batch_size = -2\n").find("p.toml:2:1: train.micro_batch_size: must be >= 0") !=
        std::string::npos);
}

TEST_CASE("a sequence length that is not positive is reported with the key and its line") {
  CHECK(read_error("[train]\nseq_len = -64\n").find("p.toml:2:1: train.seq_len: must be positive") !=
        std::string::npos);
}

TEST_CASE("a batch size not divisible by the data-parallel ranks is refused at install, naming the values") {
  const auto outcomes = run_on(3, "[train]\nbatch_size = 4\nsteps = 1\nseq_len = 2\n");
  REQUIRE(outcomes.size() == 3);
  for (const auto& o : outcomes) {
    CAPTURE(o.error);
    CHECK_FALSE(o.ok);
    CHECK(o.config_error);
    CHECK(o.error.find("train.batch_size") != std::string::npos);
    CHECK(test::names_number(o.error, 4));
    CHECK(test::names_number(o.error, 3));
  }
}

TEST_CASE("a micro-batch size that does not divide the per-rank batch is refused at install, naming the values") {
  // 12 sequences over 2 data-parallel ranks: 6 per rank, which 4 does not divide (though 4 divides 12).
  const auto outcomes = run_on(2, "[train]\nbatch_size = 12\nmicro_batch_size = 4\nsteps = 1\nseq_len = 2\n");
  REQUIRE(outcomes.size() == 2);
  for (const auto& o : outcomes) {
    CAPTURE(o.error);
    CHECK_FALSE(o.ok);
    CHECK(o.config_error);
    CHECK(o.error.find("train.micro_batch_size") != std::string::npos);
    CHECK(test::names_number(o.error, 4));
    CHECK(test::names_number(o.error, 6));
  }
}
