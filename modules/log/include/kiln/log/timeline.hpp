#pragma once
// The passes a run timed (log.timeline: one JSONL file per rank): reading them back, the pipeline
// bubble they show, and a Gantt chart of them as standalone SVG (one row per rank).
#include <string>
#include <vector>

namespace kiln::log {

struct TimedPass {
  int rank = 0, pp_rank = 0;
  bool forward = true;
  int micro_batch = 0, chunk = 0;
  double start_s = 0, end_s = 0;
};

// Every line of every file; a missing file or a line without the fields is an error naming file:line.
std::vector<TimedPass> read_timeline(const std::vector<std::string>& paths);

struct TimelineSummary {
  int ranks = 0, pp = 1, vpp = 1, micro_batches = 0;
  double makespan_s = 0;  // from the first pass's start to the last one's end, over every rank
  double bubble = 0;      // 1 - (time in passes) / (ranks x makespan)
  double formula = 0;     // (pp - 1) / (vpp m + pp - 1) of the shape the passes show
};
TimelineSummary summarize_timeline(const std::vector<TimedPass>& passes);

// The chart: a row per rank, a box per pass (forwards and backwards in two colours, labelled
// "F3" / "B3.1" where they fit), milliseconds from the first pass's start.
std::string timeline_svg(const std::vector<TimedPass>& passes, const std::string& title);

}  // namespace kiln::log
