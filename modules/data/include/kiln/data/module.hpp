#pragma once
// The "data" module: fills train::Batch with this rank's micro-batch in the data phase and prepares
// the fixed validation set. Each data-parallel rank reads a different part of every global batch.
#include <memory>
#include <optional>
#include <string>

#include "kiln/data/loader.hpp"
#include "kiln/engine/config/reflect.hpp"
#include "kiln/engine/module.hpp"
#include "kiln/train/train.hpp"

namespace kiln::data {

struct DataConfig {
  std::string train_files;
  std::string val_files;
  ShardFormat format = ShardFormat::auto_;
  bool shuffle = true;
  int val_batches = 4;
  int synthetic_vocab = 0;
  bool attend_within_documents = true;
  void validate(config::Checks& c) const {
    c.expect(val_batches >= 0, "val_batches", "must be >= 0");
    c.expect(synthetic_vocab >= 0, "synthetic_vocab", "must be >= 0");
    c.expect(synthetic_vocab > 0 || !train_files.empty(), "train_files",
             "is required (a glob of token shards), unless synthetic_vocab > 0");
  }
};
KILN_CONFIG(DataConfig,
            (train_files, "glob of training token shards (llm.c .bin or raw uint16), relative to the working directory"),
            (val_files, "glob of validation token shards; empty = no validation"),
            (format, "shard format: auto (by the llm.c magic number), llmc or raw"),
            (shuffle, "shuffle the training windows each epoch (seeded by train.seed)"),
            (val_batches, "validation micro-batches per evaluation (a fixed set)"),
            (synthetic_vocab, "if > 0, train on uniformly random tokens below this value instead of files"),
            (attend_within_documents,
             "shards whose masks mark documents (kiln tokenize --format chat | prompt-completion) pack them into "
             "windows: each token attends only to its own document's tokens; false lets attention cross them"))

// World resource: the data position (samples consumed), which a checkpoint saves.
struct DataState {
  std::uint64_t position = 0;
  std::unique_ptr<WindowIndex> train;
  std::unique_ptr<SampleOrder> order;
  // The next step's first micro-batch of this rank, made while the step's end (its optimizer) runs on
  // the device (data.prefetch), and the global sample it starts at; data.next_batch takes it when it matches.
  std::optional<std::uint64_t> prefetched_first;
  train::Batch prefetched;
  // The trained targets of the global batch at `counted_at` (loss masks), counted once per step.
  std::optional<std::uint64_t> counted_at;
  std::int64_t counted = 0;
};

void register_module(ModuleRegistry& registry);

}  // namespace kiln::data
