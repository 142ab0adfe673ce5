// Offload of saved tensors: OffloadScope, OffloadOptions and the store behind
// them (src/offload/offload_internal.h). Leaves out: O_DIRECT / io_uring, content
// checksums (file sizes and codec frames are checked), a pinned pool of our
// own (kHost uses the CUDA build's caching host allocator through
// pinned_memory(true)).
//
// NOTE [offload pipeline]
// pack (forward thread) decides per tensor: keep it (below min_bytes, a leaf
// that requires grad, not strided, or kHost on a CPU tensor), share an entry
// already holding the same tensor (same storage, offset, shape, strides,
// version: softmax's output is saved again by the next matmul), or store it.
// What is stored is a region of the tensor's storage, in storage order: a
// view's whole base when the base is dense and holds it (q, k and v of one
// qkv projection; the 2-D reshape linear saves of a 3-D input), else the
// tensor's own span; each handle restores its tensor with as_strided on it,
// so strides come back exactly and views share memory again, as in a plain
// run. kMemory encodes at pack. kDisk queues the tensor for a writer thread and
// holds it (counted in the in-flight bytes) until its file is written. unpack
// (backward) takes a pending tensor straight from memory (through encode and
// decode when the codec is lossy: the values the file will hold, so that the
// result does not depend on whether the write was done), a prefetched one
// from the reader's buffer, or reads the file itself; then asks the reader for
// the next prefetch_depth entries still on disk that the thread which saved
// this one saved, in reverse save order (highest id first: backward runs the
// graph backwards; another thread's tensors belong to another graph).
// Pending writes and prefetched reads share max_inflight_bytes. A pack that
// finds no room drops the prefetched reads not in progress back to their
// files (they may belong to a graph whose backward comes after this very
// forward: waiting for them could wait forever) and then waits only for what
// drains by itself: writes, and reads in progress; no prefetch is issued
// while a pack waits. So a pack never waits on another graph's backward,
// whatever graphs and threads share the store. A handle's release (its
// SavedVariable freed: after backward used it, or the graph dropped without
// backward) deletes the file once no handle shares the entry. Errors of the
// threads are kept on the entry (its unpack throws them) and on the store
// (the next pack, wait() and the scope's destructor throw them).
#include <remat/offload.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/graph_task.h>

#include <remat/error.h>

#include "../core/dispatch.h"
#include "offload_codec.h"
#include "offload_internal.h"

namespace remat {

std::string to_string(OffloadTarget target) {
  switch (target) {
    case OffloadTarget::kMemory: return "kMemory";
    case OffloadTarget::kHost: return "kHost";
    case OffloadTarget::kDisk: return "kDisk";
  }
  return "?";
}

std::string to_string(Codec codec) {
  switch (codec) {
    case Codec::kNone: return "kNone";
    case Codec::kZstd: return "kZstd";
    case Codec::kLz4: return "kLz4";
    case Codec::kBFloat16: return "kBFloat16";
    case Codec::kFloat8: return "kFloat8";
    case Codec::kInt8Block: return "kInt8Block";
  }
  return "?";
}

namespace detail {
namespace {

std::atomic<int64_t> g_write_fail_at{0}, g_writes_seen{0};
std::atomic<int64_t> g_read_fail_at{0}, g_reads_seen{0};
std::atomic<int64_t> g_store_ids{0};
std::atomic<bool> g_writers_paused{false};
std::atomic<int64_t> g_saver_ids{0};

/** The saving thread's tag: prefetch follows it (NOTE [offload pipeline]). */
int64_t saver_id() {
  thread_local const int64_t id = g_saver_ids.fetch_add(1);
  return id;
}

bool lossy(Codec c) { return c == Codec::kBFloat16 || c == Codec::kFloat8 || c == Codec::kInt8Block; }

/** True when the seam says this write / read must fail. */
bool injected(std::atomic<int64_t>& at, std::atomic<int64_t>& seen) {
  const int64_t n = at.load();
  return n > 0 && seen.fetch_add(1) + 1 == n;
}

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

std::string shape_str(c10::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

void write_all(int fd, const char* p, int64_t n, const std::string& path) {
  const bool fail = injected(g_write_fail_at, g_writes_seen);
  const int64_t limit = fail ? n / 2 : n;
  int64_t done = 0;
  while (done < limit) {
    const ssize_t w = ::write(fd, p + done, static_cast<size_t>(std::min<int64_t>(limit - done, int64_t{1} << 30)));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      throw Error("[remat::offload] writing " + format_bytes(n) + " to " + path + " failed: " + std::strerror(errno) +
                  ". Free space there or pass another directory to OffloadOptions().directory().");
    }
    done += w;
  }
  if (fail) {
    throw Error("[remat::offload] writing " + format_bytes(n) + " to " + path + " failed: " + std::strerror(ENOSPC) +
                " (injected). Free space there or pass another directory to OffloadOptions().directory().");
  }
}

void read_all(int fd, char* p, int64_t n, const std::string& path) {
  const bool fail = injected(g_read_fail_at, g_reads_seen);
  int64_t done = 0;
  while (!fail && done < n) {
    const ssize_t r = ::read(fd, p + done, static_cast<size_t>(std::min<int64_t>(n - done, int64_t{1} << 30)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    done += r;
  }
  if (fail || done != n) {
    throw Error("[remat::offload] reading " + format_bytes(n) + " from " + path + " failed: " +
                (fail ? std::string(std::strerror(EIO)) + " (injected)" : std::string(std::strerror(errno))) +
                ". The saved tensor is lost; run the step again.");
  }
}

}  // namespace

enum class Where : uint8_t {
  kKept,     // tensor held as it is
  kMemory,   // encoded, in enc.data
  kHost,     // copied to pinned host memory (host + done event)
  kPending,  // kDisk: queued or being written; tensor held until then
  kDisk,     // in the file at path
  kFailed,   // its write failed (error)
};
enum class Read : uint8_t { kNone, kQueued, kReading, kReady };

struct OffloadStore::Entry {
  int64_t id = 0;     // save order
  int64_t saver = 0;  // the thread that saved it (saver_id())
  TensorMeta meta;
  c10::VariableVersion version_counter{c10::VariableVersion::Disabled::DISABLED};
  uint32_t version = 0;
  bool track_version = false;
  Where where = Where::kKept;
  at::Tensor tensor;  // kKept; kPending: the source of the write
  Encoded enc;        // kMemory: with data; kDisk: data dropped once written
  at::Tensor host;    // kHost
  std::shared_ptr<c10::Event> host_done;
  std::string path;
  bool file_exists = false;
  bool writing = false;
  bool released = false;
  bool kept_after_failed_write = false;  // kKept holding the region (create_isolated)
  Read read = Read::kNone;
  at::Tensor ready;  // prefetched, or cached for the other handles sharing it
  std::string error;
  int refs = 0, unpacked_refs = 0;
  // Sharing key (see NOTE [offload pipeline]); the weak pointer pins the
  // StorageImpl's address so that no new storage can reuse it.
  c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
  // (storage, version, dtype, first element, one past the last) of the
  // region of storage this entry holds.
  std::optional<std::tuple<const void*, uint32_t, int, int64_t, int64_t>> key;
  int64_t region_begin = 0;  // storage offset of the region, elements
};

struct OffloadStore::State {
  mutable std::mutex mu;
  std::condition_variable cv;  // any state change: queues, in-flight bytes, reads, writes
  std::vector<std::thread> threads;
  bool stop = false;
  int64_t store_id = 0;
  int64_t next_id = 0;
  std::deque<std::shared_ptr<Entry>> write_queue, read_queue;
  int64_t writes_active = 0;
  // Not yet asked for: by saving thread, then save order.
  std::map<int64_t, std::map<int64_t, std::weak_ptr<Entry>>> on_disk;
  std::map<decltype(Entry::key)::value_type, std::weak_ptr<Entry>> shared;
  std::map<int64_t, std::shared_ptr<Entry>> files;       // entries with a file, by id
  std::map<int64_t, std::shared_ptr<Entry>> prefetched;  // queued + reading + ready, not yet unpacked, by id
  int64_t prefetches = 0;                                // prefetched.size()
  int64_t packs_waiting = 0;                             // packs blocked on max_inflight_bytes
  int64_t inflight_bytes = 0;
  std::string error;  // first background error
  OffloadStats st;
  int64_t isolated_failures = 0;  // create_isolated: writes that failed, tensors kept
  std::string last_isolated_error;

  void add_on_disk(const std::shared_ptr<Entry>& e) { on_disk[e->saver][e->id] = e; }
  void forget_on_disk(const Entry& e) {
    auto it = on_disk.find(e.saver);
    if (it == on_disk.end()) return;
    it->second.erase(e.id);
    if (it->second.empty()) on_disk.erase(it);
  }
  void add_prefetch(std::shared_ptr<Entry> e) {
    e->read = Read::kQueued;
    st.prefetches_issued++;
    prefetches++;
    inflight_bytes += e->meta.nbytes;
    st.peak_inflight_bytes = std::max(st.peak_inflight_bytes, inflight_bytes);
    prefetched[e->id] = e;
    read_queue.push_back(std::move(e));
  }
  /** A prefetch is over (taken, failed, released or dropped): its bytes leave the in-flight count. */
  void end_prefetch(Entry& e) {
    e.read = Read::kNone;
    prefetches--;
    inflight_bytes -= e.meta.nbytes;
    prefetched.erase(e.id);
  }
  /** Drops every prefetched read not in progress (queued, or ready but not
   *  unpacked) back to its file, for a pack that needs their bytes; returns
   *  whether any went. NOTE [offload pipeline]: this is what makes a pack
   *  independent of any backward. */
  bool drop_prefetches() {
    std::vector<std::shared_ptr<Entry>> drop;
    for (const auto& [id, e] : prefetched) {
      if (e->read == Read::kQueued || e->read == Read::kReady) drop.push_back(e);
    }
    for (const auto& e : drop) {
      end_prefetch(*e);
      e->ready = at::Tensor();
      st.prefetches_dropped++;
      if (!e->released && e->where == Where::kDisk && e->file_exists) add_on_disk(e);  // read again when needed
    }
    return !drop.empty();
  }
};

OffloadStore::Handle::Handle(Handle&& o) noexcept
    : store_(std::move(o.store_)),
      entry_(std::move(o.entry_)),
      unpacked_(o.unpacked_),
      sizes_(std::move(o.sizes_)),
      strides_(std::move(o.strides_)),
      offset_(o.offset_) {}

OffloadStore::Handle& OffloadStore::Handle::operator=(Handle&& o) noexcept {
  if (this != &o) {
    reset();
    store_ = std::move(o.store_);
    entry_ = std::move(o.entry_);
    unpacked_ = o.unpacked_;
    sizes_ = std::move(o.sizes_);
    strides_ = std::move(o.strides_);
    offset_ = o.offset_;
  }
  return *this;
}

void OffloadStore::Handle::reset() noexcept {
  if (entry_) store_->release(entry_);
  entry_.reset();
  store_.reset();
}

OffloadStore::OffloadStore(const OffloadOptions& options) : options_(options), s_(std::make_unique<State>()) {}

std::shared_ptr<OffloadStore> OffloadStore::create(const OffloadOptions& o) {
  auto bad = [](const std::string& field, int64_t v, const std::string& rule) {
    throw Error("[remat::offload] OffloadOptions::" + field + " is " + std::to_string(v) + "; it must be " + rule +
                ".");
  };
  if (o.min_bytes() < 0) bad("min_bytes", o.min_bytes(), ">= 0");
  if (o.prefetch_depth() < 0) bad("prefetch_depth", o.prefetch_depth(), ">= 0 (0 turns prefetching off)");
  if (o.max_inflight_bytes() <= 0) bad("max_inflight_bytes", o.max_inflight_bytes(), "> 0");
  if (o.writer_threads() < 1 || o.writer_threads() > 64) bad("writer_threads", o.writer_threads(), "in [1, 64]");
  if (o.target() == OffloadTarget::kHost && o.codec() != Codec::kNone) {
    throw Error("[remat::offload] codec " + to_string(o.codec()) +
                " does not apply to OffloadTarget::kHost (pinned copies stay raw); use kMemory or kDisk to "
                "compress, or codec(Codec::kNone).");
  }
  std::shared_ptr<OffloadStore> store(new OffloadStore(o));
  store->self_ = store;
  store->s_->store_id = g_store_ids.fetch_add(1);
  if (o.target() == OffloadTarget::kDisk) {
    const std::string& dir = o.directory();
    if (dir.empty()) {
      throw Error(
          "[remat::offload] OffloadTarget::kDisk needs a directory; set OffloadOptions().directory(path) to an "
          "existing, writable directory.");
    }
    struct stat sb;
    if (::stat(dir.c_str(), &sb) != 0) {
      throw Error("[remat::offload] directory '" + dir + "' cannot be used: " + std::strerror(errno) +
                  ". Create it (mkdir -p) or pass another one to OffloadOptions().directory().");
    }
    if (!S_ISDIR(sb.st_mode)) {
      throw Error("[remat::offload] directory '" + dir +
                  "' is not a directory. Pass a directory to OffloadOptions().directory().");
    }
    // Creating a file is the one test that covers permissions, read-only
    // mounts and ACLs alike.
    const std::string probe =
        dir + "/.remat-offload-probe-" + std::to_string(::getpid()) + "-" + std::to_string(store->s_->store_id);
    const int fd = ::open(probe.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
    if (fd < 0) {
      throw Error("[remat::offload] directory '" + dir + "' is not writable: creating a file in it failed (" +
                  std::strerror(errno) + "). Pass a writable directory to OffloadOptions().directory().");
    }
    ::close(fd);
    ::unlink(probe.c_str());
    for (int i = 0; i < o.writer_threads(); ++i)
      store->s_->threads.emplace_back([p = store.get()] { p->writer_loop(); });
    store->s_->threads.emplace_back([p = store.get()] { p->reader_loop(); });
  }
  return store;
}

std::shared_ptr<OffloadStore> OffloadStore::create_isolated(const OffloadOptions& options) {
  auto store = create(options);
  store->isolated_ = true;  // before any pack: the threads read it under the lock
  return store;
}

void OffloadStore::prefetch(const Handle& h) {
  const std::shared_ptr<Entry>& e = h.entry_;
  if (!e) return;
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (e->released || e->where != Where::kDisk || e->read != Read::kNone || e->ready.defined() || !e->error.empty())
    return;
  if (s.inflight_bytes > 0 && s.inflight_bytes + e->meta.nbytes > options_.max_inflight_bytes()) return;
  s.forget_on_disk(*e);
  s.add_prefetch(e);
  s.cv.notify_all();
}

bool OffloadStore::resident(const Handle& h) const {
  const std::shared_ptr<Entry>& e = h.entry_;
  if (!e) return false;
  std::lock_guard<std::mutex> lock(s_->mu);
  switch (e->where) {
    case Where::kDisk: return e->read == Read::kReady || e->ready.defined();
    case Where::kPending: return e->tensor.defined();
    case Where::kFailed: return false;
    default: return true;
  }
}

int64_t OffloadStore::failures(std::string* last_error) const {
  std::lock_guard<std::mutex> lock(s_->mu);
  if (last_error) *last_error = s_->last_isolated_error;
  return s_->isolated_failures;
}

OffloadStore::~OffloadStore() {
  {
    std::lock_guard<std::mutex> lock(s_->mu);
    s_->stop = true;
  }
  s_->cv.notify_all();
  for (auto& t : s_->threads) t.join();
  // Every handle is gone (each holds the store), so every file is too;
  // this sweep only guards against a bookkeeping slip.
  for (const auto& [id, e] : s_->files) ::unlink(e->path.c_str());
}

OffloadStore::Handle OffloadStore::pack(const at::Tensor& t) {
  dispatch::Suspend suspend;  // remat's own ops, not the region's
  at::NoGradGuard no_grad;
  Handle h;
  h.store_ = self_.lock();
  auto e = std::make_shared<Entry>();
  e->refs = 1;
  if (!t.defined()) {  // autograd never saves one through hooks; a direct caller may
    h.entry_ = std::move(e);
    return h;
  }
  e->meta = meta_of(t);
  // NOTE [offload pipeline]: the region of storage to store, elements.
  int64_t begin = t.storage_offset(), end = begin;
  if (t.defined() && t.layout() == at::kStrided && t.numel() > 0) {
    end = begin + 1;
    for (int64_t d = 0; d < t.dim(); ++d) end += (t.size(d) - 1) * t.stride(d);
    if (t.is_view()) {
      const at::TensorBase& b = t._base();
      const int64_t b_begin = b.storage_offset(), b_end = b_begin + b.numel();
      if (b.is_non_overlapping_and_dense() && b.is_alias_of(t) && b_begin <= begin && end <= b_end) {
        begin = b_begin;
        end = b_end;
      }
    }
  }
  const int64_t region_bytes = (end - begin) * static_cast<int64_t>(t.defined() ? t.element_size() : 0);
  if (!t.is_inference()) {  // inference tensors have no version counter
    e->version_counter = t.unsafeGetTensorImpl()->version_counter();
    e->version = t._version();
    e->track_version = true;
  }
  State& s = *s_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (!s.error.empty()) throw Error(s.error);
  s.st.tensors_saved++;
  e->id = s.next_id++;
  e->saver = saver_id();
  const OffloadTarget target = options_.target();
  // A parameter (a leaf that requires grad) or a view of one (linear saves
  // weight.t()) is kept alive by its module: writing it out frees nothing.
  const bool parameter =
      (t.is_leaf() && t.requires_grad()) || (t.is_view() && t._base().is_leaf() && t._base().requires_grad());
  const bool keep = !t.defined() || t.layout() != at::kStrided || parameter || t.numel() == 0 ||
                    region_bytes < options_.min_bytes() || (target == OffloadTarget::kHost && t.device().is_cpu()) ||
                    (target == OffloadTarget::kMemory && options_.codec() == Codec::kNone);
  if (keep) {
    s.st.tensors_kept++;
    e->tensor = t.detach();  // detached: an output holding its grad_fn would make a cycle
    e->where = Where::kKept;
    e->refs = 1;
    h.entry_ = std::move(e);
    return h;
  }
  h.sizes_ = e->meta.sizes;
  h.strides_ = e->meta.strides;
  const void* storage = t.storage().unsafeGetStorageImpl();
  const int dtype = static_cast<int>(t.scalar_type());
  // An entry of the same storage and version whose region holds this one.
  for (auto it = s.shared.lower_bound({storage, e->version, dtype, INT64_MIN, INT64_MIN});
       it != s.shared.end() && std::get<0>(it->first) == storage && std::get<1>(it->first) == e->version &&
       std::get<2>(it->first) == dtype;
       ++it) {
    if (std::get<3>(it->first) > begin) break;
    auto other = it->second.lock();
    if (other && !other->released && other->where != Where::kFailed && std::get<4>(it->first) >= end) {
      other->refs++;
      s.st.tensors_shared++;
      h.offset_ = t.storage_offset() - other->region_begin;
      h.entry_ = std::move(other);
      return h;
    }
  }
  const at::Tensor region = t.detach().as_strided({end - begin}, {1}, begin);  // (n,) in storage order
  e->meta = meta_of(region);
  e->region_begin = begin;
  h.offset_ = t.storage_offset() - begin;
  e->key.emplace(storage, e->version, dtype, begin, end);
  e->storage = t.storage().getWeakStorageImpl();
  e->refs = 1;
  s.st.bytes_raw += e->meta.nbytes;
  if (target == OffloadTarget::kMemory) {
    lock.unlock();
    Encoded enc = encode(region, options_.codec(), /*exact_size=*/true);
    lock.lock();
    e->enc = std::move(enc);
    e->where = Where::kMemory;
    s.st.bytes_stored += e->enc.stored_bytes;
    s.shared[*e->key] = e;
  } else if (target == OffloadTarget::kHost) {
    lock.unlock();
    // Pinned host copy on a side stream, through the generic c10 device
    // interface (this build needs no CUDA headers). The side stream waits
    // for the compute stream; the allocator must not reuse t's memory until
    // the side stream is done with it.
    const c10::Device dev = t.device();
    const auto* impl = c10::impl::getDeviceGuardImpl(dev.type());
    const c10::Stream compute = impl->getStream(dev);
    const c10::Stream side = impl->getStreamFromGlobalPool(dev);
    c10::Event produced(dev.type());
    produced.record(compute);
    produced.block(side);
    const at::Tensor& src = region;
    const auto host_options = src.options().device(at::kCPU).pinned_memory(true);
    at::Tensor host = src.is_non_overlapping_and_dense() ? at::empty_strided(src.sizes(), src.strides(), host_options)
                                                         : at::empty(src.sizes(), host_options);
    {
      c10::StreamGuard on_side(side);
      host.copy_(src, /*non_blocking=*/true);
    }
    impl->recordDataPtrOnStream(src.storage().data_ptr(), side);
    auto done = std::make_shared<c10::Event>(dev.type());
    done->record(side);
    lock.lock();
    e->host = std::move(host);
    e->host_done = std::move(done);
    e->where = Where::kHost;
    s.st.bytes_stored += e->meta.nbytes;
    s.shared[*e->key] = e;
  } else {
    // kDisk: backpressure, then queue for a writer.
    // NOTE [offload pipeline]: prefetched reads are dropped, not waited
    // for; what is left drains by itself (writes, reads in progress).
    const auto t0 = Clock::now();
    bool waited = false;
    s.packs_waiting++;
    while (s.inflight_bytes > 0 && s.inflight_bytes + e->meta.nbytes > options_.max_inflight_bytes() &&
           s.error.empty()) {
      if (s.drop_prefetches()) continue;
      waited = true;
      s.cv.wait(lock);
    }
    s.packs_waiting--;
    if (waited) s.st.write_stall_ms += ms_since(t0);
    if (!s.error.empty()) throw Error(s.error);
    e->tensor = region;
    s.shared[*e->key] = e;
    e->where = Where::kPending;
    e->path = options_.directory() + "/remat-offload-" + std::to_string(::getpid()) + "-" + std::to_string(s.store_id) +
              "-" + std::to_string(e->id) + ".bin";
    s.inflight_bytes += e->meta.nbytes;
    s.st.peak_inflight_bytes = std::max(s.st.peak_inflight_bytes, s.inflight_bytes);
    s.write_queue.push_back(e);
    s.cv.notify_all();
  }
  h.entry_ = std::move(e);
  return h;
}

void OffloadStore::writer_loop() {
  State& s = *s_;
  std::unique_lock<std::mutex> lock(s.mu);
  for (;;) {
    // A paused writer (pause_offload_writers) polls: nothing notifies it
    // when the seam is lifted.
    while (!s.stop && (s.write_queue.empty() || g_writers_paused.load())) {
      if (g_writers_paused.load()) {
        s.cv.wait_for(lock, std::chrono::milliseconds(1));
      } else {
        s.cv.wait(lock);
      }
    }
    if (s.write_queue.empty()) return;  // stop, nothing left
    std::shared_ptr<Entry> e = std::move(s.write_queue.front());
    s.write_queue.pop_front();
    if (e->released || e->where != Where::kPending) continue;  // release() settled its accounting
    if (!s.error.empty()) {                                    // the store failed: no new files
      s.inflight_bytes -= e->meta.nbytes;
      e->tensor = at::Tensor();
      e->where = Where::kFailed;
      e->error = s.error;
      s.cv.notify_all();
      continue;
    }
    e->writing = true;
    s.writes_active++;
    const at::Tensor src = e->tensor;
    const std::string path = e->path;
    lock.unlock();
    const auto busy = Clock::now();
    std::string err;
    Encoded enc;
    bool created = false;
    try {
      at::NoGradGuard no_grad;
      enc = encode(src, options_.codec(), /*exact_size=*/false);
      const int fd = ::open(path.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0600);
      if (fd < 0) {
        const int why = errno;
        throw Error("[remat::offload] creating " + path + " failed: " + std::strerror(why) + ". " +
                    (why == ENOENT   ? "The directory is gone (removed since the store opened?): create it again, or"
                     : why == EACCES ? "The directory is not writable any more: make it writable, or"
                                     : "Free space there, or") +
                    " pass another directory to OffloadOptions().directory().");
      }
      created = true;
      struct Closer {
        int fd;
        ~Closer() { ::close(fd); }
      } closer{fd};
      write_all(fd, static_cast<const char*>(enc.data.data_ptr()), enc.stored_bytes, path);
    } catch (const std::exception& ex) {
      err = ex.what();
    } catch (...) {
      err = "[remat::offload] internal: unknown exception in the writer thread; please report a bug.";
    }
    enc.data = at::Tensor();  // the buffer goes now, not under the lock
    const double busy_ms = ms_since(busy);
    lock.lock();
    s.st.write_ms += busy_ms;
    e->writing = false;
    s.writes_active--;
    s.inflight_bytes -= e->meta.nbytes;
    if (isolated_ && !err.empty()) {
      // Independent entries: this one stays in memory, nothing else changes.
      if (created) ::unlink(path.c_str());
      e->where = Where::kKept;
      e->kept_after_failed_write = true;
      s.isolated_failures++;
      s.last_isolated_error = err;
      s.cv.notify_all();
      continue;
    }
    e->tensor = at::Tensor();
    if (!err.empty() || !s.error.empty()) {
      if (created) ::unlink(path.c_str());
      e->where = Where::kFailed;
      e->error = err.empty() ? s.error : err;
      if (!err.empty()) fail_locked(err);
    } else {
      e->enc = std::move(enc);
      e->where = Where::kDisk;
      e->file_exists = true;
      s.st.bytes_written += e->enc.stored_bytes;
      s.st.bytes_stored += e->enc.stored_bytes;
      s.st.files_created++;
      s.st.files_live++;
      if (e->released) {
        ::unlink(path.c_str());
        e->file_exists = false;
        s.st.files_live--;
      } else {
        s.files[e->id] = e;
        s.add_on_disk(e);
      }
    }
    s.cv.notify_all();
  }
}

namespace {

/** Reads e's file and decodes it. No lock held; e's path and enc are fixed
 *  once it is on disk. */
at::Tensor read_entry(const TensorMeta& m, const Encoded& enc, const std::string& path, int64_t id) {
  at::NoGradGuard no_grad;
  const std::string what = "the file of saved tensor #" + std::to_string(id) + " (shape " + shape_str(m.sizes) + ", " +
                           c10::toString(m.dtype) + ") " + path;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error("[remat::offload] cannot open " + what + ": " + std::strerror(errno) +
                ". It was removed before backward; keep the offload directory private to this process until "
                "backward is done.");
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat sb;
  if (::fstat(fd, &sb) != 0 || sb.st_size != enc.stored_bytes) {
    throw Error("[remat::offload] " + what + " holds " + format_bytes(sb.st_size) + " but " +
                format_bytes(enc.stored_bytes) +
                " were written; it was truncated or replaced. Keep the offload directory private to this process "
                "until backward is done.");
  }
  if (enc.bytes == ByteCodec::kRaw) {
    at::Tensor stage = empty_stage(m, enc);
    read_all(fd, static_cast<char*>(stage.data_ptr()), enc.stored_bytes, path);
    return finish(m, enc, stage);
  }
  at::Tensor buf = at::empty({enc.stored_bytes}, at::kByte);
  read_all(fd, static_cast<char*>(buf.data_ptr()), enc.stored_bytes, path);
  return finish(m, enc, decompress(m, enc, buf.data_ptr(), enc.stored_bytes, what));
}

}  // namespace

void OffloadStore::reader_loop() {
  State& s = *s_;
  std::unique_lock<std::mutex> lock(s.mu);
  for (;;) {
    s.cv.wait(lock, [&] { return s.stop || !s.read_queue.empty(); });
    if (s.stop) return;
    std::shared_ptr<Entry> e = std::move(s.read_queue.front());
    s.read_queue.pop_front();
    if (e->read != Read::kQueued) continue;  // taken by unpack, or released
    e->read = Read::kReading;
    const TensorMeta meta = e->meta;
    const Encoded enc = e->enc;
    const std::string path = e->path;
    lock.unlock();
    const auto busy = Clock::now();
    std::string err;
    at::Tensor v;
    try {
      v = read_entry(meta, enc, path, e->id);
    } catch (const std::exception& ex) {
      err = ex.what();
    }
    const double busy_ms = ms_since(busy);
    lock.lock();
    s.st.read_ms += busy_ms;
    if (e->released) {
      // Released while being read (its node's graph went first): release()
      // may have removed the file before the read opened it. Nothing will
      // unpack it, so neither its value nor a failure to read it matters.
      s.end_prefetch(*e);
    } else if (!err.empty() && isolated_) {
      s.end_prefetch(*e);  // unpack reads the file itself and reports
    } else if (!err.empty()) {
      e->error = err;
      s.end_prefetch(*e);
      fail_locked(err);
    } else {
      e->ready = std::move(v);
      e->read = Read::kReady;
      s.st.bytes_read += e->enc.stored_bytes;
    }
    s.cv.notify_all();
  }
}

at::Tensor OffloadStore::unpack(Handle& h) {
  const std::shared_ptr<Entry>& e = h.entry_;
  if (!e) throw Error("[remat::offload] internal: unpack of an empty handle; please report a bug.");
  State& s = *s_;
  std::unique_lock<std::mutex> lock(s.mu);
  if (e->track_version && e->version_counter.current_version() != e->version) {
    const std::string err = "[remat::offload] a tensor saved for backward (#" + std::to_string(e->id) + ", shape " +
                            shape_str(e->where == Where::kKept ? e->meta.sizes : h.sizes_) +
                            ") was modified in place after it was saved (version " + std::to_string(e->version) +
                            " then, " + std::to_string(e->version_counter.current_version()) +
                            " now): its gradient would be wrong. Clone it before the in-place op.";
    fail_locked(err);
    throw Error(err);
  }
  // A failed store removed its files (this backward cannot complete).
  if (!s.error.empty() && e->where != Where::kKept && e->where != Where::kMemory && e->where != Where::kHost) {
    throw Error(s.error);
  }
  at::Tensor v;
  bool hit = true;
  auto take_prefetch = [&] {
    v = e->ready;
    s.end_prefetch(*e);
  };
  auto schedule = [&] {
    // NOTE [offload pipeline]: the highest ids still on disk that the same
    // thread saved come next; none while a pack waits for room.
    const int64_t depth = options_.prefetch_depth();
    auto mine = s.on_disk.find(e->saver);
    while (s.prefetches < depth && s.packs_waiting == 0 && mine != s.on_disk.end() && !mine->second.empty()) {
      auto last = std::prev(mine->second.end());
      std::shared_ptr<Entry> p = last->second.lock();
      if (p && (s.inflight_bytes > 0 && s.inflight_bytes + p->meta.nbytes > options_.max_inflight_bytes())) break;
      mine->second.erase(last);
      if (!p || p->released || p->where != Where::kDisk || p->read != Read::kNone || p->ready.defined()) continue;
      s.add_prefetch(std::move(p));
    }
    if (mine != s.on_disk.end() && mine->second.empty()) s.on_disk.erase(mine);
    s.cv.notify_all();
  };
  switch (e->where) {
    case Where::kKept: v = e->tensor; break;
    case Where::kMemory:
      if (e->ready.defined()) {
        v = e->ready;
      } else {
        const Encoded enc = e->enc;
        lock.unlock();
        {
          dispatch::Suspend suspend;
          at::NoGradGuard no_grad;
          v = finish(e->meta, enc,
                     decompress(e->meta, enc, enc.data.data_ptr(), enc.stored_bytes,
                                "the buffer of saved tensor #" + std::to_string(e->id)));
        }
        lock.lock();
      }
      break;
    case Where::kHost:
      lock.unlock();
      e->host_done->synchronize();
      v = e->host.to(e->meta.device, /*non_blocking=*/true);
      lock.lock();
      break;
    case Where::kFailed: throw Error(e->error);
    case Where::kPending:
      if (e->tensor.defined()) {  // not written yet: the write goes on, for a second backward
        if (!lossy(options_.codec())) {
          v = e->tensor;
          break;
        }
        // Lossy: the values the file will hold (encode is deterministic),
        // so that the result does not depend on the writer's timing.
        const at::Tensor src = e->tensor;
        lock.unlock();
        {
          dispatch::Suspend suspend;
          at::NoGradGuard no_grad;
          const Encoded enc = encode(src, options_.codec(), /*exact_size=*/false);
          v = finish(e->meta, enc, enc.data);
        }
        lock.lock();
        break;
      }
      [[fallthrough]];
    case Where::kDisk: {
      const auto t0 = Clock::now();
      while (e->read == Read::kReading || e->where == Where::kPending) {
        hit = false;
        s.cv.wait(lock);
      }
      if (e->where == Where::kFailed) throw Error(e->error);
      if (!e->error.empty()) {
        const std::string err = e->error;
        throw Error(err);
      }
      if (e->read == Read::kReady) {
        take_prefetch();
      } else if (e->ready.defined()) {
        v = e->ready;  // cached for a sharing handle
      } else {
        hit = false;
        if (e->read == Read::kQueued) s.end_prefetch(*e);  // queued but not started: read it here
        s.forget_on_disk(*e);
        schedule();  // the reader works on the next ones meanwhile
        const Encoded enc = e->enc;
        lock.unlock();
        const auto busy = Clock::now();
        try {
          v = read_entry(e->meta, enc, e->path, e->id);
        } catch (const std::exception& ex) {
          lock.lock();
          // A failure elsewhere may have removed the file meanwhile: report the first.
          if (!s.error.empty()) throw Error(s.error);
          if (isolated_) throw;  // the file stays: another unpack may read it
          e->error = ex.what();
          fail_locked(e->error);
          throw;
        }
        const double busy_ms = ms_since(busy);
        lock.lock();
        s.st.read_ms += busy_ms;
        s.st.bytes_read += enc.stored_bytes;
      }
      if (!hit) s.st.read_stall_ms += ms_since(t0);
      break;
    }
  }
  if (e->where == Where::kPending || e->where == Where::kDisk) {
    if (hit) {
      s.st.prefetch_hits++;
    } else {
      s.st.prefetch_misses++;
    }
    schedule();
  }
  if (!h.unpacked_) {
    h.unpacked_ = true;
    e->unpacked_refs++;
  }
  // Shared with a handle that has not unpacked yet: keep the value for it.
  const bool keep_graph = torch::autograd::get_current_graph_task_keep_graph();
  if (e->where != Where::kKept && e->unpacked_refs < e->refs && !keep_graph) {
    e->ready = v;
  } else if (e->read != Read::kReady) {
    e->ready = at::Tensor();
  }
  if (e->where == Where::kKept && !e->kept_after_failed_write) return v;
  // The saved tensor within its region; as_strided's offset is the
  // storage's, and a region still in memory (pending, kept after a failed
  // write) starts where the tensor's storage had it, not at 0.
  return v.as_strided(h.sizes_, h.strides_, v.storage_offset() + h.offset_);
}

void OffloadStore::release(const std::shared_ptr<Entry>& e) noexcept {
  State& s = *s_;
  std::lock_guard<std::mutex> lock(s.mu);
  if (--e->refs > 0) return;
  e->released = true;
  if (e->key) {
    auto it = s.shared.find(*e->key);
    if (it != s.shared.end() && it->second.lock() == e) s.shared.erase(it);
  }
  s.forget_on_disk(*e);
  if (e->read == Read::kQueued || e->read == Read::kReady) s.end_prefetch(*e);  // kReading: the reader settles it
  e->ready = at::Tensor();
  if (e->where == Where::kPending && !e->writing) s.inflight_bytes -= e->meta.nbytes;  // the writer skips it
  if (e->file_exists) {
    ::unlink(e->path.c_str());
    e->file_exists = false;
    s.st.files_live--;
    s.files.erase(e->id);
  }
  e->tensor = at::Tensor();  // a writer at work holds its own reference
  e->enc.data = at::Tensor();
  e->host = at::Tensor();
  s.cv.notify_all();
}

void OffloadStore::fail_locked(const std::string& err) {
  State& s = *s_;
  if (s.error.empty()) s.error = err;
  for (auto& [id, e] : s.files) {
    if (e->file_exists) {
      ::unlink(e->path.c_str());
      e->file_exists = false;
      s.st.files_live--;
    }
  }
  s.files.clear();
  s.on_disk.clear();
  s.cv.notify_all();
}

void OffloadStore::check() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  if (!s_->error.empty()) throw Error(s_->error);
}

void OffloadStore::wait() {
  {
    std::unique_lock<std::mutex> lock(s_->mu);
    s_->cv.wait(lock, [&] {
      if (!s_->error.empty()) return true;
      if (s_->writes_active > 0) return false;
      for (const auto& e : s_->write_queue) {
        if (!e->released && e->where == Where::kPending) return false;
      }
      return true;
    });
  }
  check();
}

OffloadStats OffloadStore::stats() const {
  std::lock_guard<std::mutex> lock(s_->mu);
  return s_->st;
}

std::string OffloadStore::describe() const {
  const OffloadStats st = stats();
  std::ostringstream os;
  os << "remat::OffloadScope: target " << to_string(options_.target());
  switch (options_.target()) {
    case OffloadTarget::kDisk:
      os << " (directory " << options_.directory() << ", " << options_.writer_threads() << " writer thread"
         << (options_.writer_threads() == 1 ? "" : "s") << ", prefetch depth " << options_.prefetch_depth()
         << (options_.prefetch_depth() == 0 ? " (off)" : "") << ", at most "
         << format_bytes(options_.max_inflight_bytes()) << " in flight)";
      break;
    case OffloadTarget::kHost:
      os << " (pinned host copies of accelerator tensors on a side stream; CPU tensors stay where they are: a "
            "no-op for them)";
      break;
    case OffloadTarget::kMemory:
      os << (options_.codec() == Codec::kNone ? " (codec kNone: a no-op, tensors are kept as they are)"
                                              : " (encoded in this process's memory)");
      break;
  }
  os << ", codec " << to_string(options_.codec()) << (lossy(options_.codec()) ? " (lossy, float32 only)" : "")
     << ", tensors under " << format_bytes(options_.min_bytes()) << " and parameters stay in memory.\n";
  os << "  saved " << st.tensors_saved << " (kept " << st.tensors_kept << ", shared " << st.tensors_shared << "), "
     << format_bytes(st.bytes_raw) << " offloaded as " << format_bytes(st.bytes_stored);
  char ratio[32];
  std::snprintf(ratio, sizeof ratio, "%.2fx", st.compression_ratio());
  os << " (" << ratio << ")";
  if (options_.target() == OffloadTarget::kDisk) {
    char stall[96];
    std::snprintf(stall, sizeof stall, "stalls %.1f ms writing, %.1f ms reading", st.write_stall_ms, st.read_stall_ms);
    os << "; written " << format_bytes(st.bytes_written) << ", read " << format_bytes(st.bytes_read) << ", files "
       << st.files_live << " live of " << st.files_created << "; prefetch " << st.prefetch_hits << " hits, "
       << st.prefetch_misses << " misses (" << st.prefetches_issued << " issued, " << st.prefetches_dropped
       << " dropped); " << stall << "; peak in flight " << format_bytes(st.peak_inflight_bytes);
  }
  return os.str();
}

namespace {

class OffloadHook final : public SavedHook {
 public:
  explicit OffloadHook(std::shared_ptr<OffloadStore> store) : store_(std::move(store)) {}
  void call_pack_hook(const at::Tensor& t) override { handle_ = store_->pack(t); }
  at::Tensor call_unpack_hook() override { return store_->unpack(handle_); }

 private:
  std::shared_ptr<OffloadStore> store_;
  OffloadStore::Handle handle_;  // released with the hook: when autograd frees the saved tensor
};

class OffloadFactory final : public HookFactory {
 public:
  explicit OffloadFactory(std::shared_ptr<OffloadStore> store) : store_(std::move(store)) {}
  std::unique_ptr<SavedHook> make_hook() override { return std::make_unique<OffloadHook>(store_); }

 private:
  std::shared_ptr<OffloadStore> store_;
};

}  // namespace

namespace {
std::mutex g_shared_mu;
std::map<std::string, std::shared_ptr<OffloadStore>>& shared_stores() {
  static auto* stores = new std::map<std::string, std::shared_ptr<OffloadStore>>();  // never destroyed
  return *stores;
}
}  // namespace

std::shared_ptr<OffloadStore> OffloadStore::shared(const OffloadOptions& o) {
  const std::string key = to_string(o.target()) + "|" + o.directory() + "|" + std::to_string(o.min_bytes()) + "|" +
                          std::to_string(o.prefetch_depth()) + "|" + std::to_string(o.max_inflight_bytes()) + "|" +
                          to_string(o.codec()) + "|" + std::to_string(o.writer_threads());
  std::lock_guard<std::mutex> lock(g_shared_mu);
  auto& stores = shared_stores();
  if (auto it = stores.find(key); it != stores.end()) return it->second;
  // Created before it is recorded: when create() throws (a missing
  // directory), no entry is left behind and the next call tries again.
  auto s = create(o);
  stores.emplace(key, s);
  return s;
}

void OffloadStore::wait_shared() {
  std::vector<std::shared_ptr<OffloadStore>> all;
  {
    std::lock_guard<std::mutex> lock(g_shared_mu);
    for (auto& [key, s] : shared_stores()) all.push_back(s);
  }
  for (auto& s : all) s->wait();
}

std::shared_ptr<HookFactory> make_offload_hooks(std::shared_ptr<OffloadStore> store) {
  return std::make_shared<OffloadFactory>(std::move(store));
}

void inject_offload_write_failure(int64_t nth) {
  g_writes_seen = 0;
  g_write_fail_at = nth;
}

void inject_offload_read_failure(int64_t nth) {
  g_reads_seen = 0;
  g_read_fail_at = nth;
}

void pause_offload_writers(bool paused) { g_writers_paused = paused; }

}  // namespace detail

OffloadScope::OffloadScope(const OffloadOptions& options) : store_(detail::OffloadStore::create(options)) {
  hooks_ = std::make_unique<ScopedHooks>(detail::make_offload_hooks(store_));
}

OffloadScope::~OffloadScope() noexcept(false) {
  hooks_.reset();
  if (std::uncaught_exceptions() == 0) store_->check();
}

void OffloadScope::wait() { store_->wait(); }
OffloadStats OffloadScope::stats() const { return store_->stats(); }
std::string OffloadScope::describe() const { return store_->describe(); }

}  // namespace remat
