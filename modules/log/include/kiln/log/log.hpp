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
  void validate(config::Checks& c) const {
    c.expect(every > 0, "every", "must be positive");
    c.expect(val_every >= 0, "val_every", "must be >= 0 (0 = never)");
  }
};
KILN_CONFIG(LogConfig,
            (every, "print a step line every this many steps (and always the first and the last)"),
            (val_every, "measure the validation loss every this many steps (and at the last); 0 = never"),
            (metrics, "write one JSON object per step to this JSONL file"))

// The step line, e.g. "step   12/200 | loss 3.4512 | ...".
std::string format_step_line(std::int64_t step, std::int64_t steps, double loss, double lr, double grad_norm,
                             double tokens_per_s, double mfu, double step_ms, std::optional<double> val_loss);

void register_module(ModuleRegistry& registry);

}  // namespace kiln::log
