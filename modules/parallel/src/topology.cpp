#include "kiln/parallel/topology.hpp"

#include <algorithm>
#include <sstream>

#include "kiln/core/error.hpp"

namespace kiln::parallel {

const char* axis_name(Axis a) {
  static const char* names[] = {"tp", "cp", "ep", "dp", "pp"};
  return names[static_cast<int>(a)];
}

int Coords::operator[](Axis a) const {
  const int v[] = {tp, cp, ep, dp, pp};
  return v[static_cast<int>(a)];
}
int& Coords::operator[](Axis a) {
  int* v[] = {&tp, &cp, &ep, &dp, &pp};
  return *v[static_cast<int>(a)];
}
int Sizes::operator[](Axis a) const {
  const int v[] = {tp, cp, ep, dp, pp};
  return v[static_cast<int>(a)];
}

Topology::Topology(int world_size, int tp, int pp, int cp, int ep, int dp) {
  if (world_size <= 0) KILN_THROW("world size must be positive, got ", world_size);
  for (auto [name, v] : {std::pair{"tp", tp}, {"pp", pp}, {"cp", cp}, {"ep", ep}})
    if (v <= 0) KILN_THROW("parallel.", name, " must be positive, got ", v);
  const long long model = 1LL * tp * pp * cp;
  if (dp <= 0) {
    if (world_size % model != 0)
      KILN_THROW("world size ", world_size, " is not divisible by tp*pp*cp = ", tp, "*", pp, "*", cp, " = ", model);
    dp = static_cast<int>(world_size / model);
  } else if (model * dp != world_size) {
    KILN_THROW("tp*pp*cp*dp = ", tp, "*", pp, "*", cp, "*", dp, " = ", model * dp, " does not match the world size ",
               world_size);
  }
  if (dp % ep != 0)
    KILN_THROW("parallel.ep = ", ep, " does not divide the ", dp,
               " data-parallel ranks (expert parallelism is carved out of data parallelism)");
  sizes_ = Sizes{tp, cp, ep, dp / ep, pp};
}

Coords Topology::coords(int rank) const {
  KILN_CHECK(rank >= 0 && rank < world(), "rank ", rank, " outside world of ", world());
  Coords c;
  int r = rank;
  for (int a = 0; a < kAxes; ++a) {
    int n = sizes_[static_cast<Axis>(a)];
    c[static_cast<Axis>(a)] = r % n;
    r /= n;
  }
  return c;
}

int Topology::rank(const Coords& c) const {
  int r = 0;
  for (int a = kAxes - 1; a >= 0; --a) r = r * sizes_[static_cast<Axis>(a)] + c[static_cast<Axis>(a)];
  return r;
}

std::vector<int> Topology::group(int rank, std::initializer_list<Axis> axes) const {
  Coords base = coords(rank);
  std::vector<int> members;
  // Enumerate every combination of the chosen axes, others fixed.
  std::vector<Axis> ax(axes);
  std::vector<int> idx(ax.size(), 0);
  while (true) {
    Coords c = base;
    for (std::size_t i = 0; i < ax.size(); ++i) c[ax[i]] = idx[i];
    members.push_back(this->rank(c));
    std::size_t i = 0;
    for (; i < ax.size(); ++i) {
      if (++idx[i] < sizes_[ax[i]]) break;
      idx[i] = 0;
    }
    if (i == ax.size()) break;
  }
  std::sort(members.begin(), members.end());
  members.erase(std::unique(members.begin(), members.end()), members.end());
  return members;
}

int Topology::data_parallel_rank(int rank) const {
  const Coords c = coords(rank);
  return c.ep + sizes_.ep * c.dp;
}

int Topology::group_index(int rank, std::initializer_list<Axis> axes) const {
  auto groups = all_groups(axes);
  for (std::size_t g = 0; g < groups.size(); ++g)
    if (std::binary_search(groups[g].begin(), groups[g].end(), rank)) return static_cast<int>(g);
  KILN_THROW("rank ", rank, " is in no group");
}

std::vector<std::vector<int>> Topology::all_groups(std::initializer_list<Axis> axes) const {
  std::vector<std::vector<int>> groups;
  std::vector<bool> seen(world(), false);
  for (int r = 0; r < world(); ++r) {
    if (seen[r]) continue;
    auto g = group(r, axes);
    for (int m : g) seen[m] = true;
    groups.push_back(std::move(g));
  }
  return groups;
}

std::string Topology::describe() const {
  std::ostringstream os;
  auto& s = sizes_;
  os << "world " << world() << " = tp " << s.tp << " x cp " << s.cp << " x dp " << data_parallel_size();
  if (s.ep > 1) os << " (ep " << s.ep << " x expert-dp " << s.dp << ")";
  os << " x pp " << s.pp << "\n";
  auto list = [&](const char* name, std::initializer_list<Axis> axes) {
    os << name << " groups:";
    for (auto& g : all_groups(axes)) {
      os << " [";
      for (std::size_t i = 0; i < g.size(); ++i) os << (i ? "," : "") << g[i];
      os << "]";
    }
    os << "\n";
  };
  list("tp", {Axis::tp});
  list("cp", {Axis::cp});
  list("dp", {Axis::ep, Axis::dp});
  list("pp", {Axis::pp});
  list("ep", {Axis::ep});
  if (s.ep > 1) list("expert-dp", {Axis::dp});
  os << "ranks (tp,cp,ep,dp,pp):";
  for (int r = 0; r < world(); ++r) {
    auto c = coords(r);
    os << (r % 8 == 0 ? "\n  " : "  ") << r << "=(" << c.tp << "," << c.cp << "," << c.ep << "," << c.dp << ","
       << c.pp << ")";
  }
  os << "\n";
  return os.str();
}

}  // namespace kiln::parallel
