#include <doctest/doctest.h>

#include <optional>
#include <string>
#include <vector>

#include "kiln/engine/config/pipeline.hpp"
#include "kiln/engine/engine_module.hpp"
#include "kiln/engine/module.hpp"
#include "kiln_test.hpp"

namespace sample {
enum class Recipe { delayed, current };
BOOST_DESCRIBE_ENUM(Recipe, delayed, current)

struct Adam {
  double beta1 = 0.9;
  double beta2 = 0.95;
  void validate(kiln::config::Checks& c) const {
    c.expect(beta1 >= 0 && beta1 < 1, "beta1", "must be in [0, 1)");
  }
};
KILN_CONFIG(Adam, (beta1, "first moment decay"), (beta2, "second moment decay"))

struct SampleConfig {
  bool enabled = false;
  std::int64_t steps = 100;
  std::uint32_t heads = 12;
  float lr = 6e-4f;
  double eps = 1e-8;
  std::string name = "gpt \"small\"";
  Recipe recipe = Recipe::delayed;
  std::vector<int> layers = {0, 1, 2};
  std::vector<std::string> tags;
  std::optional<std::string> metrics;
  std::optional<int> limit = 7;
  Adam adam;
  void validate(kiln::config::Checks& c) const {
    c.expect(steps >= 0, "steps", "must be >= 0");
    c.expect(heads > 0, "heads", "must be positive");
  }
};
KILN_CONFIG(SampleConfig,
            (enabled, "switch"),
            (steps, "how many steps"),
            (heads, "attention heads"),
            (lr, "learning rate"),
            (eps, "epsilon"),
            (name, "a name with quotes"),
            (recipe, "scaling recipe"),
            (layers, "layer list"),
            (tags, "free tags"),
            (metrics, "optional path"),
            (limit, "optional int"),
            (adam, "optimizer settings"))
}  // namespace sample

namespace {
kiln::ModuleRegistry registry() {
  kiln::ModuleRegistry reg;
  kiln::register_engine_module(reg);
  reg.add(kiln::make_module<sample::SampleConfig>("sample", "a sample module", {},
                                                  [](kiln::World&, const sample::SampleConfig&) {}));
  reg.add(kiln::make_module<sample::Adam>("other", "depends on sample", {"sample"},
                                          [](kiln::World&, const sample::Adam&) {}));
  return reg;
}

kiln::config::PipelineConfig load(const std::string& text, std::vector<std::string> sets = {}) {
  kiln::test::TempDir dir("config");
  auto file = dir.file("p.toml", text);
  auto doc = kiln::config::load_document(file, sets);
  return kiln::config::resolve(doc, file, registry());
}

// The ConfigError message of loading `text`, or "" if it loads.
std::string error_of(const std::string& text, std::vector<std::string> sets = {}) {
  try {
    load(text, std::move(sets));
  } catch (const kiln::ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST_CASE("fields are read by reflection with defaults filled in") {
  auto cfg = load(R"(
[sample]
steps = 5
lr = 1
recipe = "current"
layers = [3, 4]
metrics = "out.jsonl"
[sample.adam]
beta2 = 0.99
)");
  auto& s = cfg.get<sample::SampleConfig>("sample");
  CHECK(s.steps == 5);
  CHECK(s.lr == doctest::Approx(1.0));
  CHECK(s.recipe == sample::Recipe::current);
  CHECK(s.layers == std::vector<int>{3, 4});
  CHECK(s.metrics == std::optional<std::string>("out.jsonl"));
  CHECK(s.limit == 7);
  CHECK(s.adam.beta1 == doctest::Approx(0.9));
  CHECK(s.adam.beta2 == doctest::Approx(0.99));
  CHECK(s.heads == 12);
}

TEST_CASE("a module is enabled by its section and brings its dependencies") {
  auto cfg = load("[other]\n");
  CHECK(cfg.modules == std::vector<std::string>{"engine", "sample", "other"});
  auto none = load("");
  CHECK(none.modules == std::vector<std::string>{"engine"});
}

TEST_CASE("set overrides file values and creates sections") {
  auto cfg = load("[sample]\nsteps = 5\n",
                  {"sample.steps=9", "sample.name=plain text", "sample.recipe=current", "sample.adam.beta1=0.5",
                   "sample.tags=[\"a\", \"b\"]", "sample.metrics=m.jsonl", "engine.device=cpu"});
  auto& s = cfg.get<sample::SampleConfig>("sample");
  CHECK(s.steps == 9);
  CHECK(s.name == "plain text");
  CHECK(s.recipe == sample::Recipe::current);
  CHECK(s.adam.beta1 == doctest::Approx(0.5));
  CHECK(s.tags == std::vector<std::string>{"a", "b"});
  CHECK(s.metrics == std::optional<std::string>("m.jsonl"));
  CHECK(cfg.get<kiln::EngineConfig>("engine").device == kiln::DeviceKind::cpu);
  auto created = load("", {"other.beta2=0.5"});
  CHECK(created.enabled("other"));
}

TEST_CASE("the effective config prints as TOML that reads back to the same text") {
  auto cfg = load("[other]\nbeta1 = 0.25\n[sample]\ntags = [\"x\"]\n[engine]\ndevice = \"cpu\"\n");
  auto reg = registry();
  std::string first = kiln::config::to_toml(cfg, reg);
  CHECK(first.find("# how many steps\nsteps = 100\n") != std::string::npos);
  CHECK(first.find("[sample.adam]") != std::string::npos);
  CHECK(first.find("device = \"cpu\"") != std::string::npos);
  CHECK(first.find("# metrics = (unset)") != std::string::npos);
  CHECK(first.find("name = \"gpt \\\"small\\\"\"") != std::string::npos);
  auto again = kiln::config::resolve(kiln::config::parse_toml_text(first, "again.toml"), "again.toml", reg);
  CHECK(kiln::config::to_toml(again, reg) == first);
}

TEST_CASE("floats print so that they read back exactly") {
  for (double v : {0.1, 6e-4, 1e-8, 3.0, -2.5e300, 1.0 / 3.0}) {
    auto text = kiln::config::toml_float(v);
    auto doc = kiln::config::parse_toml_text("x = " + text, "f");
    CHECK(doc.find("x")->floating == v);
  }
}

TEST_CASE("schemas list every field with type, default and doc") {
  auto reg = registry();
  auto& fields = reg.get("sample").schema.fields();
  REQUIRE(fields.size() == 13);
  CHECK(fields[1].name == "steps");
  CHECK(fields[1].type == "int");
  CHECK(fields[1].default_value == "100");
  CHECK(fields[6].type == "enum{delayed|current}");
  CHECK(fields[12].name == "adam.beta2");
  CHECK(fields[12].doc == "second moment decay");
}

TEST_CASE("error: TOML syntax error names file, line and column") {
  auto m = error_of("[sample]\nsteps = = 3\n");
  CHECK(m.find("p.toml:2:") != std::string::npos);
  CHECK(m.find("syntax error") != std::string::npos);
}

TEST_CASE("error: unknown section suggests the nearest module") {
  auto m = error_of("[sampel]\nsteps = 3\n");
  CHECK(m.find("p.toml:1:") != std::string::npos);
  CHECK(m.find("unknown section [sampel]; did you mean [sample]?") != std::string::npos);
}

TEST_CASE("error: unknown key suggests the nearest field and names the line") {
  auto m = error_of("[sample]\n\nstpes = 3\n");
  CHECK(m.find("p.toml:3:1: unknown key 'stpes' in [sample]; did you mean 'steps'?") != std::string::npos);
  auto nested = error_of("[sample.adam]\nbeta3 = 0.1\n");
  CHECK(nested.find("p.toml:2:1: unknown key 'beta3' in [sample.adam]") != std::string::npos);
}

TEST_CASE("error: wrong type names the key and the line") {
  auto m = error_of("[sample]\nsteps = \"many\"\n");
  CHECK(m.find("p.toml:2:1: sample.steps: expected an integer, got string \"many\"") != std::string::npos);
  auto arr = error_of("[sample]\nlayers = [1, \"x\"]\n");
  CHECK(arr.find("sample.layers[1]: expected an integer") != std::string::npos);
  auto range = error_of("[sample]\nheads = -1\n");
  CHECK(range.find("sample.heads: -1 is out of range for uint") != std::string::npos);
}

TEST_CASE("error: bad enum name lists the valid names") {
  auto m = error_of("[sample]\nrecipe = \"delay\"\n");
  CHECK(m.find("p.toml:2:1: sample.recipe: 'delay' is not one of: delayed, current") != std::string::npos);
  auto dev = error_of("[engine]\ndevice = \"gpu\"\n");
  CHECK(dev.find("'gpu' is not one of: auto, cuda, cpu") != std::string::npos);
}

TEST_CASE("error: failed validation names the key and its line") {
  auto m = error_of("[sample]\nname = \"x\"\nsteps = -4\n");
  CHECK(m.find("p.toml:3:1: sample.steps: must be >= 0") != std::string::npos);
  auto nested = error_of("[sample.adam]\nbeta1 = 1.5\n");
  CHECK(nested.find("p.toml:2:1: sample.adam.beta1: must be in [0, 1)") != std::string::npos);
}

TEST_CASE("error: every problem is reported at once") {
  auto m = error_of("[sample]\nstpes = 1\nrecipe = \"x\"\n[nope]\n");
  CHECK(m.find("stpes") != std::string::npos);
  CHECK(m.find("recipe") != std::string::npos);
  CHECK(m.find("[nope]") != std::string::npos);
}

TEST_CASE("error: missing pipeline file") {
  CHECK_THROWS_WITH_AS(kiln::config::load_document("/no/such/pipeline.toml", {}),
                       doctest::Contains("/no/such/pipeline.toml: pipeline file not found"), kiln::ConfigError);
}

TEST_CASE("error: malformed --set") {
  CHECK_THROWS_WITH_AS(kiln::config::parse_override("train.steps"), doctest::Contains("expected section.key=value"),
                       kiln::ConfigError);
  CHECK_THROWS_WITH_AS(kiln::config::parse_override("steps=3"), doctest::Contains("must name a section and a field"),
                       kiln::ConfigError);
  CHECK_THROWS_WITH_AS(kiln::config::parse_override("train..steps=3"), doctest::Contains("not a valid key"),
                       kiln::ConfigError);
  CHECK_THROWS_WITH_AS(kiln::config::parse_override("train.steps="), doctest::Contains("no value"),
                       kiln::ConfigError);
  auto m = error_of("", {"sample.steps=abc"});
  CHECK(m.find("--set sample.steps=abc: sample.steps: 'abc' is not a valid value") != std::string::npos);
  auto t = error_of("", {"sample.steps=1.5"});
  CHECK(t.find("--set sample.steps=1.5: sample.steps: expected an integer, got float 1.5") != std::string::npos);
  auto k = error_of("", {"sample.stepz=1"});
  CHECK(k.find("--set sample.stepz=1: unknown key 'stepz' in [sample]; did you mean 'steps'?") != std::string::npos);
}

TEST_CASE("error: a top-level key outside any section") {
  auto m = error_of("steps = 3\n");
  CHECK(m.find("p.toml:1:1: top-level key 'steps' must be inside a [section]") != std::string::npos);
}
