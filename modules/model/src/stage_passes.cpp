#include "kiln/model/stage_passes.hpp"

#include "kiln/core/error.hpp"

namespace kiln::model {

void StagePasses::begin(bool forward, int m, int chunk) {
  KILN_CHECK(pass_ < static_cast<int>(plan_.passes.size()), "pass ", pass_, " of a schedule of ", plan_.passes.size());
  const parallel::PipelineAction& a = plan_.passes[static_cast<std::size_t>(pass_)];
  const bool expected = (a.kind == parallel::PipelineAction::Kind::forward) == forward && a.micro_batch == m &&
                        a.chunk == chunk;
  KILN_CHECK(expected, "pipeline rank ", plan_.rank, "'s pass ", pass_, " is ", parallel::format_actions({a}),
             ", but the step runs ", forward ? "F" : "B", m, chunk > 0 ? cat(".", chunk) : std::string());
  const bool receives = forward ? !plan_.first(chunk) : !plan_.last(chunk);
  transfer(pass_, !receives);
}

void StagePasses::end() {
  if (++pass_ < static_cast<int>(plan_.passes.size())) return;
  transfer(pass_, false);  // what the step's last pass produced
  pass_ = 0;
}

void StagePasses::transfer(int call, bool overlap) {
  const parallel::PipelineTransfers& t = plan_.transfers[static_cast<std::size_t>(call)];
  if (!overlap) {
    pipe_.wait_posted(compute_);  // the calls keep their order
    pipe_.transfer(t, buffers_, compute_);
    return;
  }
  pipe_.post(t, buffers_, compute_);
  for (const auto& msg : t.sends)
    if (!msg.activation) pipe_.mark_posted(grad_sent_);
}

}  // namespace kiln::model
