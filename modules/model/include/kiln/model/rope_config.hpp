#pragma once
// [model.rope_scaling]: RoPE's frequencies stretched for contexts longer than the model was first
// trained on, as Llama 3.1 and 3.2 ship them (Hugging Face's config.json rope_scaling of type
// "llama3"); `type = "none"` leaves them as theta^(-2i/D).
#include <boost/describe/enum.hpp>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/config/schema.hpp"
#include "kiln/ops/formulas.hpp"

namespace kiln::model {

enum class RopeScalingType { none, llama3 };
BOOST_DESCRIBE_ENUM(RopeScalingType, none, llama3)

struct RopeScalingConfig {
  RopeScalingType type = RopeScalingType::none;
  float factor = 8.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  int original_max_seq_len = 8192;
  bool enabled() const { return type != RopeScalingType::none; }
  // What the RoPE op takes (factor 0: none).
  ops::RopeScaling op() const {
    if (!enabled()) return {};
    return {factor, low_freq_factor, high_freq_factor, static_cast<float>(original_max_seq_len)};
  }
  void validate(config::Checks& c) const {
    c.expect(!enabled() || factor >= 1, "factor", "must be at least 1");
    c.expect(!enabled() || low_freq_factor > 0, "low_freq_factor", "must be positive");
    c.expect(!enabled() || high_freq_factor > low_freq_factor, "high_freq_factor", "must exceed low_freq_factor");
    c.expect(!enabled() || original_max_seq_len > 0, "original_max_seq_len", "must be positive");
  }
};
KILN_CONFIG(RopeScalingConfig,
            (type, "none, or llama3 (Llama 3.1 / 3.2: long wavelengths divided by factor, short ones kept, those "
                   "between blended)"),
            (factor, "llama3: how much the long wavelengths are stretched (Llama 3.1: 8, Llama 3.2: 32)"),
            (low_freq_factor, "llama3: wavelengths above original_max_seq_len / low_freq_factor are stretched"),
            (high_freq_factor, "llama3: wavelengths below original_max_seq_len / high_freq_factor are kept"),
            (original_max_seq_len, "llama3: the context length the model was first trained with (8192)"))

}  // namespace kiln::model
