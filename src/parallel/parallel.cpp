// remat::parallel: process groups on c10d and gradient synchronisation
// through c10d::Reducer, as Python's DistributedDataParallel sets them up
// (torch/nn/parallel/distributed.py: one bucket in the first step, rebuilt
// in the order gradients became ready, rank 0's state broadcast at start).
#include <remat/parallel/data_parallel.h>

#include <signal.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <torch/nn/module.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <remat/error.h>
#include <remat/optim.h>

#include "backends.h"
#include "common.h"

namespace remat::parallel {

namespace {

using util::Clock;
using util::message_of;

std::string seconds(std::chrono::milliseconds t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(t.count()) / 1e3);
  return buf;
}

void validate(const InitOptions& o) {
  if (o.world_size() < 1) {
    throw Error("[remat::parallel] world_size " + std::to_string(o.world_size()) +
                " must be at least 1 (the number of processes).");
  }
  if (o.rank() < 0 || o.rank() >= o.world_size()) {
    throw Error("[remat::parallel] rank " + std::to_string(o.rank()) + " is outside [0, " +
                std::to_string(o.world_size()) + "): give each of the world_size processes its own rank.");
  }
  if (o.file_store().empty()) {
    if (o.master_port() < 1 || o.master_port() > 65535) {
      throw Error("[remat::parallel] master_port " + std::to_string(o.master_port()) +
                  " is not a TCP port; pick one in 1..65535 that is free on the master (e.g. 29500).");
    }
    if (o.master_addr().empty()) {
      throw Error("[remat::parallel] master_addr is empty; give the host rank 0 runs on (127.0.0.1 on one machine).");
    }
  }
  if (o.timeout().count() <= 0) {
    throw Error("[remat::parallel] timeout " + std::to_string(o.timeout().count()) +
                " ms must be positive (the default is 300 s).");
  }
  if (o.device() != c10::kCPU && o.device() != c10::kCUDA) {
    throw Error(std::string("[remat::parallel] device ") + c10::DeviceTypeName(o.device()) +
                " has no backend here; use kCPU (Gloo) or kCUDA (NCCL).");
  }
}

c10::intrusive_ptr<c10d::Store> make_store(const InitOptions& o) {
  if (!o.file_store().empty()) {
    try {
      auto store = c10::make_intrusive<c10d::FileStore>(o.file_store(), o.world_size());
      store->setTimeout(o.timeout());
      return store;
    } catch (const std::exception& e) {
      throw Error("[remat::parallel] rank " + std::to_string(o.rank()) + " could not open the FileStore '" +
                  o.file_store() + "': " + message_of(e) +
                  ". Give a path in a writable folder that every rank sees, unused by another group.");
    }
  }
  c10d::TCPStoreOptions t;
  t.port = static_cast<std::uint16_t>(o.master_port());
  t.isServer = o.rank() == 0;
  t.numWorkers = static_cast<std::size_t>(o.world_size());
  t.waitWorkers = true;
  t.timeout = o.timeout();
  const std::string where = o.master_addr() + ":" + std::to_string(o.master_port());
  try {
    return c10::make_intrusive<c10d::TCPStore>(o.master_addr(), t);
  } catch (const std::exception& e) {
    if (o.rank() == 0) {
      throw Error("[remat::parallel] rank 0 could not serve the TCPStore on " + where + " (or not every one of the " +
                  std::to_string(o.world_size()) + " ranks joined within " + seconds(o.timeout()) +
                  "): " + message_of(e) +
                  ". Pick a free master_port (--master-port), and start every rank with the same world size.");
    }
    throw Error("[remat::parallel] rank " + std::to_string(o.rank()) + " could not reach the TCPStore at " + where +
                " within " + seconds(o.timeout()) + ": " + message_of(e) +
                ". Check that rank 0 runs and that master_addr and master_port (--master-addr, --master-port) are "
                "the same on every rank.");
  }
}

}  // namespace

namespace detail {

bool is_loopback(const std::string& addr) { return addr == "localhost" || addr == "::1" || addr.rfind("127.", 0) == 0; }

#ifndef REMAT_WITH_NCCL
c10::intrusive_ptr<c10d::Backend> make_nccl(const c10::intrusive_ptr<c10d::Store>&, int, int,
                                            std::chrono::milliseconds) {
  throw Error(
      "[remat::parallel] this remat was built without NCCL (a CPU LibTorch, or REMAT_CUDA=OFF); build with a CUDA "
      "LibTorch and REMAT_CUDA=ON, or use device kCPU (Gloo).");
}
#endif

}  // namespace detail

int ProcessGroup::rank() const { return pg_ ? pg_->getRank() : 0; }
int ProcessGroup::world_size() const { return pg_ ? pg_->getSize() : 1; }

void ProcessGroup::barrier() const {
  if (!pg_) throw Error("[remat::parallel] barrier on a ProcessGroup that was not joined; use init_process_group().");
  c10d::BarrierOptions b;
  b.timeout = timeout_;
  b.device = c10::Device(device_ == c10::kCUDA ? c10::kCUDA : c10::kCPU);
  pg_->barrier(b)->wait();
}

void ProcessGroup::all_reduce_sum(at::Tensor& t) const {
  if (!pg_) throw Error("[remat::parallel] all_reduce_sum on a ProcessGroup that was not joined.");
  std::vector<at::Tensor> ts{t};
  pg_->allreduce(ts)->wait();
}

ProcessGroup init_process_group(const InitOptions& options) {
  validate(options);
  // NOTE [SIGPIPE]: a write to a peer that died raises SIGPIPE, whose
  // default action ends this process at once (exit status 141) instead of
  // letting c10d report the dead rank as an error. Python ignores SIGPIPE
  // from startup, so its c10d never meets it; a C++ process gets the same
  // here. A handler the program installed itself is left alone.
  struct sigaction old {};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
  auto store = make_store(options);
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("remat/0", store);
  ProcessGroup g;
  g.device_ = options.device();
  g.timeout_ = options.timeout();
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(prefixed, options.rank(), options.world_size());
  c10::intrusive_ptr<c10d::Backend> gloo;
  try {
    gloo = detail::make_gloo(prefixed, options.rank(), options.world_size(), options.timeout(),
                             options.file_store().empty() ? options.master_addr() : std::string());
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error("[remat::parallel] rank " + std::to_string(options.rank()) + " could not connect the Gloo group of " +
                std::to_string(options.world_size()) + " within " + seconds(options.timeout()) + ": " + message_of(e) +
                ". Start every rank, or set GLOO_SOCKET_IFNAME to an interface the ranks share.");
  }
  pg->setBackend(c10::kCPU, c10d::ProcessGroup::GLOO, gloo);
  pg->setDefaultBackend(c10d::ProcessGroup::GLOO);
  if (options.device() == c10::kCUDA) {
    auto nccl = detail::make_nccl(prefixed, options.rank(), options.world_size(), options.timeout());
    pg->setBackend(c10::kCUDA, c10d::ProcessGroup::NCCL, nccl);
    pg->setDefaultBackend(c10d::ProcessGroup::NCCL);
  }
  pg->setGroupName("0");
  g.pg_ = std::move(pg);
  g.store_ = store;
  g.master_addr_ = options.file_store().empty() ? options.master_addr() : std::string();
  g.name_ = "remat/0";
  g.groups_made_ = std::make_shared<int>(0);
  return g;
}

ProcessGroup ProcessGroup::new_group(const std::vector<int>& ranks) const {
  if (!pg_) throw Error("[remat::parallel] new_group on a ProcessGroup that was not joined; use init_process_group().");
  const int me = rank(), n = world_size();
  int mine = -1;
  std::string list;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= n) {
      throw Error("[remat::parallel] new_group: rank " + std::to_string(ranks[i]) + " is outside [0, " +
                  std::to_string(n) + ").");
    }
    for (size_t j = 0; j < i; ++j) {
      if (ranks[j] == ranks[i]) {
        throw Error("[remat::parallel] new_group: rank " + std::to_string(ranks[i]) + " is listed twice.");
      }
    }
    if (ranks[i] == me) mine = static_cast<int>(i);
    list += (i ? "," : "") + std::to_string(ranks[i]);
  }
  if (mine < 0) {
    throw Error("[remat::parallel] new_group: rank " + std::to_string(me) + " is not in [" + list +
                "]; only the ranks listed call new_group.");
  }
  // The key prefix every member computes alike: the parent's, the call's
  // index (members call in the same order) and the list.
  const std::string name = name_ + "/" + std::to_string((*groups_made_)++) + "[" + list + "]";
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(name, store_);
  const int size = static_cast<int>(ranks.size());
  auto pg = c10::make_intrusive<c10d::ProcessGroup>(prefixed, mine, size);
  c10::intrusive_ptr<c10d::Backend> gloo;
  try {
    gloo = detail::make_gloo(prefixed, mine, size, timeout_, master_addr_);
  } catch (const std::exception& e) {
    throw Error("[remat::parallel] rank " + std::to_string(me) + " could not connect the group of ranks [" + list +
                "] within " + seconds(timeout_) + ": " + message_of(e) +
                ". Every rank listed must call new_group with the same list.");
  }
  pg->setBackend(c10::kCPU, c10d::ProcessGroup::GLOO, gloo);
  pg->setDefaultBackend(c10d::ProcessGroup::GLOO);
  if (device_ == c10::kCUDA) {
    pg->setBackend(c10::kCUDA, c10d::ProcessGroup::NCCL, detail::make_nccl(prefixed, mine, size, timeout_));
    pg->setDefaultBackend(c10d::ProcessGroup::NCCL);
  }
  pg->setGroupName(name);
  ProcessGroup g;
  g.pg_ = std::move(pg);
  g.device_ = device_;
  g.timeout_ = timeout_;
  g.store_ = store_;
  g.master_addr_ = master_addr_;
  g.name_ = name;
  g.groups_made_ = std::make_shared<int>(0);
  return g;
}

void average_gradients(const ProcessGroup& group, const std::vector<at::Tensor>& parameters) {
  if (!group.defined()) {
    throw Error("[remat::parallel] average_gradients on a ProcessGroup that was not joined; use init_process_group().");
  }
  for (size_t i = 0; i < parameters.size(); ++i) {
    if (StepInBackward::steps_in_backward(parameters[i]) && !remat::detail::is_deferred(parameters[i])) {
      throw Error("[remat::parallel] average_gradients: parameter #" + std::to_string(i) +
                  " is updated inside backward (remat::StepInBackward), before this average: each replica would "
                  "step on its own gradient. Destroy the StepInBackward, or keep its gradients until the average "
                  "(StepInBackward::accumulate() around the backward, then the optimizer's step()).");
    }
  }
  if (group.world_size() == 1 || parameters.empty()) return;
  at::NoGradGuard no_grad;
  // One flat buffer per dtype, in the parameters' order.
  std::vector<c10::ScalarType> dtypes;
  for (const auto& p : parameters) {
    if (std::find(dtypes.begin(), dtypes.end(), p.scalar_type()) == dtypes.end()) dtypes.push_back(p.scalar_type());
  }
  for (auto dt : dtypes) {
    std::vector<at::Tensor> flat;
    for (const auto& p : parameters) {
      if (p.scalar_type() != dt) continue;
      flat.push_back(p.grad().defined() ? p.grad().reshape(-1) : at::zeros({p.numel()}, p.options()));
    }
    auto buf = at::cat(flat);
    std::vector<at::Tensor> ts{buf};
    try {
      group.c10d()->allreduce(ts)->wait(group.timeout());
    } catch (const std::exception& e) {
      throw Error("[remat::parallel] rank " + std::to_string(group.rank()) + " of " +
                  std::to_string(group.world_size()) + ": the all-reduce of the gradients failed: " + message_of(e) +
                  ". A peer process probably exited or stopped answering (timeout " + seconds(group.timeout()) + ").");
    }
    buf.div_(group.world_size());
    int64_t off = 0;
    for (const auto& p : parameters) {
      if (p.scalar_type() != dt) continue;
      auto avg = buf.slice(0, off, off + p.numel()).view(p.sizes());
      off += p.numel();
      if (p.grad().defined()) {
        p.mutable_grad().copy_(avg);
      } else {
        p.mutable_grad() = avg.clone();
      }
    }
  }
}

// --- DataParallel ----------------------------------------------------------

namespace {

/** The state the comm hook records into (the hook is owned by the Reducer;
 *  its future callbacks run on the backend's threads). */
struct Recorder {
  std::mutex mu;
  struct Launch {
    Clock::time_point start, done;
    bool finished = false;
    int64_t bytes = 0;
  };
  std::vector<Launch> current;  // this backward's buckets
  CommStats last;               // the last complete backward

  void begin() {
    std::lock_guard<std::mutex> lock(mu);
    current.clear();
  }
  size_t launch(int64_t bytes) {
    std::lock_guard<std::mutex> lock(mu);
    current.push_back({Clock::now(), {}, false, bytes});
    return current.size() - 1;
  }
  void done(size_t k) {
    std::lock_guard<std::mutex> lock(mu);
    if (k >= current.size()) return;
    current[k].done = Clock::now();
    current[k].finished = true;
  }
  /** Folds this backward's buckets into `last` (after the Reducer waited on every one). */
  void finish() {
    std::lock_guard<std::mutex> lock(mu);
    if (current.empty()) return;
    CommStats s;
    Clock::time_point last_launch = current.front().start, last_done = current.front().start;
    for (const auto& l : current) {
      last_launch = std::max(last_launch, l.start);
      if (l.finished) last_done = std::max(last_done, l.done);
    }
    double overlapped = 0.0;
    for (const auto& l : current) {
      ++s.buckets;
      s.bytes += l.bytes;
      if (!l.finished) continue;
      s.allreduce_ms += std::chrono::duration<double, std::milli>(l.done - l.start).count();
      overlapped +=
          std::max(0.0, std::chrono::duration<double, std::milli>(std::min(l.done, last_launch) - l.start).count());
    }
    s.exposed_ms = std::max(0.0, std::chrono::duration<double, std::milli>(last_done - last_launch).count());
    s.overlap = s.allreduce_ms > 0.0 ? overlapped / s.allreduce_ms : 0.0;
    last = s;
    current.clear();
  }
};

/** c10d's default averaging all-reduce (AllReduceCommHook: divide, sum),
 *  timed, with a failed all-reduce turned into an error that says which
 *  rank and bucket, and what to look at. */
class TimedAllReduce final : public c10d::CommHookInterface {
 public:
  TimedAllReduce(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<Recorder> rec, std::chrono::milliseconds t)
      : pg_(std::move(pg)), rec_(std::move(rec)), timeout_(t) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor& buf = bucket.getBufferRef();
    buf.div_(pg_->getSize());
    const size_t k = rec_->launch(static_cast<int64_t>(buf.numel()) * static_cast<int64_t>(buf.element_size()));
    std::vector<at::Tensor> ts{buf};
    c10d::AllreduceOptions o;
    o.timeout = timeout_;
    auto fut = pg_->allreduce(ts, o)->getFuture();
    const int rank = pg_->getRank(), size = pg_->getSize();
    const size_t index = bucket.getIndex();
    std::shared_ptr<Recorder> rec = rec_;
    const auto timeout = timeout_;
    return fut->then(
        [rec, k, rank, size, index, timeout](c10::ivalue::Future& f) -> c10::IValue {
          rec->done(k);
          if (f.hasError()) {
            throw Error("[remat::parallel] rank " + std::to_string(rank) + " of " + std::to_string(size) +
                        ": the all-reduce of gradient bucket " + std::to_string(index) +
                        " failed: " + util::first_line(f.tryRetrieveErrorMessage()) +
                        ". A peer process probably exited or stopped answering (timeout " + seconds(timeout) +
                        "); look at the other ranks' output.");
          }
          return f.value();
        },
        fut->elementType());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<Recorder> rec_;
  std::chrono::milliseconds timeout_;
};

/** Buffer size of broadcast_coalesced, bytes (DDP's 250 MiB). */
constexpr size_t kBroadcastBucketBytes = size_t{250} << 20;

}  // namespace

struct DataParallel::Impl {
  std::shared_ptr<torch::nn::Module> module;
  ProcessGroup group;
  DataParallelOptions options;
  std::vector<at::Tensor> params;  // those that require grad: the Reducer's
  std::vector<at::Tensor> buffers;
  std::shared_ptr<c10d::Reducer> reducer;
  // Declared after the reducer, so destroyed first (its destructor reads the
  // reducer), as DDP deletes its logger before its reducer.
  std::shared_ptr<c10d::Logger> logger;
  std::shared_ptr<Recorder> rec = std::make_shared<Recorder>();
  /** The Reducer averages the gradients at the end of backward: a
   *  StepInBackward leaves these parameters to the optimizer's step(). */
  std::unique_ptr<remat::detail::DeferredGradients> deferred;
  bool armed = false;  // prepare_for_backward called, its backward's stats not yet folded

  void broadcast(std::vector<at::Tensor>& ts) const {
    if (ts.empty() || group.world_size() == 1) return;
    at::NoGradGuard no_grad;
    c10d::broadcast_coalesced(group.c10d(), ts, kBroadcastBucketBytes, 0);
  }
};

DataParallel::DataParallel(std::shared_ptr<torch::nn::Module> module, ProcessGroup group, DataParallelOptions options)
    : impl_(std::make_unique<Impl>()) {
  auto& m = *impl_;
  if (!module) throw Error("[remat::parallel] DataParallel got a null module.");
  if (!group.defined()) {
    throw Error("[remat::parallel] DataParallel got a ProcessGroup that was not joined; use init_process_group().");
  }
  if (options.bucket_cap_bytes() <= 0 || options.first_bucket_cap_bytes() <= 0) {
    throw Error("[remat::parallel] bucket_cap_bytes " + std::to_string(options.bucket_cap_bytes()) +
                " and first_bucket_cap_bytes " + std::to_string(options.first_bucket_cap_bytes()) +
                " must be positive (the defaults are 25 MiB and 1 MiB).");
  }
  m.module = std::move(module);
  m.group = std::move(group);
  m.options = options;
  std::unordered_map<size_t, std::string> names;
  std::vector<at::Tensor> state;  // every parameter, frozen ones too; then the buffers
  for (const auto& item : m.module->named_parameters(/*recurse=*/true)) {
    state.push_back(item.value());
    if (!item.value().requires_grad()) continue;
    names[m.params.size()] = item.key();
    m.params.push_back(item.value());
  }
  if (m.params.empty()) {
    throw Error("[remat::parallel] the module has no parameter that requires grad: nothing to synchronise.");
  }
  for (const auto& b : m.module->buffers(/*recurse=*/true)) {
    if (b.defined()) m.buffers.push_back(b);
  }
  const auto device = m.params.front().device();
  for (size_t i = 0; i < m.params.size(); ++i) {
    if (m.params[i].device() != device) {
      throw Error("[remat::parallel] parameter '" + names[i] + "' is on " + m.params[i].device().str() + ", '" +
                  names[0] + "' on " + device.str() + ": DataParallel needs the whole module on one device.");
    }
  }
  if (device.type() != m.group.device()) {
    throw Error("[remat::parallel] the module is on " + device.str() + " but the group was made for " +
                c10::DeviceTypeName(m.group.device()) + "; move the module, or join with InitOptions::device.");
  }
  // Every rank must hold the same parameter shapes, frozen ones included
  // (c10d's check, with its message), before rank 0's whole state is
  // broadcast: every parameter, frozen or not, and the buffers, as DDP's
  // _sync_module_states. A frozen parameter gets no gradient, so nothing
  // else would ever make the ranks' copies agree.
  c10d::verify_params_across_processes(m.group.c10d(), state, std::nullopt);
  state.insert(state.end(), m.buffers.begin(), m.buffers.end());
  m.broadcast(state);
  // As DDP without find_unused_parameters: one bucket in the first step,
  // rebuilt in gradient-ready order (bucket_cap_bytes) from the second.
  const std::vector<bool> sparse(m.params.size(), false);
  auto assigned = c10d::compute_bucket_assignment_by_size(m.params, {std::numeric_limits<size_t>::max()}, sparse);
  auto indices = std::get<0>(assigned);
  std::reverse(indices.begin(), indices.end());
  m.reducer = std::make_shared<c10d::Reducer>(
      m.params, std::move(indices), m.group.c10d(), sparse, options.bucket_cap_bytes(),
      options.find_unused_parameters(), /*gradient_as_bucket_view=*/false, std::move(names),
      /*first_bucket_bytes_cap=*/options.first_bucket_cap_bytes(), /*skip_all_reduce_unused_params=*/false,
      /*use_python_reducer=*/false, /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
  // The Reducer logs through a c10d::Logger it holds weakly and does not
  // check for one everywhere: search_unused_parameters (find_unused_parameters)
  // dereferences it as soon as the set of unused parameters changes between
  // steps. DDP makes one per reducer and sets it; so do we.
  m.logger = std::make_shared<c10d::Logger>(m.reducer);
  m.reducer->set_logger(m.logger);
  m.logger->set_construction_data_and_log(m.module->name(), /*device_ids=*/{},
                                          /*output_device=*/-1, options.broadcast_buffers(), /*has_sync_bn=*/false,
                                          /*static_graph=*/false);
  m.reducer->register_comm_hook(std::make_unique<TimedAllReduce>(m.group.c10d(), m.rec, m.group.timeout()));
  m.deferred = std::make_unique<remat::detail::DeferredGradients>(
      m.params,
      "DataParallel averages their gradients at the end of backward, and its buckets hold every gradient "
      "anyway");
}

DataParallel::~DataParallel() = default;

void DataParallel::prepare_for_forward() {
  auto& m = *impl_;
  if (m.armed) {
    m.rec->finish();
    m.armed = false;
  }
  if (at::GradMode::is_enabled()) {
    m.reducer->prepare_for_forward();
    m.reducer->rebuild_buckets();
  }
  if (m.options.broadcast_buffers()) m.broadcast(m.buffers);
}

void DataParallel::prepare_for_backward(const std::vector<at::Tensor>& outputs) {
  auto& m = *impl_;
  // A forward under no grad (an evaluation) has no backward to wait for:
  // armed, the Reducer failed the next step's forward in rebuild_buckets.
  if (!at::GradMode::is_enabled()) return;
  m.rec->begin();
  m.reducer->prepare_for_backward(m.options.find_unused_parameters() ? outputs : std::vector<at::Tensor>{});
  m.armed = true;
}

CommStats DataParallel::last_stats() const {
  auto& m = *impl_;
  if (m.armed) {
    m.rec->finish();
    m.armed = false;
  }
  std::lock_guard<std::mutex> lock(m.rec->mu);
  return m.rec->last;
}

const ProcessGroup& DataParallel::group() const { return impl_->group; }

}  // namespace remat::parallel
