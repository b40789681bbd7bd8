#include "kiln/parallel/rendezvous.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "kiln/core/error.hpp"

namespace kiln::parallel {

namespace {

using Clock = std::chrono::steady_clock;

void send_all(int fd, const std::string& s) {
  const char* p = s.data();
  std::size_t n = s.size();
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return;  // the peer is gone; the monitor reports it
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

// Reads one '\n'-terminated line; false on EOF/error or when the deadline passes.
bool read_line(int fd, std::string& line, Clock::time_point deadline) {
  line.clear();
  char c;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000)));
    if (r < 0 && errno != EINTR) return false;
    if (r <= 0) continue;
    ssize_t n = ::recv(fd, &c, 1, 0);
    if (n <= 0) return false;
    if (c == '\n') return true;
    line += c;
  }
}

std::string hex(const std::string& bytes) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (unsigned char c : bytes) {
    s += d[c >> 4];
    s += d[c & 15];
  }
  return s;
}

std::string unhex(const std::string& s) {
  std::string out;
  for (std::size_t i = 0; i + 1 < s.size(); i += 2) out += static_cast<char>(std::stoi(s.substr(i, 2), nullptr, 16));
  return out;
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (*end) KILN_THROW("environment variable ", name, "=", v, " is not an integer");
  return static_cast<int>(x);
}

}  // namespace

LaunchEnv detect_launch_env() {
  LaunchEnv e;
  auto has = [](const char* n) { return std::getenv(n) != nullptr; };
  if (has("RANK") && has("WORLD_SIZE")) {
    e.rank = env_int("RANK", 0);
    e.world = env_int("WORLD_SIZE", 1);
    e.local_rank = env_int("LOCAL_RANK", e.rank);
    e.local_world = env_int("LOCAL_WORLD_SIZE", e.world);
    e.launcher = has("KILN_LAUNCHER") ? "kiln" : "torchrun";
  } else if (has("OMPI_COMM_WORLD_RANK")) {
    e.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    e.world = env_int("OMPI_COMM_WORLD_SIZE", 1);
    e.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    e.local_world = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
    e.launcher = "mpirun";
  } else if (has("PMI_RANK")) {
    e.rank = env_int("PMI_RANK", 0);
    e.world = env_int("PMI_SIZE", 1);
    e.local_rank = env_int("MPI_LOCALRANKID", 0);
    e.local_world = env_int("MPI_LOCALNRANKS", 1);
    e.launcher = "mpirun";
  } else if (has("SLURM_PROCID") && has("SLURM_NTASKS")) {
    e.rank = env_int("SLURM_PROCID", 0);
    e.world = env_int("SLURM_NTASKS", 1);
    e.local_rank = env_int("SLURM_LOCALID", 0);
    e.local_world = env_int("SLURM_NTASKS_PER_NODE", 1);
    e.launcher = "srun";
  }
  if (const char* a = std::getenv("MASTER_ADDR")) e.master_addr = a;
  e.master_port = env_int("MASTER_PORT", e.master_port);
  if (e.world < 1 || e.rank < 0 || e.rank >= e.world)
    KILN_THROW("launch environment (", e.launcher, ") gives rank ", e.rank, " of ", e.world, " ranks");
  return e;
}

Rendezvous::Rendezvous(const std::string& addr, int port, int rank, int world, const std::string& root_payload,
                       std::chrono::milliseconds timeout)
    : rank_(rank), world_(world), timeout_(timeout) {
  if (::pipe(wake_) != 0) KILN_THROW("rendezvous: pipe failed: ", std::strerror(errno));
  const auto deadline = Clock::now() + timeout;
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (int rc = ::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &res); rc != 0)
    KILN_THROW("rendezvous: cannot resolve MASTER_ADDR ", addr, ": ", ::gai_strerror(rc));
  sockaddr_in sa = *reinterpret_cast<sockaddr_in*>(res->ai_addr);
  ::freeaddrinfo(res);

  if (rank == 0) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in any = sa;
    any.sin_addr.s_addr = htonl(INADDR_ANY);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&any), sizeof any) != 0 || ::listen(listen_fd_, world) != 0)
      KILN_THROW("rendezvous: rank 0 cannot listen on port ", port, ": ", std::strerror(errno),
                 " (set MASTER_PORT to a free port)");
    peers_.assign(world, -1);
    done_.assign(world, false);
    int joined = 0;
    while (joined < world - 1) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      pollfd p{listen_fd_, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000))) < 0) break;
      if (!(p.revents & POLLIN)) continue;
      int fd = ::accept(listen_fd_, nullptr, nullptr);
      if (fd < 0) continue;
      std::string line;
      if (!read_line(fd, line, deadline) || line.rfind("HELLO ", 0) != 0) {
        ::close(fd);
        continue;
      }
      int r = std::atoi(line.c_str() + 6);
      if (r <= 0 || r >= world || peers_[r] >= 0) {
        ::close(fd);
        KILN_THROW("rendezvous: a second rank ", r, " joined (is another job using MASTER_PORT ", port, "?)");
      }
      peers_[r] = fd;
      ++joined;
    }
    if (joined < world - 1) {
      std::string missing;
      for (int r = 1; r < world; ++r)
        if (peers_[r] < 0) missing += cat(missing.empty() ? "" : ", ", r);
      KILN_THROW("rendezvous: rank(s) ", missing, " did not join within ",
                 std::chrono::duration<double>(timeout).count(), " s (MASTER_ADDR ", addr, ", MASTER_PORT ", port, ")");
    }
    payload_ = root_payload;
    for (int r = 1; r < world; ++r) send_all(peers_[r], "ID " + hex(root_payload) + "\n");
    monitor_ = std::thread([this] { serve(); });
  } else {
    int fd = -1;
    while (Clock::now() < deadline) {
      fd = ::socket(AF_INET, SOCK_STREAM, 0);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0) break;
      ::close(fd);
      fd = -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (fd < 0)
      KILN_THROW("rendezvous: rank ", rank, " cannot reach rank 0 at ", addr, ":", port, " within ",
                 std::chrono::duration<double>(timeout).count(), " s");
    send_all(fd, cat("HELLO ", rank, "\n"));
    std::string line;
    if (!read_line(fd, line, deadline) || line.rfind("ID ", 0) != 0) {
      ::close(fd);
      KILN_THROW("rendezvous: rank ", rank, " got no id from rank 0 at ", addr, ":", port);
    }
    payload_ = unhex(line.substr(3));
    peers_.assign(1, fd);
    monitor_ = std::thread([this] { listen(); });
  }
}

Rendezvous::~Rendezvous() {
  // No goodbye here: a rank that leaves without finish() (an error) is reported to the others.
  stopping_ = true;
  if (wake_[1] >= 0) {
    char c = 1;
    (void)!::write(wake_[1], &c, 1);
  }
  if (monitor_.joinable()) monitor_.join();
  for (int fd : peers_)
    if (fd >= 0) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
  for (int fd : wake_)
    if (fd >= 0) ::close(fd);
}

std::optional<std::string> Rendezvous::failure() const {
  std::lock_guard lk(mutex_);
  return failure_;
}

void Rendezvous::fail(const std::string& why) {
  std::lock_guard lk(mutex_);
  if (!failure_ && !finished_) failure_ = why;
}

void Rendezvous::finish() {
  {
    std::lock_guard lk(mutex_);
    if (finished_) return;
    finished_ = true;
  }
  if (rank_ != 0) {
    if (!peers_.empty() && peers_[0] >= 0) send_all(peers_[0], "DONE\n");
    return;
  }
  // Rank 0 keeps the channel open until every rank has said goodbye, so nobody mistakes its exit
  // for a crash.
  const auto deadline = Clock::now() + timeout_;
  while (Clock::now() < deadline) {
    bool all = true;
    {
      std::lock_guard lk(mutex_);
      for (int r = 1; r < world_; ++r) all = all && (done_[r] || peers_[r] < 0);
    }
    if (all) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void Rendezvous::serve() {
  std::vector<std::string> partial(world_);
  while (!stopping_) {
    std::vector<pollfd> fds{{wake_[0], POLLIN, 0}};
    std::vector<int> who{-1};
    {
      std::lock_guard lk(mutex_);
      for (int r = 1; r < world_; ++r)
        if (peers_[r] >= 0) {
          fds.push_back({peers_[r], POLLIN, 0});
          who.push_back(r);
        }
    }
    if (::poll(fds.data(), fds.size(), 500) <= 0) continue;
    if (fds[0].revents) return;
    for (std::size_t i = 1; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      const int r = who[i];
      char buf[256];
      ssize_t n = ::recv(fds[i].fd, buf, sizeof buf, 0);
      if (n > 0) {
        partial[r].append(buf, static_cast<std::size_t>(n));
        if (partial[r].find("DONE\n") != std::string::npos) {
          std::lock_guard lk(mutex_);
          done_[r] = true;
        }
        continue;
      }
      bool clean;
      {
        std::lock_guard lk(mutex_);
        clean = done_[r];
        ::close(peers_[r]);
        peers_[r] = -1;
      }
      if (clean) continue;
      const std::string why = cat("rank ", r, " disconnected (its process exited or crashed)");
      fail(why);
      std::lock_guard lk(mutex_);
      for (int q = 1; q < world_; ++q)
        if (peers_[q] >= 0) send_all(peers_[q], cat("FAIL ", r, "\n"));
    }
  }
}

void Rendezvous::listen() {
  std::string pending;
  while (!stopping_) {
    pollfd fds[2] = {{wake_[0], POLLIN, 0}, {peers_[0], POLLIN, 0}};
    if (::poll(fds, 2, 500) <= 0) continue;
    if (fds[0].revents) return;
    char buf[256];
    ssize_t n = ::recv(peers_[0], buf, sizeof buf, 0);
    if (n <= 0) {
      fail("rank 0 disconnected (its process exited or crashed)");
      return;
    }
    pending.append(buf, static_cast<std::size_t>(n));
    std::size_t nl;
    while ((nl = pending.find('\n')) != std::string::npos) {
      std::string line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      if (line.rfind("FAIL ", 0) == 0) fail(cat("rank ", line.substr(5), " disconnected (its process exited or crashed)"));
    }
  }
}

}  // namespace kiln::parallel
