// Pipeline schedules (1F1B and Megatron's interleaved 1F1B) and their simulated timeline.
#include "kiln/parallel/pipeline_schedule.hpp"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include "kiln/core/error.hpp"

namespace kiln::parallel {

namespace {

using Kind = PipelineAction::Kind;

// The forwards a rank runs before its first backward.
int warmup_passes(const PipelineShape& s, int rank) {
  if (s.vpp == 1) return std::min(s.pp - rank - 1, s.micro_batches);
  const int total = s.micro_batches * s.vpp;
  return s.micro_batches == s.pp ? total : std::min((s.pp - rank - 1) * 2 + (s.vpp - 1) * s.pp, total);
}

std::vector<PipelineAction> one_f_one_b(int pp, int m, int rank) {
  const int warmup = warmup_passes({pp, 1, m}, rank);
  std::vector<PipelineAction> out;
  for (int i = 0; i < warmup; ++i) out.push_back({Kind::forward, i, 0});
  for (int i = 0; i < m - warmup; ++i) {
    out.push_back({Kind::forward, warmup + i, 0});
    out.push_back({Kind::backward, i, 0});
  }
  for (int i = m - warmup; i < m; ++i) out.push_back({Kind::backward, i, 0});
  return out;
}

// Megatron-LM's interleaved schedule: the k-th forward (backward) of a rank runs micro-batch
// (k / (pp vpp)) pp + k % pp on chunk (k / pp) % vpp (backwards: the chunks in reverse).
std::vector<PipelineAction> interleaved(int pp, int vpp, int m, int rank) {
  const int total = m * vpp, group = pp * vpp;
  const int warmup = warmup_passes({pp, vpp, m}, rank);
  auto action = [&](Kind kind, int k) {
    int chunk = (k % group) / pp;
    if (kind == Kind::backward) chunk = vpp - 1 - chunk;
    return PipelineAction{kind, (k / group) * pp + k % group % pp, chunk};
  };
  std::vector<PipelineAction> out;
  for (int k = 0; k < warmup; ++k) out.push_back(action(Kind::forward, k));
  for (int i = 0; i < total - warmup; ++i) {
    out.push_back(action(Kind::forward, warmup + i));
    out.push_back(action(Kind::backward, i));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(action(Kind::backward, k));
  return out;
}

std::string name(const PipelineAction& a) {
  std::string s = (a.kind == Kind::forward ? "F" : "B") + std::to_string(a.micro_batch);
  if (a.chunk > 0) s += "." + std::to_string(a.chunk);
  return s;
}

}  // namespace

std::string pipeline_shape_problem(const PipelineShape& s) {
  if (s.pp <= 0) return cat("a pipeline of ", s.pp, " ranks");
  if (s.vpp <= 0) return cat(s.vpp, " model chunks per pipeline rank");
  if (s.micro_batches <= 0) return cat(s.micro_batches, " micro-batches per step");
  if (s.vpp > 1 && s.micro_batches % s.pp != 0)
    return cat("the interleaved schedule (", s.vpp, " chunks per rank) runs micro-batches in groups of pp = ", s.pp,
               ", but a step has ", s.micro_batches);
  return {};
}

std::vector<PipelineAction> pipeline_schedule(const PipelineShape& s, int rank) {
  if (const std::string problem = pipeline_shape_problem(s); !problem.empty()) KILN_THROW(problem);
  KILN_CHECK(rank >= 0 && rank < s.pp, "pipeline rank ", rank, " of ", s.pp);
  return s.vpp == 1 ? one_f_one_b(s.pp, s.micro_batches, rank) : interleaved(s.pp, s.vpp, s.micro_batches, rank);
}

int max_in_flight(const std::vector<PipelineAction>& actions) {
  int now = 0, most = 0;
  for (const auto& a : actions) {
    now += a.kind == Kind::forward ? 1 : -1;
    most = std::max(most, now);
  }
  return most;
}

double pipeline_bubble(const PipelineShape& s) {
  return static_cast<double>(s.pp - 1) / (static_cast<double>(s.vpp) * s.micro_batches + s.pp - 1);
}

PipelineTimeline simulate_pipeline(const PipelineShape& s, double forward, double backward, double transfer) {
  std::vector<std::vector<PipelineAction>> plans;
  for (int r = 0; r < s.pp; ++r) plans.push_back(pipeline_schedule(s, r));
  return simulate_pipeline(s, plans, forward, backward, transfer);
}

PipelineTimeline simulate_pipeline(const PipelineShape& s, const std::vector<std::vector<PipelineAction>>& plans,
                                   double forward, double backward, double transfer) {
  KILN_CHECK(static_cast<int>(plans.size()) == s.pp, plans.size(), " schedules for ", s.pp, " pipeline ranks");
  const int S = s.virtual_stages();
  // When each (kind, micro-batch, virtual stage) ended.
  std::map<std::tuple<int, int, int>, double> ended;
  auto key = [](Kind k, int m, int v) { return std::make_tuple(static_cast<int>(k), m, v); };
  PipelineTimeline t;
  t.ranks.resize(static_cast<std::size_t>(s.pp));
  std::vector<std::size_t> next(static_cast<std::size_t>(s.pp), 0);
  std::vector<double> free(static_cast<std::size_t>(s.pp), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < s.pp; ++r) {
      const auto& plan = plans[static_cast<std::size_t>(r)];
      auto& at = next[static_cast<std::size_t>(r)];
      while (at < plan.size()) {
        const PipelineAction& a = plan[at];
        const int v = a.chunk * s.pp + r;
        double ready = free[static_cast<std::size_t>(r)];
        // What the action waits for from another virtual stage (same rank: no transfer).
        const bool fwd = a.kind == Kind::forward;
        const int from = fwd ? v - 1 : v + 1;
        if (from >= 0 && from < S) {
          const auto it = ended.find(key(a.kind, a.micro_batch, from));
          if (it == ended.end()) break;
          ready = std::max(ready, it->second + (from % s.pp == r ? 0.0 : transfer));
        }
        if (!fwd) {
          const auto it = ended.find(key(Kind::forward, a.micro_batch, v));
          if (it == ended.end()) break;
          ready = std::max(ready, it->second);
        }
        const double end = ready + (fwd ? forward : backward);
        ended[key(a.kind, a.micro_batch, v)] = end;
        t.ranks[static_cast<std::size_t>(r)].push_back({a, ready, end});
        free[static_cast<std::size_t>(r)] = end;
        ++at;
        progress = true;
      }
    }
  }
  std::ostringstream stuck;
  for (int r = 0; r < s.pp; ++r)
    if (next[static_cast<std::size_t>(r)] < plans[static_cast<std::size_t>(r)].size())
      stuck << " rank " << r << " at " << name(plans[static_cast<std::size_t>(r)][next[static_cast<std::size_t>(r)]]);
  if (!stuck.str().empty()) KILN_THROW("the pipeline schedules wait on each other forever:", stuck.str());
  double busy = 0;
  for (int r = 0; r < s.pp; ++r) {
    t.makespan = std::max(t.makespan, free[static_cast<std::size_t>(r)]);
    for (const auto& a : t.ranks[static_cast<std::size_t>(r)]) busy += a.end - a.start;
  }
  t.bubble = t.makespan > 0 ? 1.0 - busy / (s.pp * t.makespan) : 0.0;
  return t;
}

std::vector<PipelineTransfers> pipeline_transfers(const PipelineShape& s, int rank) {
  const auto plan = pipeline_schedule(s, rank);
  const int S = s.virtual_stages();
  std::vector<PipelineTransfers> calls(plan.size() + 1);
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const PipelineAction& a = plan[i];
    const int v = a.chunk * s.pp + rank;
    if (a.kind == Kind::forward) {
      if (v > 0) calls[i].recvs.push_back({true, a.micro_batch, v - 1});
      if (v < S - 1) calls[i + 1].sends.push_back({true, a.micro_batch, v});
    } else {
      if (v < S - 1) calls[i].recvs.push_back({false, a.micro_batch, v + 1});
      if (v > 0) calls[i + 1].sends.push_back({false, a.micro_batch, v});
    }
  }
  if (s.vpp > 1) {
    // Interleaved, steady state: a forward and the backward after it share their calls (Megatron-LM's
    // send_forward_backward_recv_forward_backward): the backward's input arrives with the forward's,
    // the forward's output leaves with the backward's. (Separately, two ranks can each send what the
    // other receives only one call later.)
    const std::size_t first = static_cast<std::size_t>(warmup_passes(s, rank));
    for (std::size_t i = first; i + 1 < plan.size() && plan[i + 1].kind == Kind::backward &&
                                plan[i].kind == Kind::forward;
         i += 2) {
      auto& between = calls[i + 1];
      calls[i].recvs.insert(calls[i].recvs.end(), between.recvs.begin(), between.recvs.end());
      calls[i + 2].sends.insert(calls[i + 2].sends.begin(), between.sends.begin(), between.sends.end());
      between = {};
    }
  }
  return calls;
}

std::string check_pipeline_transfers(const PipelineShape& s) {
  const int pp = s.pp;
  std::vector<std::vector<PipelineTransfers>> calls;
  for (int r = 0; r < pp; ++r) calls.push_back(pipeline_transfers(s, r));
  auto peer_of = [&](const PipelineMessage& m, bool send) { return (send ? m.to() : m.from) % pp; };
  auto describe = [](const PipelineMessage& m) {
    return cat(m.activation ? "activation" : "gradient", " of micro-batch ", m.micro_batch, " from stage ", m.from,
               " to ", m.to());
  };
  // The channel order: each rank's sends to a peer and that peer's receives from it, in program order.
  for (int a = 0; a < pp; ++a)
    for (int b = 0; b < pp; ++b) {
      std::vector<PipelineMessage> sent, received;
      for (const auto& c : calls[static_cast<std::size_t>(a)])
        for (const auto& m : c.sends)
          if (peer_of(m, true) == b) sent.push_back(m);
      for (const auto& c : calls[static_cast<std::size_t>(b)])
        for (const auto& m : c.recvs)
          if (peer_of(m, false) == a) received.push_back(m);
      if (sent.size() != received.size())
        return cat("rank ", a, " sends ", sent.size(), " messages to rank ", b, ", which receives ", received.size());
      for (std::size_t k = 0; k < sent.size(); ++k)
        if (!(sent[k] == received[k]))
          return cat("rank ", a, "'s send ", k, " to rank ", b, " is the ", describe(sent[k]), ", but rank ", b,
                     "'s receive ", k, " from rank ", a, " expects the ", describe(received[k]));
    }
  // Rendezvous: a transfer completes once both sides' calls are posted.
  std::vector<std::size_t> at(static_cast<std::size_t>(pp), 0);
  std::vector<std::vector<bool>> sent_done(static_cast<std::size_t>(pp)), recv_done(static_cast<std::size_t>(pp));
  auto reset = [&](int r) {
    const auto& c = calls[static_cast<std::size_t>(r)][at[static_cast<std::size_t>(r)]];
    sent_done[static_cast<std::size_t>(r)].assign(c.sends.size(), false);
    recv_done[static_cast<std::size_t>(r)].assign(c.recvs.size(), false);
  };
  for (int r = 0; r < pp; ++r) reset(r);
  for (bool progress = true; progress;) {
    progress = false;
    // Match each posted send with the peer's posted receive of the same message.
    for (int r = 0; r < pp; ++r) {
      if (at[static_cast<std::size_t>(r)] >= calls[static_cast<std::size_t>(r)].size()) continue;
      const auto& c = calls[static_cast<std::size_t>(r)][at[static_cast<std::size_t>(r)]];
      for (std::size_t k = 0; k < c.sends.size(); ++k) {
        if (sent_done[static_cast<std::size_t>(r)][k]) continue;
        const int q = peer_of(c.sends[k], true);
        if (at[static_cast<std::size_t>(q)] >= calls[static_cast<std::size_t>(q)].size()) continue;
        const auto& theirs = calls[static_cast<std::size_t>(q)][at[static_cast<std::size_t>(q)]];
        for (std::size_t j = 0; j < theirs.recvs.size(); ++j)
          if (!recv_done[static_cast<std::size_t>(q)][j] && theirs.recvs[j] == c.sends[k]) {
            sent_done[static_cast<std::size_t>(r)][k] = true;
            recv_done[static_cast<std::size_t>(q)][j] = true;
            progress = true;
            break;
          }
      }
    }
    // Calls whose transfers all completed let their rank go on.
    for (int r = 0; r < pp; ++r) {
      auto& i = at[static_cast<std::size_t>(r)];
      while (i < calls[static_cast<std::size_t>(r)].size()) {
        const auto& sd = sent_done[static_cast<std::size_t>(r)];
        const auto& rd = recv_done[static_cast<std::size_t>(r)];
        if (std::find(sd.begin(), sd.end(), false) != sd.end() || std::find(rd.begin(), rd.end(), false) != rd.end())
          break;
        ++i;
        progress = true;
        if (i < calls[static_cast<std::size_t>(r)].size()) reset(r);
      }
    }
  }
  std::string stuck;
  for (int r = 0; r < pp; ++r)
    if (at[static_cast<std::size_t>(r)] < calls[static_cast<std::size_t>(r)].size())
      stuck += cat(stuck.empty() ? "" : "; ", "rank ", r, " in call ", at[static_cast<std::size_t>(r)]);
  return stuck.empty() ? std::string() : cat("the transfers wait on each other forever: ", stuck);
}

std::string format_actions(const std::vector<PipelineAction>& actions) {
  std::string out;
  for (const auto& a : actions) out += (out.empty() ? "" : " ") + name(a);
  return out;
}

}  // namespace kiln::parallel
