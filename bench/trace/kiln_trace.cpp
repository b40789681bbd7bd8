// A CUDA injection library that records every kernel, copy, memset and host-side synchronisation
// of a process with CUPTI's activity API and writes them as CSV when the process exits: the GPU's
// timeline without Nsight Systems (which the lent GPU machines lack). No change to the program:
//   CUDA_INJECTION64_PATH=$PWD/build/lib/libkiln_trace.so KILN_TRACE=trace.csv kiln run ...
//   (KILN_TRACE=trace-{rank}.csv: one file per rank of a multi-process job)
//   python3 bench/trace/summary.py trace.csv
// Columns: kind (kernel, memcpy, memset, sync, runtime, driver), start and end (ns, CUPTI's clock
// for all: a sync or API record's times are the host's), stream (for runtime and driver calls the
// host thread), correlation (a kernel, copy or memset and the API call that launched it share it),
// name (demangled kernel name, the copy's kind, the API function).
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include <unistd.h>

namespace {

std::FILE* g_out = nullptr;
std::mutex g_mutex;

#define TRACE_CHECK(call)                                                                      \
  do {                                                                                         \
    const CUptiResult r_ = (call);                                                             \
    if (r_ != CUPTI_SUCCESS) {                                                                 \
      const char* s_ = nullptr;                                                                \
      cuptiGetResultString(r_, &s_);                                                           \
      std::fprintf(stderr, "kiln_trace: %s failed: %s (%s:%d)\n", #call, s_ ? s_ : "?", __FILE__, \
                   __LINE__);                                                                  \
    }                                                                                          \
  } while (0)

std::string demangle(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : name;
  std::free(d);
  for (char& c : s)
    if (c == ',' || c == '\n') c = ';';
  return s;
}

void CUPTIAPI buffer_requested(std::uint8_t** buffer, std::size_t* size, std::size_t* max_records) {
  *size = 8u << 20;
  *buffer = static_cast<std::uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, std::uint32_t, std::uint8_t* buffer, std::size_t, std::size_t valid) {
  std::lock_guard<std::mutex> lock(g_mutex);
  CUpti_Activity* record = nullptr;
  while (g_out && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    switch (record->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
        std::fprintf(g_out, "kernel,%llu,%llu,%u,%u,%s\n", static_cast<unsigned long long>(k->start),
                     static_cast<unsigned long long>(k->end), k->streamId, k->correlationId,
                     demangle(k->name).c_str());
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
        std::fprintf(g_out, "memcpy,%llu,%llu,%u,%u,copy kind %u (%llu bytes)\n",
                     static_cast<unsigned long long>(m->start), static_cast<unsigned long long>(m->end), m->streamId,
                     m->correlationId, static_cast<unsigned>(m->copyKind),
                     static_cast<unsigned long long>(m->bytes));
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
        std::fprintf(g_out, "memset,%llu,%llu,%u,%u,memset (%llu bytes)\n", static_cast<unsigned long long>(m->start),
                     static_cast<unsigned long long>(m->end), m->streamId, m->correlationId,
                     static_cast<unsigned long long>(m->bytes));
        break;
      }
      case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
        const auto* s = reinterpret_cast<const CUpti_ActivitySynchronization2*>(record);
        std::fprintf(g_out, "sync,%llu,%llu,%u,%u,sync type %u\n", static_cast<unsigned long long>(s->start),
                     static_cast<unsigned long long>(s->end), s->streamId, s->correlationId,
                     static_cast<unsigned>(s->type));
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
        const bool runtime = record->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
        const char* name = nullptr;
        cuptiGetCallbackName(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &name);
        std::fprintf(g_out, "%s,%llu,%llu,%u,%u,%s\n", runtime ? "runtime" : "driver",
                     static_cast<unsigned long long>(a->start), static_cast<unsigned long long>(a->end), a->threadId,
                     a->correlationId, name ? name : "?");
        break;
      }
      default: break;
    }
  }
  std::free(buffer);
}

void at_exit() {
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_out) std::fclose(g_out);
  g_out = nullptr;
}

}  // namespace

extern "C" int InitializeInjection() {
  // "{rank}" in the path becomes the process's RANK (kiln's launcher sets it), so that the ranks of
  // one job write one file each.
  const char* env = std::getenv("KILN_TRACE");
  std::string path = env && *env ? env : "kiln_trace.csv";
  if (const auto at = path.find("{rank}"); at != std::string::npos) {
    const char* rank = std::getenv("RANK");
    path.replace(at, 6, rank && *rank ? std::string(rank) : "pid" + std::to_string(getpid()));
  }
  g_out = std::fopen(path.c_str(), "w");
  if (!g_out) {
    std::fprintf(stderr, "kiln_trace: cannot write %s\n", path.c_str());
    return 0;
  }
  std::fprintf(g_out, "kind,start,end,stream,correlation,name\n");
  TRACE_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
  TRACE_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL));
  TRACE_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY));
  TRACE_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET));
  TRACE_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_SYNCHRONIZATION));
  // The host's side: every runtime and driver call (KILN_TRACE_API=0 leaves them out).
  const char* api = std::getenv("KILN_TRACE_API");
  if (!api || std::string(api) != "0") {
    TRACE_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME));
    TRACE_CHECK(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER));
  }
  std::atexit(at_exit);
  return 1;
}
