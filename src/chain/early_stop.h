// Internal: early stop for CheckpointedSequential's recomputes.
//
// NOTE [early stop in planned recomputes]: a stage recomputed in backward
// (forward_save right before its backward, its output read by nothing but
// the backward's roots) needs its ops only up to the last one whose result
// backward reads; the ops after it (a GPT block's last matmul and residual
// add) are needed only for the graph they leave. remat::checkpoint stops
// its re-run there (it keeps the first forward's graph); the planned
// runtime builds a new graph each time, so it runs those ops through
// autograd as usual but, below autograd (dispatch's Fake-key interceptor),
// returns outputs of the recorded shape without running their kernels.
// The graph, its saved tensors and every gradient are those of a full run.
//
// The first such recompute of a stage runs in full and records, per op
// (in dispatch order): its name, the metadata of each tensor it returns,
// and the last op that wrote a storage autograd saved (through remat's
// hooks) or returned something other than tensors (control flow may read
// it). A stage whose graph has a node other than ATen's generated ones
// (a custom Function may keep tensors in saved_data, unseen by the hooks),
// or that runs other saved-tensor hooks or interceptors, is never cut.
// Later recomputes run ops up to that point, then produce the rest; an op
// sequence that differs from the record (control flow on other state)
// stops the cut: before the cut point the rest simply runs, after it the
// stage is run again in full (throws Diverged) and never cut again.
//
// Kept state: ops after the cut point return uninitialized tensors; they
// must never leave the graph. A stage may keep a tensor it computed (a
// feature tap `last = y.detach()`, a memory carried to the next step): with
// its ops produced, the module would hold garbage. What is reliable is the
// storages' lifetimes: the recording run keeps weak references to the
// storages it made whose last write came after the cut point (autograd saved
// none of them, by the cut point's definition); once the stage's backward
// has run and the runtime has let go of the stage's outputs, a storage
// still alive is held by someone else (the module, a cache): the stage
// keeps state and is never cut (the record is dropped; the recording run
// ran in full, so what it kept is right). Storages that existed before the
// run (a module's buffers written in place) are not counted: a re-run's
// writes to them are undone anyway (NOTE [recompute side effects]). A
// stage that keeps state only on some calls can escape the recording run's
// check; each cut run is therefore checked the same way (its produced
// storages), and if one is alive, the stage is never cut again and is run
// once more in full without grad, so that what it keeps holds the values
// of a full run.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/intrusive_ptr.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace remat::dispatch {
class Interceptor;
}  // namespace remat::dispatch

namespace remat::detail {

using WeakStorage = c10::weak_intrusive_ptr<c10::StorageImpl>;

/** True when one of the storages is still alive (see "Kept state" above). */
bool any_alive(const std::vector<WeakStorage>& storages);

/** What a stage's first recompute recorded. */
struct StopRecord {
  struct Out {
    std::vector<int64_t> sizes, strides;
    at::TensorOptions options;
    bool defined = false;
  };
  struct Ret {
    enum Kind { kTensor, kList, kAlias } kind = kTensor;
    std::vector<Out> outs;  // one for kTensor, each element's for kList
    int alias_arg = -1;     // kAlias: the argument it returns (in-place, out=)
  };
  struct OpRec {
    c10::OperatorName name{"", ""};
    bool fakeable = false;  // functional or writing ops whose returns are all tensors
    std::vector<Ret> rets;
  };
  std::vector<OpRec> ops;
  int64_t stop = -1;  // ops [0, stop] run; the rest are produced (when usable)
  bool usable = false;
};

/** Per plan entry: each stage's record, shared by the threads running it. */
class StopRecords {
 public:
  explicit StopRecords(int stages) : recs_(static_cast<size_t>(stages)), disabled_(static_cast<size_t>(stages)) {}
  /** The record of stage i, or nullptr when none yet. */
  std::shared_ptr<const StopRecord> get(int i) const;
  /** Stage i may be recorded (not disabled, not recorded yet). */
  bool wants_record(int i) const;
  void set(int i, std::shared_ptr<const StopRecord> r);
  /** Never cut stage i again (its ops diverged from the record). */
  void disable(int i);

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<const StopRecord>> recs_;
  std::vector<char> disabled_;
};

/** Thrown out of a cut recompute whose ops diverged after the cut point. */
struct Diverged final : std::exception {
  const char* what() const noexcept override {
    return "[remat::CheckpointedSequential] internal: a recompute's ops diverged from its record (caught by remat; a "
           "stage that catches std::exception around its ops should rethrow it).";
  }
};

/** While it lives, records the ops of this thread (a stage's full recompute). */
class StopRecorder {
 public:
  StopRecorder();
  ~StopRecorder();
  StopRecorder(const StopRecorder&) = delete;
  StopRecorder& operator=(const StopRecorder&) = delete;
  /** After the run: the record, or one with usable = false. outs are the
   *  stage's outputs (their graph is checked). */
  std::shared_ptr<const StopRecord> finish(const std::vector<at::Tensor>& outs, uint64_t seq0);
  /** After finish() of a usable record: the storages the run made whose
   *  last write came after the cut point. Alive once the stage's outputs
   *  and graph are gone: the stage keeps state, do not use the record. */
  std::vector<WeakStorage> after_cut() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/** While it lives, replays a record on this thread: ops after the cut point
 *  are produced, not run. diverged() tells whether the sequence differed
 *  before the cut (the rest then ran in full). */
class StopReplay {
 public:
  explicit StopReplay(std::shared_ptr<const StopRecord> rec);
  ~StopReplay();
  StopReplay(const StopReplay&) = delete;
  StopReplay& operator=(const StopReplay&) = delete;
  bool diverged() const;
  /** Ops produced without running their kernels. */
  int64_t skipped() const;
  /** The storages of the tensors produced (and of those this run made that
   *  a produced in-place op should have written). */
  std::vector<WeakStorage> produced() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/** Early stop can run on this thread now: no saved-tensor hooks are
 *  active and no op interceptor other than `own` (they would see a
 *  different op stream), and the dispatcher's interception key is free.
 *  own: the runtime's own write guard, pushed onto an empty interceptor
 *  stack (NOTE [recompute side effects]); nullptr: none. */
bool early_stop_available(const dispatch::Interceptor* own = nullptr);

}  // namespace remat::detail
