#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "kiln/core/error.hpp"
#include "kiln/parallel/launch.hpp"

namespace kiln::parallel {

namespace {

int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    KILN_THROW("cannot find a free TCP port for the rendezvous: ", std::strerror(errno));
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

struct Child {
  pid_t pid = -1;
  int err_fd = -1;
  std::string partial;
  bool running = true;
  int code = 0;
};

std::string describe_status(int status) {
  if (WIFEXITED(status)) return cat("exited with code ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return cat("was killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  return "stopped";
}

}  // namespace

int run_local_processes(int nproc, const std::vector<std::string>& argv, double timeout_s) {
  const int port = free_port();
  std::vector<Child> kids(static_cast<std::size_t>(nproc));
  for (int r = 0; r < nproc; ++r) {
    int fds[2];
    if (::pipe(fds) != 0) KILN_THROW("pipe failed: ", std::strerror(errno));
    pid_t pid = ::fork();
    if (pid < 0) KILN_THROW("fork failed: ", std::strerror(errno));
    if (pid == 0) {
      ::dup2(fds[1], STDERR_FILENO);
      ::close(fds[0]);
      ::close(fds[1]);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      ::setenv("KILN_LAUNCHER", "1", 1);
      std::vector<char*> args;
      std::string self = "/proc/self/exe";
      args.push_back(self.data());
      std::vector<std::string> copy = argv;
      for (auto& a : copy) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv("/proc/self/exe", args.data());
      std::fprintf(stderr, "kiln: cannot start rank %d: %s\n", r, std::strerror(errno));
      ::_exit(127);
    }
    ::close(fds[1]);
    kids[static_cast<std::size_t>(r)] = Child{pid, fds[0]};
  }

  int first_failure = -1, exit_code = 0;
  std::chrono::steady_clock::time_point stop_deadline{};
  auto forward = [&](Child& c, int r, bool flush) {
    std::size_t nl;
    while ((nl = c.partial.find('\n')) != std::string::npos) {
      std::cerr << "[rank " << r << "] " << c.partial.substr(0, nl) << "\n";
      c.partial.erase(0, nl + 1);
    }
    if (flush && !c.partial.empty()) {
      std::cerr << "[rank " << r << "] " << c.partial << "\n";
      c.partial.clear();
    }
  };
  int alive = nproc;
  while (alive > 0) {
    std::vector<pollfd> fds;
    std::vector<int> who;
    for (int r = 0; r < nproc; ++r)
      if (kids[r].err_fd >= 0) {
        fds.push_back({kids[r].err_fd, POLLIN, 0});
        who.push_back(r);
      }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 100);
    else std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      auto& c = kids[static_cast<std::size_t>(who[i])];
      char buf[4096];
      ssize_t n = ::read(c.err_fd, buf, sizeof buf);
      if (n > 0) {
        c.partial.append(buf, static_cast<std::size_t>(n));
        forward(c, who[i], false);
      } else {
        forward(c, who[i], true);
        ::close(c.err_fd);
        c.err_fd = -1;
      }
    }
    for (int r = 0; r < nproc; ++r) {
      auto& c = kids[static_cast<std::size_t>(r)];
      if (!c.running) continue;
      int status = 0;
      const pid_t pid = c.pid > 0 ? c.pid : -c.pid;
      if (::waitpid(pid, &status, WNOHANG) != pid) continue;
      c.running = false;
      --alive;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && first_failure < 0) {
        first_failure = r;
        exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        std::cerr << "[kiln] rank " << r << " " << describe_status(status)
                  << "; stopping the other ranks (they are told through the rendezvous)\n";
        // A few seconds to stop on their own and report where they were; a rank that died before
        // joining the rendezvous cannot be reported to them, so they are terminated after that.
        stop_deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<std::int64_t>(std::min(timeout_s, 10.0) * 1000));
      }
    }
    // Ranks that do not stop on their own after a failure are terminated.
    if (first_failure >= 0 && std::chrono::steady_clock::now() > stop_deadline) {
      for (int r = 0; r < nproc; ++r)
        if (kids[r].running && kids[r].pid > 0) {
          std::cerr << "[kiln] terminating rank " << r << " (it did not stop after rank " << first_failure
                    << " failed)\n";
          ::kill(kids[r].pid, SIGKILL);
          kids[r].pid = -kids[r].pid;  // report once
        }
    }
  }
  return exit_code;
}

}  // namespace kiln::parallel
