// A driver for kiln's fuzz targets without libFuzzer, for the GCC sanitizer build (scripts/sanitize.sh),
// where each target runs as a test: every input of the given corpus directories (or files) once,
// then, with --mutate SECONDS, random mutations of them for that long (bit flips, random and
// boundary bytes and integers, insertions, deletions and copies of ranges, splices of two inputs,
// dictionary tokens from --dict, libFuzzer's format). No coverage guidance: it is CI's short run of
// each harness under AddressSanitizer and UndefinedBehaviorSanitizer; the search is libFuzzer's
// (scripts/fuzz.sh, clang). The mutations follow --seed, so a run that fails repeats with the same
// arguments; the failing input is also written to ./fuzz-replay-crash.bin when the run aborts.
//
// usage: TARGET_replay [--mutate SECONDS] [--seed N] [--dict FILE] [--max-len BYTES] CORPUS...
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {

using Bytes = std::vector<std::uint8_t>;

// The input being run, for the abort handler.
const std::uint8_t* g_current = nullptr;
std::size_t g_current_size = 0;

void save_current(int sig) {
  if (g_current) {
    const int fd = ::open("fuzz-replay-crash.bin", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      std::size_t done = 0;
      while (done < g_current_size) {
        const ssize_t n = ::write(fd, g_current + done, g_current_size - done);
        if (n <= 0) break;
        done += static_cast<std::size_t>(n);
      }
      ::close(fd);
    }
    static const char msg[] = "kiln fuzz replay: the failing input is in ./fuzz-replay-crash.bin\n";
    (void)!::write(2, msg, sizeof msg - 1);
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

Bytes read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "kiln fuzz replay: cannot read %s\n", p.c_str());
    std::exit(2);
  }
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// libFuzzer's dictionary format: one token a line, `name="value"` or `"value"`, with \\, \" and
// \xNN escapes; # starts a comment.
std::vector<Bytes> read_dict(const std::string& path) {
  std::vector<Bytes> tokens;
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "kiln fuzz replay: cannot read the dictionary %s\n", path.c_str());
    std::exit(2);
  }
  std::string line;
  while (std::getline(in, line)) {
    const auto open = line.find('"');
    const auto hash = line.find('#');
    if (open == std::string::npos || (hash != std::string::npos && hash < open)) continue;
    Bytes t;
    for (std::size_t i = open + 1; i < line.size() && line[i] != '"'; ++i) {
      if (line[i] == '\\' && i + 1 < line.size()) {
        if (line[i + 1] == 'x' && i + 3 < line.size()) {
          t.push_back(static_cast<std::uint8_t>(std::stoi(line.substr(i + 2, 2), nullptr, 16)));
          i += 3;
        } else {
          t.push_back(static_cast<std::uint8_t>(line[i + 1]));
          ++i;
        }
      } else {
        t.push_back(static_cast<std::uint8_t>(line[i]));
      }
    }
    if (!t.empty()) tokens.push_back(std::move(t));
  }
  return tokens;
}

class Mutator {
 public:
  Mutator(std::uint64_t seed, const std::vector<Bytes>& inputs, const std::vector<Bytes>& dict, std::size_t max_len)
      : rng_(seed), inputs_(inputs), dict_(dict), max_len_(max_len) {}

  Bytes next() {
    Bytes b = inputs_[pick(inputs_.size())];
    const int n = 1 + static_cast<int>(pick(8));
    for (int i = 0; i < n; ++i) mutate(b);
    if (b.size() > max_len_) b.resize(max_len_);
    return b;
  }

 private:
  std::size_t pick(std::size_t n) { return n == 0 ? 0 : static_cast<std::size_t>(rng_() % n); }

  void mutate(Bytes& b) {
    static const std::uint8_t kBytes[] = {0, 1, 0x7f, 0x80, 0xff, ' ', '"', '\\', '{', '}', '[', ']', ',', ':',
                                          '=', '0', '9', '-', '.', 'e', '\n', '\t'};
    static const std::uint64_t kInts[] = {0, 1, 2, 0x7f, 0x80, 0xff, 0x7fff, 0xffff, 0x7fffffff, 0xffffffff,
                                          0x100000000ull, 0x7fffffffffffffffull, ~0ull};
    switch (pick(b.empty() ? 3 : 10)) {
      case 0:  // insert random bytes
      case 1: {
        const std::size_t at = pick(b.size() + 1), n = 1 + pick(8);
        Bytes r(n);
        for (auto& x : r) x = static_cast<std::uint8_t>(rng_());
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), r.begin(), r.end());
        break;
      }
      case 2: {  // insert a dictionary token (or a boundary byte)
        const std::size_t at = pick(b.size() + 1);
        if (dict_.empty()) {
          b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), kBytes[pick(std::size(kBytes))]);
        } else {
          const Bytes& t = dict_[pick(dict_.size())];
          b.insert(b.begin() + static_cast<std::ptrdiff_t>(at), t.begin(), t.end());
        }
        break;
      }
      case 3:  // flip a bit
        b[pick(b.size())] ^= static_cast<std::uint8_t>(1u << pick(8));
        break;
      case 4:  // a random byte
        b[pick(b.size())] = static_cast<std::uint8_t>(rng_());
        break;
      case 5:  // a boundary byte
        b[pick(b.size())] = kBytes[pick(std::size(kBytes))];
        break;
      case 6: {  // a boundary integer, 1, 2, 4 or 8 bytes little-endian, where it fits
        const std::size_t w = std::size_t{1} << pick(4);
        if (b.size() < w) break;
        std::uint64_t v = kInts[pick(std::size(kInts))];
        if (pick(2)) v = ~v + 1;  // its negation
        const std::size_t at = pick(b.size() - w + 1);
        for (std::size_t i = 0; i < w; ++i) b[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
        break;
      }
      case 7: {  // delete a range
        const std::size_t at = pick(b.size()), n = 1 + pick(std::min<std::size_t>(16, b.size() - at));
        b.erase(b.begin() + static_cast<std::ptrdiff_t>(at), b.begin() + static_cast<std::ptrdiff_t>(at + n));
        break;
      }
      case 8: {  // copy a range elsewhere
        const std::size_t from = pick(b.size()), n = 1 + pick(std::min<std::size_t>(32, b.size() - from));
        const Bytes r(b.begin() + static_cast<std::ptrdiff_t>(from), b.begin() + static_cast<std::ptrdiff_t>(from + n));
        b.insert(b.begin() + static_cast<std::ptrdiff_t>(pick(b.size() + 1)), r.begin(), r.end());
        break;
      }
      default: {  // splice: this input's head, another's tail
        const Bytes& o = inputs_[pick(inputs_.size())];
        if (o.empty()) break;
        b.resize(pick(b.size() + 1));
        b.insert(b.end(), o.begin() + static_cast<std::ptrdiff_t>(pick(o.size())), o.end());
        break;
      }
    }
  }

  std::mt19937_64 rng_;
  const std::vector<Bytes>& inputs_;
  const std::vector<Bytes>& dict_;
  std::size_t max_len_;
};

void run(const Bytes& b) {
  g_current = b.data();
  g_current_size = b.size();
  LLVMFuzzerTestOneInput(b.data(), b.size());
  g_current = nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  double seconds = 0;
  std::uint64_t seed = 1;
  std::size_t max_len = 0;
  std::string dict_path;
  std::vector<std::filesystem::path> files;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool has_value = i + 1 < argc;
    if (a == "--mutate" && has_value) {
      seconds = std::atof(argv[++i]);
    } else if (a == "--seed" && has_value) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--dict" && has_value) {
      dict_path = argv[++i];
    } else if (a == "--max-len" && has_value) {
      max_len = std::strtoull(argv[++i], nullptr, 10);
    } else if (a.starts_with("--")) {
      std::fprintf(stderr, "usage: %s [--mutate SECONDS] [--seed N] [--dict FILE] [--max-len BYTES] CORPUS...\n", argv[0]);
      return 2;
    } else if (std::filesystem::is_directory(a)) {
      std::vector<std::filesystem::path> in_dir;
      for (const auto& e : std::filesystem::directory_iterator(a))
        if (e.is_regular_file()) in_dir.push_back(e.path());
      std::sort(in_dir.begin(), in_dir.end());
      files.insert(files.end(), in_dir.begin(), in_dir.end());
    } else {
      files.emplace_back(a);
    }
  }
  std::signal(SIGABRT, save_current);
  std::signal(SIGSEGV, save_current);
  std::vector<Bytes> inputs;
  for (const auto& f : files) {
    inputs.push_back(read_file(f));
    run(inputs.back());
  }
  if (inputs.empty()) inputs.emplace_back();  // mutations start from nothing
  std::size_t largest = 0;
  for (const auto& b : inputs) largest = std::max(largest, b.size());
  if (max_len == 0) max_len = std::max<std::size_t>(4096, 2 * largest);
  const std::vector<Bytes> dict = dict_path.empty() ? std::vector<Bytes>{} : read_dict(dict_path);
  std::uint64_t mutations = 0;
  if (seconds > 0) {
    Mutator m(seed, inputs, dict, max_len);
    const auto start = std::chrono::steady_clock::now();
    const auto end = start + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < end) {
      for (int i = 0; i < 16; ++i, ++mutations) run(m.next());
    }
  }
  std::printf("kiln fuzz replay: %zu inputs, %llu mutations (seed %llu, %zu dictionary tokens): no finding\n",
              files.size(), static_cast<unsigned long long>(mutations), static_cast<unsigned long long>(seed),
              dict.size());
  return 0;
}
