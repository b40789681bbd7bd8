#pragma once
// A pipeline stage's side of a step (PipelinePlan): the engine runs the stage's passes in its
// schedule's order, and before each pass (and after the step's last) the stage trades activations
// and gradients with its neighbours in the grouped calls the schedule puts there
// (parallel::pipeline_transfers). The model says where each message lives (Buffers) and calls
// begin/end around every pass.
//
// Overlap: a call whose pass receives its input (the activation from the previous virtual stage,
// the gradient from the next) runs in order on the compute stream, the pass waiting for it anyway;
// a call whose pass receives nothing (a first stage's forward, a last stage's backward: 1F1B's
// warm-up and cool-down) is posted on the pipeline's own stream and the pass starts at once. Posting
// every call measured 2% slower (docs/PERF.md). A buffer being sent stays untouched until it has
// left: an activation is sent from its micro-batch's copy, rewritten only by that micro-batch's
// backward (after the gradient coming back, received after it left) or by a later micro-batch's
// forward; the gradient for the previous stage has one buffer, which the model rewrites only after
// gradient_buffer_free().
#include "kiln/model/pipeline_plan.hpp"
#include "kiln/parallel/pipeline_parallel.hpp"
#include "kiln/parallel/stream_event.hpp"

namespace kiln::model {

class StagePasses {
 public:
  // `compute`: the stream the passes run on (null: host order).
  StagePasses(const PipelinePlan& plan, parallel::PipelineParallel& pipe, parallel::PipelineParallel::Buffers buffers,
              void* compute)
      : plan_(plan), pipe_(pipe), buffers_(std::move(buffers)), compute_(compute) {}

  // Before micro-batch m's forward or backward on `chunk`: checks that it is the schedule's next
  // pass, then runs the calls before it.
  void begin(bool forward, int m, int chunk);
  // After the pass; after the step's last, the calls after it: the step ends with every transfer done.
  void end();
  // Before the compute stream rewrites the buffer of the gradient sent to the previous stage.
  void gradient_buffer_free() const { grad_sent_.wait(compute_); }

 private:
  void transfer(int call, bool overlap);

  const PipelinePlan& plan_;
  parallel::PipelineParallel& pipe_;
  parallel::PipelineParallel::Buffers buffers_;
  void* compute_;
  int pass_ = 0;                       // the next pass of the schedule
  parallel::StreamEvent grad_sent_;    // the last call sending the gradient buffer (posted)
};

}  // namespace kiln::model
