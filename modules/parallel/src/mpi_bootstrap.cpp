#include "kiln/parallel/mpi_bootstrap.hpp"

#include <dlfcn.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "kiln/core/error.hpp"

namespace kiln::parallel {

namespace {

constexpr const char* kPlugin = "libkiln_mpi_bootstrap.so";

// A TCP port nobody listens on now (the kernel's choice; another process could take it before the
// rendezvous binds it, which the rendezvous then reports).
int any_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  KILN_CHECK(fd >= 0, "socket: ", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  KILN_CHECK(ok, "finding a free TCP port: ", std::strerror(errno));
  return ntohs(a.sin_port);
}

std::string host_name() {
  char name[256] = {};
  KILN_CHECK(::gethostname(name, sizeof name - 1) == 0, "gethostname: ", std::strerror(errno));
  return name;
}

// Fixed layout: [4-byte payload size][payload][4-byte port][address]; kBytes in all.
constexpr std::size_t kBytes = 1024;
void put(std::string& b, std::size_t& at, const void* p, std::size_t n) {
  KILN_CHECK(at + n <= b.size(), "MPI bootstrap message over ", b.size(), " bytes");
  std::memcpy(b.data() + at, p, n);
  at += n;
}
void get(const std::string& b, std::size_t& at, void* p, std::size_t n) {
  KILN_CHECK(at + n <= b.size(), "malformed MPI bootstrap message");
  std::memcpy(p, b.data() + at, n);
  at += n;
}

}  // namespace

std::optional<MpiBootstrap> MpiBootstrap::load(std::string* why_not) {
  const char* env = std::getenv("KILN_MPI_BOOTSTRAP");
  const std::string path = env && *env ? env : kPlugin;
  // RTLD_GLOBAL: Open MPI's components look up libmpi's symbols globally.
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    if (why_not) *why_not = cat("cannot load ", path, ": ", ::dlerror());
    return std::nullopt;
  }
  auto fn = reinterpret_cast<Fn>(::dlsym(h, "kiln_mpi_broadcast"));
  if (!fn) {
    if (why_not) *why_not = cat(path, " has no kiln_mpi_broadcast");
    return std::nullopt;
  }
  return MpiBootstrap(fn, path);
}

std::string MpiBootstrap::broadcast(std::string bytes, int rank, int world) const {
  int r = -1, n = -1;
  char err[256] = {};
  if (fn_(bytes.data(), static_cast<int>(bytes.size()), &r, &n, err, sizeof err) != 0)
    KILN_THROW("rank ", rank, ": MPI bootstrap (", path_, "): ", err);
  KILN_CHECK(r == rank && n == world, "MPI says rank ", r, " of ", n, " but the launcher's environment says rank ",
             rank, " of ", world);
  return bytes;
}

std::shared_ptr<Rendezvous> mpi_rendezvous(const LaunchEnv& env, const std::string& root_payload,
                                           std::chrono::milliseconds timeout, std::string* why_not) {
  auto mpi = MpiBootstrap::load(why_not);
  if (!mpi) return nullptr;
  std::string msg(kBytes, '\0');
  if (env.rank == 0) {
    const char* addr_env = std::getenv("MASTER_ADDR");
    const std::string addr = addr_env && *addr_env ? addr_env
                             : env.local_world >= env.world ? "127.0.0.1"
                                                            : host_name();
    const char* port_env = std::getenv("MASTER_PORT");
    const std::int32_t port = port_env && *port_env ? std::atoi(port_env) : any_free_port();
    const auto size = static_cast<std::int32_t>(root_payload.size());
    std::size_t at = 0;
    put(msg, at, &size, 4);
    put(msg, at, root_payload.data(), root_payload.size());
    put(msg, at, &port, 4);
    put(msg, at, addr.data(), addr.size());
  }
  msg = mpi->broadcast(std::move(msg), env.rank, env.world);
  std::size_t at = 0;
  std::int32_t size = 0, port = 0;
  get(msg, at, &size, 4);
  KILN_CHECK(size >= 0 && static_cast<std::size_t>(size) < kBytes, "malformed MPI bootstrap message");
  std::string payload(static_cast<std::size_t>(size), '\0');
  get(msg, at, payload.data(), payload.size());
  get(msg, at, &port, 4);
  const std::string addr(msg.c_str() + at);
  auto rdv = std::make_shared<Rendezvous>(addr, port, env.rank, env.world, env.rank == 0 ? payload : std::string(),
                                          timeout);
  KILN_CHECK(rdv->payload() == payload, "rank ", env.rank, ": the rendezvous handed out other bytes than MPI did");
  return rdv;
}

}  // namespace kiln::parallel
