#pragma once
// A point in a device stream's queued work that other streams (or the host) can wait for: a CUDA
// event. Without a device (null streams: the CPU backend, or a build without CUDA) everything runs
// in order on the host and every call is a no-op.
namespace kiln::parallel {

class StreamEvent {
 public:
  StreamEvent() = default;
  ~StreamEvent();
  StreamEvent(StreamEvent&& o) noexcept : event_(o.event_) { o.event_ = nullptr; }
  StreamEvent& operator=(StreamEvent&& o) noexcept;
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;

  // Marks the work queued on `stream` (a cudaStream_t; null: nothing to mark) so far.
  void record(void* stream);
  // Work queued on `stream` from now on runs after the marked work (nothing if nothing is marked).
  void wait(void* stream) const;
  // The host waits for the marked work.
  void synchronize() const;
  // Marks nothing again, as before the first record (waits return at once): for work the waiting
  // streams are known to follow already, such as before a CUDA graph that cannot wait for events
  // recorded outside it.
  void forget();

 private:
  void* event_ = nullptr;  // cudaEvent_t, made at the first record on a device stream
};

// Whether work queued on `stream` (a cudaStream_t; null: the host, never) is being captured into a
// CUDA graph instead of run.
bool capturing(void* stream);

}  // namespace kiln::parallel
