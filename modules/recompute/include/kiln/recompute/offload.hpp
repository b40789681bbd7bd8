#pragma once
// The "activation_offload" module: some blocks keep the activations their backward pass reads in host
// memory instead of on the device, and neither keep them there nor recompute them (as Megatron-Core's
// and TransformerEngine's CPU offloading). Each such block writes its saved activations into one of a
// few device slots the offloaded blocks take in turn; after its forward pass they are copied to pinned
// host memory, and copied back into a slot before its backward pass, on two streams of their own (PCIe
// copies both ways at once), beside the compute. An offloaded block costs the device nothing beyond
// the slots, and the step no recompute: what the copies cost is PCIe time, which the blocks between
// two offloaded ones hide (hence `every`).
#include <memory>
#include <vector>

#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/config/schema.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/engine/world.hpp"

namespace kiln::recompute {

struct ActivationOffloadConfig {
  int blocks = 0;
  int every = 2;
  int slots = 2;
  void validate(config::Checks& c) const {
    c.expect(blocks >= 0, "blocks", "must be 0 (none) or a number of blocks");
    c.expect(every >= 1, "every", "must be at least 1");
    c.expect(slots >= 1, "slots", "must be at least 1");
  }
  // Block indices offloaded: 0, every, 2 x every, ... (`blocks` of them).
  std::vector<int> chosen() const {
    std::vector<int> b;
    for (int k = 0; k < blocks; ++k) b.push_back(k * every);
    return b;
  }
};
KILN_CONFIG(ActivationOffloadConfig,
            (blocks,
             "how many blocks keep their saved activations in host memory (0: none); a block activation_checkpoint "
             "would recompute is offloaded instead"),
            (every,
             "the offloaded blocks are 0, every, 2 x every, ...: the blocks between two of them hide the copies "
             "(a block's activations cross PCIe at ~50 GB/s, slower than most blocks' forward pass makes them)"),
            (slots,
             "device copies of a block's saved activations that the offloaded blocks take in turn (the last "
             "`slots` offloaded blocks never leave the device)"))

class OffloadRunner;

// World resource: what moves the offloaded blocks' activations (it holds their layer units).
struct ActivationOffloadState {
  std::shared_ptr<OffloadRunner> runner;
  std::vector<Subscription> subscriptions;
};

void register_offload_module(ModuleRegistry& registry);

}  // namespace kiln::recompute
