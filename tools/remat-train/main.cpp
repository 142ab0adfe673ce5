// remat-train: trains a GPT (character level on a text file) or a ResNet
// (synthetic images) under one checkpoint strategy and prints a line per step.
// This file parses flags and starts ranks; the loop is remat::models::Trainer.
// --nproc N runs N data-parallel ranks here (remat::parallel, Gloo); --rank,
// --world-size and --master-addr/--master-port start one rank of a multi-host run.
// Leaves out: evaluation, sampling text, learning-rate schedules.
#include <CLI/CLI.hpp>

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <iostream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/version.h>

#include <remat/error.h>
#include <remat/memory.h>
#include <remat/models/gpt.h>
#include <remat/models/resnet.h>
#include <remat/models/trainer.h>
#include <remat/optim.h>
#include <remat/parallel/data_parallel.h>
#include <remat/parallel/fully_shard.h>
#include <remat/parallel/pipeline.h>
#include <remat/plan/error.h>

extern char** environ;

namespace {

/** --token-cache's default: $XDG_CACHE_HOME/remat/tokens, else
 *  ~/.cache/remat/tokens ("none" without either). */
std::string default_token_cache() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0')
    return std::string(x) + "/remat/tokens";
  if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') return std::string(h) + "/.cache/remat/tokens";
  return "none";
}

int fail(const std::string& what) {
  std::cerr << "remat-train: error: " << what.substr(0, what.find('\n')) << "\n";
  return 2;
}

/** One line, written at once (ranks share the terminal). */
void say(const std::string& line) {
  const std::string l = line + "\n";
  std::fwrite(l.data(), 1, l.size(), stdout);
  std::fflush(stdout);
}

/** A TCP port on this machine: `port` (0: one the kernel picks, free now),
 *  bound on every address as rank 0's store will; -1 with errno when it
 *  cannot be bound (EADDRINUSE: another process listens there). */
int bindable_port(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);  // as c10d's store: TIME_WAIT does not block
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  socklen_t len = sizeof addr;
  int got = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 && ::listen(fd, 1) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    got = ntohs(addr.sin_port);
  }
  const int saved = errno;
  ::close(fd);
  errno = saved;
  return got;
}

/** The signal this process was asked to stop with (SIGINT, SIGTERM,
 *  SIGHUP), 0 while none. */
volatile sig_atomic_t g_stop_signal = 0;
/** 1 once a second request to stop came, a second or more after the first. */
volatile sig_atomic_t g_stop_again = 0;
/** Whether a second request ends this process at once (all but the
 *  launcher, which kills its ranks then). */
volatile sig_atomic_t g_die_on_stop_again = 0;
/** CLOCK_MONOTONIC of the first request, ms (lock-free: read in the handler). */
std::atomic<int64_t> g_stop_first_ms{0};

extern "C" void on_stop_signal(int sig) {
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);  // async-signal-safe
  const int64_t ms = static_cast<int64_t>(now.tv_sec) * 1000 + now.tv_nsec / 1000000;
  if (g_stop_signal == 0) {
    g_stop_first_ms.store(ms);  // first: a second request compares with it
    g_stop_signal = sig;
    return;
  }
  // The same request sent twice: a terminal's Ctrl-C and `timeout` signal
  // the whole process group as well as the process, and the launcher
  // forwards what it gets to its ranks.
  if (ms - g_stop_first_ms.load() < 1000) return;
  g_stop_again = 1;
  if (g_die_on_stop_again) {
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    ::sigaction(sig, &dfl, nullptr);
    ::raise(sig);
  }
}

/** on_stop_signal for SIGINT, SIGTERM and SIGHUP. The first request ends
 *  the run between steps; a second one, a second or more later, ends this
 *  process at once where die_on_again (else g_stop_again says it came).
 *  SA_RESTART: the stores' file I/O goes on through the first. */
void catch_stop_signals(bool die_on_again) {
  static_assert(std::atomic<int64_t>::is_always_lock_free, "read in a signal handler");
  g_die_on_stop_again = die_on_again ? 1 : 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&sa.sa_mask, sig);  // one handler at a time
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
}

/** Whether any rank of `group` was asked to stop (g_stop_signal), asked of
 *  every rank between steps: one all-reduce of one value per step, so that
 *  all end after the same step. A rank that stopped alone would leave the
 *  others waiting in the next step's collectives until they time out, and
 *  be killed with its files. */
bool any_rank_stopping(const remat::parallel::ProcessGroup& group) {
  auto flag = torch::full({1}, g_stop_signal != 0 ? 1.0f : 0.0f);
  group.all_reduce_sum(flag);
  return flag.item<float>() > 0.0f;
}

/** --nproc N: runs this program N times as ranks 0..N-1 on 127.0.0.1 (the
 *  same flags, plus --rank, --world-size and the master's address), waits
 *  for all, and returns the first failure's exit code. When a rank fails,
 *  the others get grace_s to fail on their own (a peer's exit is an error
 *  there within the group timeout) before they are killed.
 *  NOTE [ranks die with the launcher]: each rank asks the kernel for
 *  SIGKILL when the launcher dies (PR_SET_PDEATHSIG, set between fork and
 *  exec, so no rank outlives a launcher killed with SIGKILL); SIGINT,
 *  SIGTERM and SIGHUP sent to the launcher go to every rank, which end
 *  together after their current step (any_rank_stopping), removing their
 *  files; those still running kStopGraceS later, or at a second signal,
 *  are killed. The launcher then exits with 128 + the signal. */
int launch(int argc, char** argv, const std::vector<std::string>& extra, int nproc, int port, double grace_s) {
  constexpr double kStopGraceS = 60.0;  // a step of the reference models takes seconds on a CPU
  std::vector<std::string> base;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (i > 0 && (a == "--nproc" || a == "--master-port" || a == "--master-addr")) {
      ++i;  // replaced below
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0 || a.rfind("--master-port=", 0) == 0 || a.rfind("--master-addr=", 0) == 0) continue;
    base.push_back(a);
  }
  base[0] = "/proc/self/exe";
  base.insert(base.end(), extra.begin(), extra.end());
  catch_stop_signals(/*die_on_again=*/false);
  const pid_t launcher = ::getpid();
  std::vector<pid_t> pids;
  for (int r = 0; r < nproc; ++r) {
    auto args = base;
    for (const std::string& a :
         {std::string("--rank"), std::to_string(r), std::string("--world-size"), std::to_string(nproc),
          std::string("--master-addr"), std::string("127.0.0.1"), std::string("--master-port"), std::to_string(port)}) {
      args.push_back(a);
    }
    std::vector<char*> cargs;
    for (auto& a : args) cargs.push_back(a.data());
    cargs.push_back(nullptr);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid == 0) {  // the child: async-signal-safe calls only, up to exec
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &dfl, nullptr);
      if (::prctl(PR_SET_PDEATHSIG, SIGKILL) != 0 || ::getppid() != launcher) ::_exit(127);
      ::execve("/proc/self/exe", cargs.data(), environ);
      ::_exit(127);
    }
    if (pid < 0) {
      for (pid_t p : pids) ::kill(p, SIGKILL);
      for (pid_t p : pids) ::waitpid(p, nullptr, 0);
      return fail("[remat::train] could not start rank " + std::to_string(r) + " of --nproc " + std::to_string(nproc) +
                  ": " + std::strerror(errno) + ".");
    }
    pids.push_back(pid);
  }
  int first_failure = 0;
  bool all_finished = true;  // every rank exited 0 (a signal during the last step lets them finish)
  std::vector<bool> done(pids.size(), false);
  size_t left = pids.size();
  auto deadline = std::chrono::steady_clock::time_point::max();
  int forwarded = 0;
  while (left > 0) {
    if (g_stop_signal != 0 && forwarded == 0) {
      forwarded = g_stop_signal;
      for (size_t r = 0; r < pids.size(); ++r) {
        if (!done[r]) ::kill(pids[r], forwarded);
      }
      deadline = std::min(
          deadline, std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                           std::chrono::duration<double>(kStopGraceS)));
    }
    for (size_t r = 0; r < pids.size(); ++r) {
      if (done[r]) continue;
      int st = 0;
      if (::waitpid(pids[r], &st, WNOHANG) != pids[r]) continue;
      done[r] = true;
      --left;
      const int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      all_finished &= code == 0;
      // A rank the signal killed (before its handler was set: loading, or
      // joining the group) leaves its peers waiting for it: stop them now.
      if (forwarded != 0 && WIFSIGNALED(st)) deadline = std::chrono::steady_clock::time_point::min();
      if (code != 0 && first_failure == 0 && forwarded == 0) {
        first_failure = code;
        std::cerr << "remat-train: rank " << r << " exited with status " << code << "\n";
        deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                          std::chrono::duration<double>(grace_s));
      }
    }
    if (left > 0 && (std::chrono::steady_clock::now() > deadline || g_stop_again != 0)) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (done[r]) continue;
        std::cerr << "remat-train: rank " << r
                  << (g_stop_again != 0 ? " still running at a second signal"
                      : forwarded != 0  ? " still running after the launcher was stopped"
                                        : " still running after rank failure")
                  << "; killing it\n";
        ::kill(pids[r], SIGKILL);
        ::waitpid(pids[r], nullptr, 0);
        done[r] = true;
        --left;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (forwarded != 0 && !all_finished) {
    std::cerr << "remat-train: stopped by signal " << forwarded << " (" << strsignal(forwarded)
              << "); the ranks were stopped too\n";
    return 128 + forwarded;
  }
  return first_failure;
}

/** One rank of a data-parallel run: joins the group, synchronises the
 *  gradients through remat::parallel::DataParallel, prints a line per step
 *  with this rank's throughput and the step's all-reduce. Rank 0 saves.
 *  Returns the steps done where the ranks were asked to stop before the
 *  last (nothing saved), else nullopt; as do the other two kinds of rank. */
std::optional<int64_t> run_rank(remat::models::TrainConfig cfg, const remat::parallel::InitOptions& init) {
  cfg.data_rank = init.rank();
  cfg.data_world = init.world_size();
  if (init.rank() != 0) cfg.save_path.clear();
  remat::models::Trainer trainer(cfg, init.rank() == 0 ? &std::cout : nullptr);
  const std::string tag = "[rank " + std::to_string(init.rank()) + "/" + std::to_string(init.world_size()) + "] ";
  auto group = remat::parallel::init_process_group(init);
  remat::parallel::DataParallel ddp(trainer.module(), group);
  remat::models::StepHooks hooks;
  hooks.before_forward = [&] { ddp.prepare_for_forward(); };
  hooks.before_backward = [&](const at::Tensor& loss, bool sync) {
    if (sync) ddp.prepare_for_backward({loss});
  };
  trainer.set_step_hooks(hooks);
  if (init.rank() == 0)
    say(trainer.summary() + "; data parallel over " + std::to_string(init.world_size()) +
        " processes (Gloo), global batch " + std::to_string(cfg.batch * init.world_size()));
  const char* unit = cfg.model == "gpt" ? "tok" : "img";
  while (trainer.steps_done() < cfg.steps) {
    if (any_rank_stopping(group)) return trainer.steps_done();
    const auto s = trainer.step();
    const auto c = ddp.last_stats();
    char comm[160];
    std::snprintf(comm, sizeof comm, "  all-reduce %.1f ms in %lld buckets (%.1f ms exposed, %.0f%% overlapped)",
                  c.allreduce_ms, static_cast<long long>(c.buckets), c.exposed_ms, 100.0 * c.overlap);
    say(tag + remat::models::format_step(s, cfg.steps, unit) + comm);
  }
  if (!cfg.save_path.empty()) {
    trainer.save(cfg.save_path);
    say(tag + "saved step " + std::to_string(trainer.steps_done()) + " to " + cfg.save_path);
  }
  return std::nullopt;
}

/** One rank of a sharded run (--shard): remat::parallel::FullyShard over the
 *  model's blocks, the optimizer over this rank's shards; prints a line per
 *  step with the bytes this rank holds and the step's collectives. --save
 *  writes the full model (torch::save of the module, loadable unsharded). */
std::optional<int64_t> run_shard_rank(remat::models::TrainConfig cfg, const remat::parallel::InitOptions& init) {
  if (!cfg.resume_path.empty()) {
    throw remat::Error(
        "[remat::train] --resume does not combine with --shard: a sharded run's --save writes the model's "
        "weights only, not the optimizer's state and step count a resume needs. Resume a checkpoint that "
        "--save wrote without --shard (and train on without --shard), or start the sharded run afresh.");
  }
  cfg.data_rank = init.rank();
  cfg.data_world = init.world_size();
  const std::string save = cfg.save_path;
  cfg.save_path.clear();
  remat::models::Trainer trainer(cfg, init.rank() == 0 ? &std::cout : nullptr);
  const std::string tag = "[rank " + std::to_string(init.rank()) + "/" + std::to_string(init.world_size()) + "] ";
  auto group = remat::parallel::init_process_group(init);
  const auto units = cfg.model == "gpt" ? remat::select::type<remat::models::GptBlockImpl>()
                                        : remat::select::type<remat::models::ResBlockImpl>();
  remat::parallel::FullyShard fsdp(trainer.module(), group, remat::parallel::FullyShardOptions().units(units));
  trainer.use_optimizer_parameters(fsdp.parameters());
  remat::models::StepHooks hooks;
  hooks.before_every_forward = [&] { fsdp.begin_forward(); };
  hooks.clip = [&](double max_norm) { fsdp.clip_grad_norm(max_norm); };
  trainer.set_step_hooks(hooks);
  if (init.rank() == 0) {
    say(trainer.summary() + "; sharded data parallel over " + std::to_string(init.world_size()) +
        " processes (Gloo), " + std::to_string(fsdp.units().size() - 1) + " units + root, global batch " +
        std::to_string(cfg.batch * init.world_size()));
  }
  const char* unit = cfg.model == "gpt" ? "tok" : "img";
  while (trainer.steps_done() < cfg.steps) {
    if (any_rank_stopping(group)) return trainer.steps_done();
    fsdp.reset_stats();
    const auto s = trainer.step();
    const auto c = fsdp.stats();
    const auto mem = fsdp.memory();
    const double comm = c.allgather_ms + c.reduce_scatter_ms;
    char line[512];
    std::snprintf(line, sizeof line,
                  "  held: params %s, grads %s, optimizer %s  all-gather %.1f ms (%lld), reduce-scatter %.1f ms "
                  "(%lld), %.1f ms exposed, %.0f%% overlapped",
                  remat::format_bytes(mem.shard_parameter_bytes).c_str(),
                  remat::format_bytes(mem.shard_gradient_bytes).c_str(),
                  trainer.describe_optimizer_state_memory().c_str(), c.allgather_ms,
                  static_cast<long long>(c.forward_allgathers + c.backward_allgathers), c.reduce_scatter_ms,
                  static_cast<long long>(c.reduce_scatters), c.exposed_ms,
                  comm > 0 ? 100.0 * std::max(0.0, 1.0 - c.exposed_ms / comm) : 0.0);
    say(tag + remat::models::format_step(s, cfg.steps, unit) + line);
  }
  if (!save.empty()) {
    fsdp.save_full(save);
    if (init.rank() == 0)
      say(tag + "saved the full model (step " + std::to_string(trainer.steps_done()) + ") to " + save);
  }
  return std::nullopt;
}

/** One stage of a pipeline (--pipeline P): the GPT's blocks cut into P
 *  stages, this rank's the stage of its rank; each step runs
 *  --microbatches micro-batches of --batch sequences under --schedule. The
 *  rank keeps only its stage's parameters (and the embedding, tied to the
 *  head); prints a line per step with the stage's figures and, under
 *  --checkpoint auto, its plan at the end. */
std::optional<int64_t> run_pipeline_rank(remat::models::TrainConfig cfg, const remat::parallel::InitOptions& init,
                                         int stages, int microbatches, const std::string& schedule) {
  // Ranks are replica x stages + stage; replicas split the global batch.
  const int replicas = init.world_size() / stages;
  const int stage = init.rank() % stages, replica = init.rank() / stages;
  const int64_t per_micro = cfg.batch;
  cfg.batch *= microbatches;  // the Trainer draws the replica's batch; its stage 0 splits it
  cfg.data_rank = replica;
  cfg.data_world = replicas;
  remat::models::Trainer trainer(cfg, init.rank() == 0 ? &std::cout : nullptr);
  const auto mine = trainer.pipeline_parameters(stage, stages);
  const auto tied = trainer.tied_embedding();
  {  // Release what other stages run: each rank holds its stage only.
    torch::NoGradGuard no_grad;
    for (auto& p : trainer.module()->parameters()) {
      const bool keep =
          std::any_of(mine.begin(), mine.end(), [&](const at::Tensor& t) { return t.is_same(p); }) || p.is_same(tied);
      if (!keep) p.set_data(torch::empty({0}, p.options()));
    }
  }
  trainer.use_optimizer_parameters(mine);
  auto world = remat::parallel::init_process_group(init);
  remat::parallel::ProcessGroup group = world, data;
  if (replicas > 1) {  // this replica's stages, then this stage's replicas
    std::vector<int> stage_ranks, replica_ranks;
    for (int s = 0; s < stages; ++s) stage_ranks.push_back(replica * stages + s);
    for (int d = 0; d < replicas; ++d) replica_ranks.push_back(d * stages + stage);
    group = world.new_group(stage_ranks);
    data = world.new_group(replica_ranks);
  }
  remat::parallel::Pipeline pipe(
      group, [&](const std::vector<at::Tensor>& in) { return trainer.pipeline_stage(stage, stages, in); },
      remat::parallel::PipelineOptions()
          .microbatches(microbatches)
          .schedule(remat::parallel::parse_pipeline_schedule(schedule))
          .tied({tied}));
  // Replicas average the stage's gradients after the pipeline's step: a
  // StepInBackward (--optimizer-in-backward) leaves them to the optimizer.
  std::optional<remat::detail::DeferredGradients> averaged_after;
  if (replicas > 1) averaged_after.emplace(mine, "averaged over the pipeline's data-parallel replicas after backward");
  remat::models::StepHooks hooks;
  hooks.forward_backward = [&](const at::Tensor& x, const at::Tensor& y, double scale) {
    auto loss = [&](const std::vector<at::Tensor>& o, const std::vector<at::Tensor>& t) {
      return trainer.pipeline_loss(o, t) * scale;
    };
    auto l = pipe.step({x}, {y}, loss) / scale;
    if (replicas > 1) {  // gradients and the printed loss: the mean over the replicas
      remat::parallel::average_gradients(data, mine);
      auto sum = l.reshape({1}).clone();
      data.all_reduce_sum(sum);
      l = sum.reshape({}) / static_cast<double>(replicas);
    }
    return l;
  };
  hooks.clip = [&](double max_norm) { pipe.clip_grad_norm(mine, max_norm); };
  trainer.set_step_hooks(hooks);
  const std::string tag =
      "[stage " + std::to_string(stage) + "/" + std::to_string(stages) +
      (replicas > 1 ? ", replica " + std::to_string(replica) + "/" + std::to_string(replicas) : "") + "] ";
  if (init.rank() == 0) {
    say(trainer.summary() + "; pipeline of " + std::to_string(stages) + " stages (Gloo), " +
        std::to_string(microbatches) + " micro-batches of " + std::to_string(per_micro) + " (" + schedule + ")" +
        (replicas > 1 ? ", " + std::to_string(replicas) + " data-parallel replicas" : "") + ", global batch " +
        std::to_string(cfg.batch * replicas));
  }
  int64_t params = 0;
  for (const auto& p : mine) params += p.numel();
  const int holds = pipe.planned_in_flight();
  say(tag + std::to_string(params) + " parameters; holds at most " + std::to_string(holds) +
      (holds == 1 ? " micro-batch" : " micro-batches") + " at once");
  while (trainer.steps_done() < cfg.steps) {
    if (any_rank_stopping(world)) return trainer.steps_done();
    const auto s = trainer.step();
    const auto p = pipe.stats();
    char line[256];
    std::snprintf(line, sizeof line,
                  "  forward %.1f ms, backward %.1f ms, waiting %.1f ms, sends %.1f ms, bubble %.0f%%, %d in flight",
                  p.forward_ms, p.backward_ms, p.recv_ms, p.send_ms, 100.0 * p.bubble, p.max_in_flight);
    say(tag + remat::models::format_step(s, cfg.steps, "tok") + line);
  }
  if (trainer.planner() != nullptr) {
    // The planner's budget is all tracked memory: say what it adds to --memory-budget.
    if (const std::string b = trainer.describe_auto_budget(); !b.empty()) say(tag + b);
    say(tag + pipe.explain(trainer.planner()));
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"remat-train: train a GPT or ResNet with activation checkpointing (remat)"};
  // REMAT_VERSION: the project's CMake version (tools/remat-train/CMakeLists.txt);
  // TORCH_VERSION: the LibTorch headers this build compiled against.
  app.set_version_flag("--version", "remat-train, remat " REMAT_VERSION "\nLibTorch " TORCH_VERSION,
                       "print remat's version and LibTorch's, then exit");
  remat::models::TrainConfig cfg;
  std::string checkpoint = "none", budget, seq_cap, batch_cap, d_model_cap, loss_chunks = "0";
  int64_t fit_step = 1;
  int64_t fit_max = 0;
  app.add_option("--model", cfg.model, "gpt (character level on --data) or resnet (synthetic images)")
      ->check(CLI::IsMember({"gpt", "resnet"}))
      ->capture_default_str();
  app.add_option("--layers", cfg.layers, "GPT blocks (default 6) or ResNet depth 10/18/34/50/101/152 (default 18)");
  app.add_option("--d-model", cfg.d_model, "GPT width (default 128) or ResNet base width (default 16)");
  app.add_option("--heads", cfg.heads, "GPT attention heads")->capture_default_str();
  app.add_option("--seq-len", cfg.seq_len, "GPT context, tokens")->capture_default_str();
  app.add_option("--image-size", cfg.image_size, "ResNet image side, pixels")->capture_default_str();
  app.add_option("--batch", cfg.batch, "sequences or images per micro-batch")->capture_default_str();
  app.add_option("--steps", cfg.steps, "optimizer steps (total, counting resumed ones)")->capture_default_str();
  app.add_option("--lr", cfg.lr, "AdamW learning rate")->capture_default_str();
  app.add_option("--dropout", cfg.dropout, "GPT dropout probability")->capture_default_str();
  app.add_flag("--sdpa", cfg.sdpa, "GPT attention through scaled_dot_product_attention (no T x T scores kept)");
  app.add_option("--loss-chunks", loss_chunks,
                 "GPT: head and cross-entropy over N slices of the tokens, never the whole logits (0: off; auto: "
                 "with --checkpoint auto, the plan chooses)")
      ->capture_default_str();
  app.add_option("--mlp-chunks", cfg.mlp_chunks, "GPT: each MLP over N checkpointed slices of the sequence (0: off)")
      ->capture_default_str();
  app.add_option("--seed", cfg.seed, "seed of parameters, dropout and data")->capture_default_str();
  app.add_option("--checkpoint", checkpoint, "none, block, sqrt, selective, auto or offload")
      ->check(CLI::IsMember({"none", "block", "sqrt", "selective", "auto", "offload"}))
      ->capture_default_str();
  app.add_option("--policy", cfg.policy,
                 "with --checkpoint selective: megatron (GPT default), save_matmuls (ResNet default), "
                 "save_nothing or attention")
      ->check(CLI::IsMember({"megatron", "save_matmuls", "save_nothing", "attention"}));
  bool explain_memory = false;
  app.add_flag("--explain-memory", explain_memory,
               "print what one block saves for backward (op, name, shape, bytes; with the policy) and exit");
  app.add_option("--offload-dir", cfg.offload_dir,
                 "an existing writable directory for files: with --checkpoint offload, every block's saved "
                 "activations; with --checkpoint auto --auto-offload, a disk store on the plan's menu; with "
                 "--optimizer-state disk, the optimizer's state");
  app.add_flag("--auto-offload", cfg.auto_offload,
               "--checkpoint auto: a disk store in --offload-dir on the plan's menu: a unit may send what it saves, "
               "or its inputs while it recomputes, to files; the bytes in flight planned from 256 KiB up where the "
               "budget has room (lossless)");
  app.add_option("--memory-budget", budget,
                 "--checkpoint auto: bound on each planned step's peak above its start (the 'peak' column: "
                 "activations, logits, temporaries; parameters, gradients and AdamW state are outside it, state in a "
                 "store counted as kept), "
                 "e.g. 512MiB, 2GiB, 1000000; auto_checkpoint plans the whole step (embedding, blocks, head, loss) "
                 "from step 2, planned steps from step 3");
  app.add_option("--max-seq-len-under", seq_cap,
                 "GPT: find the longest --seq-len whose step peaks at or under this (e.g. 1GiB; the 'peak' "
                 "column's quantity): predicted, then measured");
  app.add_option("--max-batch-under", batch_cap, "the same for --batch (GPT; ResNet with --checkpoint auto)");
  app.add_option("--max-d-model-under", d_model_cap,
                 "GPT: find the widest --d-model (a multiple of --heads and --fit-step) whose whole step fits "
                 "this (e.g. 2GiB): parameters, gradients and optimizer state in memory as well as the "
                 "activations; predicted, then measured (checkpoint none, block, sqrt, selective or auto)");
  app.add_option("--fit-step", fit_step,
                 "granularity of --max-*-under (tokens, sequences or widths); default 1, 64 for --max-d-model-under");
  app.add_option("--fit-max", fit_max,
                 "largest value --max-*-under tries (0: the data's length for --seq-len, 65536 sequences, 16384 "
                 "widths); a smaller one bounds the search's time")
      ->capture_default_str();
  app.add_option("--grad-accum", cfg.grad_accum, "micro-batches per optimizer step")->capture_default_str();
  app.add_option("--clip-norm", cfg.clip_norm, "max global gradient norm (0: off)")->capture_default_str();
  app.add_flag("--optimizer-in-backward", cfg.optimizer_in_backward,
               "update each parameter inside backward as soon as its gradient is final, then free that gradient "
               "(the same training; gradients never all live at once; not with --clip-norm)");
  app.add_option("--optimizer-state", cfg.optimizer_state,
                 "with --optimizer-in-backward: keep each parameter's optimizer state between its updates on disk "
                 "(files in --offload-dir, lossless), in pinned host memory (host; from a GPU), or in memory as "
                 "bfloat16 (bf16: half the bytes, lossy) or as 8-bit codes with a scale per 256 values (int8: "
                 "0.27 of the bytes, lossy)")
      ->check(CLI::IsMember({"disk", "host", "bf16", "int8"}));
  app.add_flag("--bf16", cfg.bf16, "forward under CPU autocast to bfloat16");
  app.add_option("--data", cfg.data_path, "text file for the GPT")->capture_default_str();
  app.add_option("--tokenizer", cfg.tokenizer,
                 "GPT: SentencePiece .model file to load, or with --vocab-size where to write the one trained "
                 "(default: character level)");
  app.add_option("--vocab-size", cfg.vocab_size,
                 "GPT: train a SentencePiece BPE tokenizer of N pieces on --data (0: no training)")
      ->capture_default_str();
  app.add_option("--threads", cfg.threads, "torch intra-op threads")->capture_default_str();
  app.add_option("--save", cfg.save_path, "write a checkpoint here at the end (atomically)");
  app.add_option("--resume", cfg.resume_path, "continue from a checkpoint written by --save");
  std::string token_cache = default_token_cache();
  app.add_option("--token-cache", token_cache,
                 "GPT with a SentencePiece tokenizer: directory keeping the corpus's token ids between runs (one "
                 "file per corpus and tokenizer; none: encode every run)")
      ->capture_default_str();
  app.add_option("--optimizer", cfg.optimizer, "adamw or sgd")
      ->check(CLI::IsMember({"adamw", "sgd"}))
      ->capture_default_str();
  int nproc = 1, rank = -1, world_size = 1, master_port = 29500;
  std::string master_addr = "127.0.0.1";
  double dist_timeout_s = 300.0;
  app.add_option("--nproc", nproc,
                 "data parallel: run N processes on this machine (ranks 0..N-1 on 127.0.0.1, Gloo), each with "
                 "--batch sequences: the global batch is N x --batch")
      ->capture_default_str();
  app.add_option("--rank", rank, "multi-host: this process's rank in 0..--world-size-1 (start one per rank)");
  app.add_option("--world-size", world_size, "multi-host: the number of processes in all")->capture_default_str();
  app.add_option("--master-addr", master_addr, "address of rank 0's store (every rank the same)")
      ->capture_default_str();
  app.add_option("--master-port", master_port,
                 "port of rank 0's store (every rank the same; with --nproc or --pipeline on one machine: default a "
                 "free port)")
      ->capture_default_str();
  bool shard = false;
  app.add_flag("--shard", shard,
               "with --nproc or --rank: shard parameters, gradients and optimizer state across the ranks "
               "(FullyShard, one unit per block) instead of replicating them");
  int pipeline = 0, microbatches = 4;
  std::string schedule = "1f1b";
  app.add_option("--pipeline", pipeline,
                 "pipeline parallel: run the GPT's blocks as P stages, one process each (ranks on 127.0.0.1 like "
                 "--nproc; or --rank with --world-size P across hosts); with --nproc N (a multiple of P), N / P "
                 "data-parallel replicas of the pipeline")
      ->capture_default_str();
  app.add_option("--microbatches", microbatches, "with --pipeline: micro-batches of --batch sequences per step")
      ->capture_default_str();
  app.add_option("--schedule", schedule, "with --pipeline: 1f1b (less memory) or gpipe")
      ->check(CLI::IsMember({"1f1b", "gpipe"}))
      ->capture_default_str();
  app.add_option("--dist-timeout", dist_timeout_s,
                 "seconds a rank waits for its peers (store, all-reduce) before failing")
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(std::string(e.what()) + " (run remat-train --help for the flags)");
  }
  try {
    cfg.checkpoint = remat::models::parse_strategy(checkpoint);
    if (loss_chunks == "auto") {
      cfg.plan_loss_chunks = true;
    } else {
      size_t used = 0;
      try {
        cfg.loss_chunks = std::stoll(loss_chunks, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != loss_chunks.size()) {
        throw remat::Error("[remat::train] --loss-chunks '" + loss_chunks +
                           "' is neither a number of chunks nor auto. Pass e.g. 8, 0 (off) or auto.");
      }
    }
    cfg.token_cache_dir = token_cache == "none" ? "" : token_cache;
    // 0 means "the default" inside TrainConfig; given on the command line it
    // would silently train another size.
    for (const auto& [flag, v] : {std::pair<const char*, int64_t>{"--layers", cfg.layers},
                                  {"--d-model", cfg.d_model},
                                  {"--threads", cfg.threads}}) {
      if (app.count(flag) > 0 && v <= 0) {
        return fail(std::string("[remat::train] ") + flag + " must be positive, got " + std::to_string(v) +
                    " (leave it out for the default).");
      }
    }
    // Flags that only one model reads: refused under the other rather than ignored.
    const char* gpt_only[] = {"--heads",      "--seq-len", "--dropout",   "--sdpa",      "--loss-chunks",
                              "--mlp-chunks", "--data",    "--tokenizer", "--vocab-size"};
    for (const char* flag : gpt_only) {
      if (cfg.model == "resnet" && app.count(flag) > 0) {
        return fail(std::string("[remat::train] ") + flag +
                    " sets up the GPT, and this run trains --model resnet; drop it, or use --model gpt.");
      }
    }
    if (cfg.model == "gpt" && app.count("--image-size") > 0) {
      return fail(
          "[remat::train] --image-size sets up the ResNet, and this run trains --model gpt; drop it, or use --model "
          "resnet.");
    }
    // Flags that only one strategy reads: refused under the others rather than ignored.
    const auto used_by = [&](const char* flag, const char* strategy, const char* what) -> std::string {
      if (app.count(flag) == 0 || checkpoint == strategy) return "";
      return std::string("[remat::train] ") + flag + " " + what + " --checkpoint " + strategy +
             ", and this run uses --checkpoint " + checkpoint + "; add --checkpoint " + strategy + ", or drop " + flag +
             ".";
    };
    if (seq_cap.empty() && batch_cap.empty()) {  // --max-*-under refuses --memory-budget itself
      if (auto e = used_by("--memory-budget", "auto", "is the budget of"); !e.empty()) return fail(e);
    }
    if (auto e = used_by("--policy", "selective", "picks what is kept by"); !e.empty()) return fail(e);
    // --offload-dir: where the activations go under offload (and auto with
    // --auto-offload), and where the optimizer's state goes.
    if (cfg.optimizer_state != "disk" && !cfg.auto_offload && app.count("--offload-dir") > 0 &&
        checkpoint != "offload") {
      return fail(
          "[remat::train] --offload-dir holds the files of --checkpoint offload (the activations), --checkpoint "
          "auto --auto-offload (the plan's disk store) and --optimizer-state disk (the optimizer's state), and this "
          "run uses --checkpoint " +
          checkpoint +
          (cfg.optimizer_state.empty() ? std::string() : " with --optimizer-state " + cfg.optimizer_state) +
          "; add one of them, or drop --offload-dir.");
    }
    const bool distributed = nproc > 1 || world_size > 1 || rank >= 0;
    if (nproc < 1) return fail("[remat::train] --nproc must be at least 1, got " + std::to_string(nproc) + ".");
    if (distributed && (!seq_cap.empty() || !batch_cap.empty() || explain_memory)) {
      return fail("[remat::train] --max-*-under and --explain-memory run in one process; drop --nproc/--rank.");
    }
    if (distributed && !shard && pipeline == 0 && !cfg.optimizer_state.empty()) {
      return fail("[remat::train] --optimizer-state " + cfg.optimizer_state +
                  " with data parallel ranks that are not sharded: DataParallel averages the gradients at the end of "
                  "backward, so every update is left to the optimizer's step() after it and the state never leaves the "
                  "optimizer. Add --shard (each rank updates and stores the state of its shard), or drop "
                  "--optimizer-state.");
    }
    if (nproc > 1 && rank >= 0) {
      return fail(
          "[remat::train] give --nproc (ranks started here) or --rank with --world-size (one rank, "
          "started by you), not both.");
    }
    if (!(dist_timeout_s > 0.0)) {
      return fail("[remat::train] --dist-timeout must be positive, got " + std::to_string(dist_timeout_s) + ".");
    }
    if (pipeline == 0 && (app.count("--microbatches") > 0 || app.count("--schedule") > 0)) {
      return fail("[remat::train] --microbatches and --schedule set up a pipeline; add --pipeline P.");
    }
    if (pipeline != 0) {
      if (world_size > 1 && rank < 0) {
        return fail("[remat::train] --world-size " + std::to_string(world_size) + " needs --rank.");
      }
      if (pipeline < 1)
        return fail("[remat::train] --pipeline must be at least 1 stage, got " + std::to_string(pipeline) + ".");
      if (shard) {
        return fail(
            "[remat::train] --pipeline does not combine with --shard (each stage's parameters are whole on its "
            "process); replicate the stages with --nproc instead.");
      }
      if (nproc > 1 && nproc % pipeline != 0) {
        return fail("[remat::train] --nproc " + std::to_string(nproc) + " with --pipeline " + std::to_string(pipeline) +
                    ": give a multiple of the stages (each replica of the pipeline takes --pipeline processes).");
      }
      if (microbatches < 1) {
        return fail("[remat::train] --microbatches must be at least 1, got " + std::to_string(microbatches) + ".");
      }
      if (cfg.model != "gpt")
        return fail("[remat::train] --pipeline cuts the GPT's blocks into stages; use --model gpt.");
      if (cfg.checkpoint == remat::models::Strategy::kSqrt) {
        return fail(
            "[remat::train] --checkpoint sqrt segments the whole block stack, and a pipeline stage runs part of it; "
            "use block, selective, auto or offload.");
      }
      if (!cfg.save_path.empty() || !cfg.resume_path.empty()) {
        return fail(
            "[remat::train] --save and --resume write and read one process's whole model; a pipeline's stages each "
            "hold a part. Drop them with --pipeline.");
      }
      if (cfg.grad_accum != 1) {
        return fail(
            "[remat::train] --grad-accum with --pipeline: the pipeline accumulates its micro-batches; use "
            "--microbatches.");
      }
      if (!seq_cap.empty() || !batch_cap.empty() || explain_memory) {
        return fail("[remat::train] --max-*-under and --explain-memory run in one process; drop --pipeline.");
      }
      if (rank < 0) {
        nproc = std::max(nproc, pipeline);
      } else if (world_size % pipeline != 0) {
        return fail("[remat::train] --pipeline " + std::to_string(pipeline) +
                    " needs a --world-size that is a multiple "
                    "of it (one process per stage and replica), got " +
                    std::to_string(world_size) + ".");
      }
    }
    if (!budget.empty()) {
      try {
        cfg.memory_budget_bytes = remat::plan::parse_bytes(budget);
      } catch (const remat::Error& e) {
        return fail(std::string("[remat::train] --memory-budget: ") + e.what());
      }
    }
    // What every rank would refuse, refused here once, before any starts
    // (--max-*-under sets its budget itself, and checks in each probe).
    const bool fitting = !seq_cap.empty() || !batch_cap.empty() || !d_model_cap.empty();
    if (!fitting) {
      auto checked = cfg;
      if (rank > 0) checked.save_path.clear();  // only rank 0 saves
      remat::models::check_config(checked);
    }
    if (shard && !cfg.resume_path.empty()) {
      return fail(
          "[remat::train] --resume does not combine with --shard: a sharded run's --save writes the model's "
          "weights only, not the optimizer's state and step count a resume needs. Resume a checkpoint that "
          "--save wrote without --shard (and train on without --shard), or start the sharded run afresh.");
    }
    if (!cfg.resume_path.empty() && !fitting) {  // --max-*-under refuses --resume (check_fit)
      const int64_t saved = remat::models::saved_steps(cfg.resume_path);
      if (cfg.steps <= saved) {
        return fail("[remat::train] --resume '" + cfg.resume_path + "' is at step " + std::to_string(saved) +
                    " and --steps is " + std::to_string(cfg.steps) +
                    ": nothing left to train (--steps counts the resumed steps). Pass --steps above " +
                    std::to_string(saved) + ".");
      }
    }
    if (pipeline > 0) {
      const int64_t blocks = cfg.layers > 0 ? cfg.layers : 6;  // the Trainer's default
      if (pipeline > blocks) {
        return fail("[remat::train] --pipeline " + std::to_string(pipeline) + " is more stages than the GPT's " +
                    std::to_string(blocks) + " blocks; give at most " + std::to_string(blocks) +
                    " (or more --layers).");
      }
    }
    if (nproc > 1 || (pipeline > 0 && rank < 0)) {
      if (master_port < 1 || master_port > 65535) {
        return fail("[remat::parallel] master_port " + std::to_string(master_port) +
                    " is not a TCP port; pick one in 1..65535 that is free on the master (e.g. 29500).");
      }
      if (app.count("--master-port") == 0) {
        master_port = bindable_port(0);
        if (master_port < 0) {
          return fail(std::string("[remat::train] no free TCP port for rank 0's store (") + std::strerror(errno) +
                      "); pass one with --master-port.");
        }
      } else if (bindable_port(master_port) < 0) {
        const std::string why =
            errno == EADDRINUSE
                ? std::string(" is in use on this machine (another process listens there)")
                : std::string(" cannot be used for rank 0's store on this machine (") + std::strerror(errno) + ")";
        return fail("[remat::train] --master-port " + std::to_string(master_port) + why +
                    ". Pick another, or leave --master-port out for a free one.");
      }
      // The cores are shared: without --threads, each rank gets its share.
      std::vector<std::string> extra;
      if (app.count("--threads") == 0) {
        const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
        extra = {"--threads", std::to_string(std::max(1u, hw / static_cast<unsigned>(nproc)))};
      }
      return launch(argc, argv, extra, nproc, master_port, dist_timeout_s + 10.0);
    }
    if (shard && !distributed) {
      return fail("[remat::train] --shard shards across processes: add --nproc N (or --rank and --world-size).");
    }
    if (distributed) {
      if (rank < 0) return fail("[remat::train] --world-size " + std::to_string(world_size) + " needs --rank.");
      const auto init = remat::parallel::InitOptions(rank, world_size)
                            .master_addr(master_addr)
                            .master_port(master_port)
                            .timeout(std::chrono::milliseconds(static_cast<int64_t>(dist_timeout_s * 1e3)));
      // As in one process (below), a signal ends the run between steps;
      // every rank ends after the same one (any_rank_stopping).
      catch_stop_signals(/*die_on_again=*/true);
      const std::optional<int64_t> stopped = pipeline > 0
                                                 ? run_pipeline_rank(cfg, init, pipeline, microbatches, schedule)
                                             : shard ? run_shard_rank(cfg, init)
                                                     : run_rank(cfg, init);
      if (!stopped) return 0;
      std::cout << std::flush;
      const int sig = g_stop_signal;
      if (rank == 0) {  // one line, as rank 0 prints the run's
        std::cerr << "remat-train: [rank 0/" + std::to_string(world_size) + "] " +
                         (sig != 0 ? "stopped by signal " + std::to_string(sig) + " (" + strsignal(sig) + ")"
                                   : std::string("stopped with the ranks that got a signal")) +
                         ", every rank after step " + std::to_string(*stopped) + " of " + std::to_string(cfg.steps) +
                         "; nothing saved, and the offload files are removed.\n"
                  << std::flush;
      }
      return sig != 0 ? 128 + sig : 1;
    }
    if (fitting) {
      std::vector<std::string> given;
      if (!seq_cap.empty()) given.push_back("--max-seq-len-under " + seq_cap);
      if (!batch_cap.empty()) given.push_back("--max-batch-under " + batch_cap);
      if (!d_model_cap.empty()) given.push_back("--max-d-model-under " + d_model_cap);
      if (given.size() > 1) {
        std::string got = given[0];
        for (size_t i = 1; i < given.size(); ++i) got += (i + 1 == given.size() ? " and " : ", ") + given[i];
        throw remat::Error(
            "[remat::train] give one of --max-seq-len-under, --max-batch-under and --max-d-model-under (the other "
            "values stay fixed); got " +
            got + ". Run one search at a time.");
      }
      if (!budget.empty()) {
        return fail(
            "[remat::train] --memory-budget is chosen by --max-*-under for --checkpoint auto (the largest whose "
            "whole step fits the cap); drop --memory-budget.");
      }
      using remat::models::FitDimension;
      remat::models::FitOptions fit;
      fit.dimension = !seq_cap.empty()     ? FitDimension::kSeqLen
                      : !batch_cap.empty() ? FitDimension::kBatch
                                           : FitDimension::kDModel;
      const std::string flag = given[0].substr(0, given[0].find(' '));
      try {
        fit.cap_bytes = remat::plan::parse_bytes(given[0].substr(given[0].find(' ') + 1));
      } catch (const remat::Error& e) {
        return fail("[remat::train] " + flag + ": " + e.what());
      }
      // Widths come in steps of 64 unless asked otherwise (and of --heads).
      fit.step = fit.dimension == FitDimension::kDModel && app.count("--fit-step") == 0 ? 64 : fit_step;
      fit.max_value = fit_max;
      remat::models::check_fit(cfg, fit);  // before building anything: a --resume, a ResNet, ...
      if (cfg.checkpoint == remat::models::Strategy::kAuto) {
        cfg.memory_budget_bytes = fit.cap_bytes;
        cfg.memory_budget_whole_step = fit.dimension == FitDimension::kDModel;
      }
      std::cout << remat::models::Trainer(cfg, &std::cout).summary() << "\n";
      const auto r = remat::models::max_under(cfg, fit, &std::cout);
      std::cout << remat::models::format_fit(r, cfg);
      return 0;
    }
    int64_t done = 0;
    {
      remat::models::Trainer trainer(cfg, &std::cout);
      if (explain_memory) {
        std::cout << trainer.summary() << "\n" << trainer.explain_memory();
        return 0;
      }
      // SIGINT, SIGTERM, SIGHUP end the run between steps, so that the
      // trainer's stores remove their files as they go; a second one ends
      // it at once.
      catch_stop_signals(/*die_on_again=*/true);
      trainer.run(&std::cout, [] { return g_stop_signal != 0; });
      done = trainer.steps_done();
    }
    if (const int sig = g_stop_signal; sig != 0 && done < cfg.steps) {  // else the run ended, and saved
      std::cout << std::flush;
      std::cerr << "remat-train: stopped by signal " << sig << " (" << strsignal(sig) << ") after step " << done
                << " of " << cfg.steps << "; nothing saved, and the offload files are removed.\n";
      return 128 + sig;
    }
  } catch (const remat::Error& e) {
    return fail(e.what());
  } catch (const c10::Error& e) {
    return fail(std::string("[torch] ") + e.what_without_backtrace());
  } catch (const std::exception& e) {
    std::cerr << "remat-train: internal error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
