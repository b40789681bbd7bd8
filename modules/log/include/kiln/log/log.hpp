#pragma once
// The "log" module: one line per step on rank 0 (step, loss, learning rate, gradient norm, tokens/s,
// MFU, ms/step, and the validation loss when measured), and optionally one JSON object per step.
#include <cstdint>
#include <optional>
#include <string>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"

namespace kiln::log {

struct LogConfig {
  std::int64_t every = 1;
  std::int64_t val_every = 0;
  std::optional<std::string> metrics;
  std::int64_t sample_every = 0;
  int sample_tokens = 64;
  std::string sample_prompt = "The ";
  std::optional<std::string> timeline;
  std::int64_t timeline_step = 3;
  void validate(config::Checks& c) const {
    c.expect(timeline_step > 0, "timeline_step", "must be positive");
    c.expect(every > 0, "every", "must be positive");
    c.expect(val_every >= 0, "val_every", "must be >= 0 (0 = never)");
    c.expect(sample_every >= 0, "sample_every", "must be >= 0 (0 = never)");
    c.expect(sample_tokens > 0, "sample_tokens", "must be positive");
  }
};
KILN_CONFIG(LogConfig,
            (every, "print a step line every this many steps (and always the first and the last)"),
            (val_every, "measure the validation loss every this many steps (and at the last); 0 = never"),
            (metrics, "write one JSON object per step to this JSONL file"),
            (sample_every,
             "print text the model generates every this many steps (and at the last), as llm.c does; needs the "
             "whole model on rank 0 (parallel.tp = 1, no fsdp sharding); 0 = never"),
            (sample_tokens, "tokens each sample generates"),
            (sample_prompt, "the text samples start from"),
            (timeline,
             "time each forward and backward pass of step log.timeline_step on every rank (the device synchronised "
             "around each, which slows that step) and write them to this path + \".rank<N>\" (JSONL); `kiln plot "
             "--timeline FILES` draws them and measures the pipeline bubble"),
            (timeline_step, "the step log.timeline times"))

// The step line, e.g. "step   12/200 | loss 3.4512 | ...".
std::string format_step_line(std::int64_t step, std::int64_t steps, double loss, double lr, double grad_norm,
                             double tokens_per_s, double mfu, double step_ms, std::optional<double> val_loss);

void register_module(ModuleRegistry& registry);

}  // namespace kiln::log
