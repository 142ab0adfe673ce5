// remat::parallel: process groups and DataParallel on c10d (Gloo on CPU).
// Multi-process tests spawn ddp_worker (one process per rank, a small GPT
// under each checkpoint strategy) and compare the parameters after K steps
// with one process training on the same data at world_size times the batch.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>
#include <torch/serialize.h>
#include <torch/utils.h>

#include <remat/auto.h>
#include <remat/checkpoint.h>
#include <remat/error.h>
#include <remat/models/gpt.h>
#include <remat/models/trainer.h>
#include <remat/parallel/data_parallel.h>
#include <remat/parallel/fully_shard.h>
#include <remat/parallel/pipeline.h>
#include <remat/sequential.h>

#include "fsdp_model.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;
using remat::parallel::DataParallel;
using remat::parallel::InitOptions;

/** A port nothing listens on right now (bound, read, closed). */
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

struct Proc {
  pid_t pid = -1;
  fs::path err;
  int status = -1;  // exit code, or 128 + signal; -1 still running
};

Proc spawn(const std::vector<std::string>& args, const fs::path& err) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 2, err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Proc p;
  p.err = err;
  const int rc = posix_spawn(&p.pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  EXPECT_EQ(rc, 0) << "posix_spawn " << args[0];
  return p;
}

/** Waits for every process until deadline; kills what is left (status -1). */
void wait_all(std::vector<Proc>& ps, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (auto& p : ps) {
    while (p.status == -1) {
      int st = 0;
      const pid_t r = ::waitpid(p.pid, &st, WNOHANG);
      if (r == p.pid) {
        p.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(p.pid, SIGKILL);
        ::waitpid(p.pid, &st, 0);
        break;  // status stays -1: it hung
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

class Dir {
 public:
  Dir() {
    path_ = fs::temp_directory_path() / ("remat_parallel_" + std::to_string(::getpid()) + "_" + std::to_string(n_++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~Dir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  static inline int n_ = 0;
};

/** Runs `world` ranks of ddp_worker; returns their statuses. */
std::vector<Proc> run_ranks(const Dir& dir, const std::string& tag, int world, std::vector<std::string> extra,
                            std::chrono::seconds limit = std::chrono::seconds(240)) {
  const std::string port = std::to_string(free_port());
  std::vector<Proc> ps;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args{REMAT_DDP_WORKER, "--rank", std::to_string(r), "--world", std::to_string(world),
                                  "--port",         port};
    args.insert(args.end(), extra.begin(), extra.end());
    if (r == 0) {
      args.push_back("--out");
      args.push_back((dir.path() / (tag + ".pt")).string());
    }
    ps.push_back(spawn(args, dir.path() / (tag + ".rank" + std::to_string(r) + ".err")));
  }
  wait_all(ps, limit);
  return ps;
}

std::vector<at::Tensor> load_params(const fs::path& p) {
  std::vector<at::Tensor> v;
  torch::load(v, p.string());
  return v;
}

double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  }
  return m;
}

/** 2 ranks at batch 2 against 1 rank at batch 4, same data and seed. */
void expect_two_ranks_equal_one(const std::string& strategy, std::vector<std::string> extra = {}) {
  Dir dir;
  // A FileStore per run (no port to collide with tests running beside it).
  std::vector<std::string> common{"--strategy", strategy, "--steps", "3"};
  common.insert(common.end(), extra.begin(), extra.end());
  auto two_args = common;
  two_args.insert(two_args.end(), {"--batch", "2"});
  auto one_args = common;
  one_args.insert(one_args.end(), {"--batch", "4"});
  two_args.insert(two_args.end(), {"--file-store", (dir.path() / "two.store").string()});
  one_args.insert(one_args.end(), {"--file-store", (dir.path() / "one.store").string()});
  auto two = run_ranks(dir, "two", 2, two_args);
  auto one = run_ranks(dir, "one", 1, one_args);
  for (const auto& p : two) ASSERT_EQ(p.status, 0) << read_file(p.err);
  ASSERT_EQ(one[0].status, 0) << read_file(one[0].err);
  const auto a = load_params(dir.path() / "two.pt");
  const auto b = load_params(dir.path() / "one.pt");
  const double d = max_abs_diff(a, b);
  EXPECT_LE(d, 1e-6) << strategy;
  // The last step's averaged gradients themselves, relative to their size:
  // a rank's gradient alone, or a sum instead of a mean, is off by O(1).
  const auto ga = load_params(dir.path() / "two.pt.grad");
  const auto gb = load_params(dir.path() / "one.pt.grad");
  double gmax = 0.0;
  for (const auto& g : gb) gmax = std::max(gmax, g.abs().max().item<double>());
  const double gd = max_abs_diff(ga, gb);
  EXPECT_GT(gmax, 0.0);
  EXPECT_LE(gd, 1e-5 * gmax) << strategy;
  std::istringstream stats(read_file(dir.path() / "two.pt.stats"));
  int64_t buckets = 0, bytes = 0;
  double allreduce_ms = 0, exposed_ms = 0, overlap = -1, rank_sum = 0;
  stats >> buckets >> bytes >> allreduce_ms >> exposed_ms >> overlap >> rank_sum;
  EXPECT_EQ(rank_sum, 3.0) << "ProcessGroup::all_reduce_sum of rank + 1 over 2 ranks (after a barrier)";
  int64_t param_bytes = 0;
  for (const auto& t : a) param_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  EXPECT_GE(buckets, 3) << "rebuilt after step 1 into 16-64 KiB buckets";
  EXPECT_EQ(bytes, param_bytes) << "every gradient reduced once in the last step";
  EXPECT_GT(allreduce_ms, 0.0);
  EXPECT_GE(overlap, 0.0);
  EXPECT_LE(overlap, 1.0);
  std::cout << "[" << strategy << "] 2 ranks vs 1: max |param diff| " << d << ", max |grad diff| " << gd
            << " (max |grad| " << gmax << "), last step " << buckets << " buckets, " << allreduce_ms
            << " ms all-reduce, " << exposed_ms << " ms exposed, overlap " << overlap << "\n";
}

TEST(DataParallelProcesses, TwoRanksEqualOneAtDoubleBatchPlain) { expect_two_ranks_equal_one("none"); }
TEST(DataParallelProcesses, TwoRanksEqualOneAtDoubleBatchPerBlock) { expect_two_ranks_equal_one("block"); }
TEST(DataParallelProcesses, TwoRanksEqualOneAtDoubleBatchSqrt) { expect_two_ranks_equal_one("sqrt"); }
TEST(DataParallelProcesses, TwoRanksEqualOneAtDoubleBatchSelective) { expect_two_ranks_equal_one("selective"); }
// CheckpointedSequential: its inner per-stage backwards hand each parameter
// gradient to AccumulateGrad early (NOTE [early delivery]); the Reducer's
// hooks must see every one exactly once (docs/parallel.md).
TEST(DataParallelProcesses, TwoRanksEqualOneAtDoubleBatchAuto) { expect_two_ranks_equal_one("auto"); }
// grad_accum 2: the first micro-batch's backward is not synchronised
// (no_sync); the second reduces the accumulated sum.
TEST(DataParallelProcesses, GradAccumulationSynchronisesOncePerStep) {
  expect_two_ranks_equal_one("block", {"--grad-accum", "2"});
}

TEST(DataParallelProcesses, TcpStoreRendezvous) {
  Dir dir;
  auto ps = run_ranks(dir, "tcp", 2, {"--steps", "1"});
  for (const auto& p : ps) EXPECT_EQ(p.status, 0) << read_file(p.err);
}

TEST(DataParallelProcesses, ARankThatDiesMidStepFailsTheOthersWithAClearError) {
  Dir dir;
  const auto t0 = std::chrono::steady_clock::now();
  // Rank 1 exits after its forward of step 2; rank 0 is then in backward's all-reduce.
  // A FileStore: no port that another process could take between free_port() and the ranks' start.
  auto ps = run_ranks(dir, "die", 2,
                      {"--steps", "3", "--die-at-step", "2", "--timeout-ms", "20000", "--file-store",
                       (dir.path() / "die.store").string()},
                      std::chrono::seconds(120));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(ps[1].status, 7);
  ASSERT_EQ(ps[0].status, 3) << "rank 0 must fail, not hang (-1) or succeed; stderr: " << read_file(ps[0].err);
  const std::string err = read_file(ps[0].err);
  EXPECT_NE(err.find("[remat::parallel] rank 0 of 2: the all-reduce of gradient bucket"), std::string::npos) << err;
  EXPECT_NE(err.find("A peer process probably exited or stopped answering"), std::string::npos) << err;
  EXPECT_LT(s, 60.0) << "within the 20 s timeout plus start-up";
}

// --- ddp_worker --model mlp: a frozen layer and a branch taken on some steps

/** Runs `world` ranks of the MLP worker (global batch 4, SGD), each writing
 *  PREFIX.rankR{.own,.init,} under dir; returns their statuses. */
std::vector<Proc> run_mlp(const Dir& dir, const std::string& tag, int world, std::vector<std::string> extra) {
  std::vector<Proc> ps;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args{REMAT_DDP_WORKER,
                                  "--model",
                                  "mlp",
                                  "--rank",
                                  std::to_string(r),
                                  "--world",
                                  std::to_string(world),
                                  "--batch",
                                  std::to_string(4 / world),
                                  "--file-store",
                                  (dir.path() / (tag + ".store")).string(),
                                  "--timeout-ms",
                                  "30000",
                                  "--out",
                                  (dir.path() / tag).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    ps.push_back(spawn(args, dir.path() / (tag + ".rank" + std::to_string(r) + ".err")));
  }
  wait_all(ps, std::chrono::seconds(60));
  return ps;
}

bool bitwise_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

// The MLP's parameters() order: frozen.weight, frozen.bias, trunk.*, head.*, extra.*.
constexpr size_t kFrozenWeight = 0, kExtraWeight = 6;

// find_unused_parameters exists for a forward that leaves some parameters
// out on some steps. Here `extra` is used on steps 0, 2, 4 only, so the set
// of unused parameters changes every step (c10d's Reducer then logs through
// the c10d::Logger it must have been given: without one both ranks crashed).
TEST(DataParallelProcesses, FindUnusedParametersWithABranchTakenOnSomeSteps) {
  Dir dir;
  const std::vector<std::string> args{"--steps", "5", "--branch-every", "2", "--find-unused"};
  auto two = run_mlp(dir, "two", 2, args);
  auto one = run_mlp(dir, "one", 1, args);
  for (const auto& p : two) ASSERT_EQ(p.status, 0) << read_file(p.err);
  ASSERT_EQ(one[0].status, 0) << read_file(one[0].err);
  const auto r0 = load_params(dir.path() / "two.rank0"), r1 = load_params(dir.path() / "two.rank1");
  const auto ref = load_params(dir.path() / "one.rank0"), init = load_params(dir.path() / "one.rank0.init");
  const double d0 = max_abs_diff(r0, ref), d1 = max_abs_diff(r1, ref);
  EXPECT_LE(d0, 1e-6);
  EXPECT_LE(d1, 1e-6);
  EXPECT_GT(max_abs_diff(ref, init), 1e-3) << "five SGD steps at lr 0.1 moved the parameters";
  EXPECT_GT((ref[kExtraWeight] - init[kExtraWeight]).abs().max().item<double>(), 1e-3) << "the branch trained";
  EXPECT_TRUE(torch::equal(ref[kFrozenWeight], init[kFrozenWeight])) << "frozen stays frozen";
  std::cout << "find_unused_parameters, unused set changing each step: 2 ranks vs 1 after 5 steps, max |param diff| "
            << d0 << " (rank 0), " << d1 << " (rank 1)\n";
}

/** The MLP worker with args on 2 ranks and on 1: rank 0's parameters
 *  within 1e-6 of the single process's, which moved. */
void expect_two_mlp_ranks_equal_one(const std::vector<std::string>& args) {
  Dir dir;
  auto two = run_mlp(dir, "two", 2, args);
  auto one = run_mlp(dir, "one", 1, args);
  for (const auto& p : two) ASSERT_EQ(p.status, 0) << read_file(p.err);
  ASSERT_EQ(one[0].status, 0) << read_file(one[0].err);
  const auto r0 = load_params(dir.path() / "two.rank0"), ref = load_params(dir.path() / "one.rank0");
  EXPECT_LE(max_abs_diff(r0, ref), 1e-6);
  EXPECT_GT(max_abs_diff(ref, load_params(dir.path() / "one.rank0.init")), 1e-3);
}

// With a StepInBackward, DataParallel's parameters are left to the
// optimizer's step() (the Reducer averages at the end of backward): the
// worker checks that, and the result is as without it (SGD with momentum).
TEST(DataParallelProcesses, AStepInBackwardLeavesTheAveragedGradientsToTheOptimizer) {
  expect_two_mlp_ranks_equal_one({"--steps", "3", "--step-in-backward"});
}

// An evaluation through DataParallel::forward under NoGradGuard between
// steps: nothing is armed for a backward that never comes, and training
// goes on as one process's. It armed the Reducer, and the next step's
// forward threw c10d's "`initialize_buckets` must NOT be called during
// autograd execution" on every rank.
TEST(DataParallelProcesses, AnEvaluationUnderNoGradThroughForwardLeavesTrainingAsOneProcess) {
  expect_two_mlp_ranks_equal_one({"--steps", "3", "--eval"});
}

// Python's DDP broadcasts every parameter, frozen ones included, and the
// buffers: a frozen parameter gets no gradient, so nothing else would make
// the ranks agree.
TEST(DataParallelProcesses, FrozenParametersAreBroadcastFromRankZero) {
  Dir dir;
  auto two = run_mlp(dir, "two", 2, {"--steps", "3", "--seed-by-rank"});
  auto one = run_mlp(dir, "one", 1, {"--steps", "3"});
  for (const auto& p : two) ASSERT_EQ(p.status, 0) << read_file(p.err);
  ASSERT_EQ(one[0].status, 0) << read_file(one[0].err);
  const auto own0 = load_params(dir.path() / "two.rank0.own"), own1 = load_params(dir.path() / "two.rank1.own");
  ASSERT_FALSE(torch::equal(own0[kFrozenWeight], own1[kFrozenWeight])) << "the ranks start from different seeds";
  EXPECT_TRUE(bitwise_equal(own0, load_params(dir.path() / "one.rank0.own"))) << "rank 0 seeds as 1 process";
  for (const char* rank : {"two.rank0.init", "two.rank1.init"}) {
    const auto got = load_params(dir.path() / rank);
    EXPECT_TRUE(torch::equal(got[kFrozenWeight], own0[kFrozenWeight])) << rank << ": rank 0's frozen weight";
    EXPECT_TRUE(bitwise_equal(got, own0)) << rank << ": rank 0's parameters, every one";
  }
  const auto ref = load_params(dir.path() / "one.rank0");
  const double d0 = max_abs_diff(load_params(dir.path() / "two.rank0"), ref);
  const double d1 = max_abs_diff(load_params(dir.path() / "two.rank1"), ref);
  EXPECT_LE(d0, 1e-6);
  EXPECT_LE(d1, 1e-6);
  std::cout << "frozen layer, ranks seeded apart: 2 ranks vs 1 after 3 steps, max |param diff| " << d0 << " (rank 0), "
            << d1 << " (rank 1)\n";
}

// --- remat-train --nproc ----------------------------------------------------

/** Runs remat-train with args; returns (exit code, stdout + stderr). */
std::pair<int, std::string> train(const Dir& dir, const std::string& args) {
  const std::string out = (dir.path() / "train.out").string();
  const int st = std::system((std::string(REMAT_TRAIN_EXE) + " " + args + " >" + out + " 2>&1").c_str());
  return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, read_file(out)};
}

std::vector<at::Tensor> trained_params(const remat::models::TrainConfig& base, const fs::path& checkpoint) {
  auto c = base;
  c.resume_path = checkpoint.string();
  remat::models::Trainer t(c);
  std::vector<at::Tensor> v;
  for (const auto& p : t.module()->parameters()) v.push_back(p.detach().clone());
  return v;
}

/** The TrainConfig of the remat-train runs below (--layers 2 --d-model 32
 *  --heads 2 --seq-len 32 --optimizer sgd --threads 1). */
remat::models::TrainConfig small_sgd_gpt() {
  remat::models::TrainConfig c;
  c.layers = 2;
  c.d_model = 32;
  c.heads = 2;
  c.seq_len = 32;
  c.optimizer = "sgd";
  c.threads = 1;
  return c;
}

TEST(RematTrainNproc, TwoRanksTrainAsOneAtDoubleBatch) {
  Dir dir;
  const std::string model =
      " --layers 2 --d-model 32 --heads 2 --seq-len 32 --steps 3 --optimizer sgd --lr 0.05"
      " --checkpoint sqrt --threads 1";
  auto [rc2, out2] = train(dir, "--nproc 2 --master-port " + std::to_string(free_port()) + " --batch 2" + model +
                                    " --save " + (dir.path() / "two.pt").string());
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("data parallel over 2 processes (Gloo), global batch 4"), std::string::npos) << out2;
  for (const char* line : {"[rank 0/2] step 3/3", "[rank 1/2] step 3/3", "[rank 0/2] saved step 3 to "}) {
    EXPECT_NE(out2.find(line), std::string::npos) << line << "\n" << out2;
  }
  EXPECT_NE(out2.find(" tok/s "), std::string::npos) << "per-rank throughput";
  EXPECT_NE(out2.find("all-reduce "), std::string::npos) << out2;
  EXPECT_EQ(out2.find("[rank 1/2] saved"), std::string::npos) << "only rank 0 saves";
  auto [rc1, out1] = train(dir, "--batch 4" + model + " --save " + (dir.path() / "one.pt").string());
  ASSERT_EQ(rc1, 0) << out1;
  const remat::models::TrainConfig c = small_sgd_gpt();
  const auto two = trained_params(c, dir.path() / "two.pt");
  const auto one = trained_params(c, dir.path() / "one.pt");
  remat::models::Trainer fresh(c);
  std::vector<at::Tensor> init;
  for (const auto& p : fresh.module()->parameters()) init.push_back(p.detach());
  EXPECT_LE(max_abs_diff(two, one), 1e-6);
  EXPECT_GT(max_abs_diff(one, init), 1e-4) << "three SGD steps at lr 0.05 moved the parameters";
}

// --shard: FullyShard over the blocks, the optimizer on the shards, the
// norm clipped over both ranks; --save writes the full model.
TEST(RematTrainNproc, ShardedTwoRanksTrainAsOneAtDoubleBatch) {
  Dir dir;
  const std::string model =
      " --layers 2 --d-model 32 --heads 2 --seq-len 32 --steps 3 --optimizer sgd --lr 0.05"
      " --checkpoint block --clip-norm 0.05 --threads 1";
  auto [rc2, out2] = train(dir, "--nproc 2 --shard --master-port " + std::to_string(free_port()) + " --batch 2" +
                                    model + " --save " + (dir.path() / "two.pt").string());
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_NE(out2.find("sharded data parallel over 2 processes (Gloo), 2 units + root, global batch 4"),
            std::string::npos)
      << out2;
  for (const char* line : {"[rank 0/2] step 3/3", "[rank 1/2] step 3/3", "[rank 0/2] saved the full model (step 3)",
                           "held: params ", "all-gather ", "(5), reduce-scatter "}) {
    EXPECT_NE(out2.find(line), std::string::npos) << line << "\n" << out2;
  }
  auto [rc1, out1] = train(dir, "--batch 4" + model + " --save " + (dir.path() / "one.pt").string());
  ASSERT_EQ(rc1, 0) << out1;
  const remat::models::TrainConfig c = small_sgd_gpt();
  const auto one = trained_params(c, dir.path() / "one.pt");
  remat::models::Trainer sharded(c);
  std::vector<at::Tensor> init, two;
  for (const auto& p : sharded.module()->parameters()) init.push_back(p.detach().clone());
  torch::serialize::InputArchive archive;
  archive.load_from((dir.path() / "two.pt").string());
  sharded.module()->load(archive);
  for (const auto& p : sharded.module()->parameters()) two.push_back(p.detach().clone());
  EXPECT_LE(max_abs_diff(two, one), 1e-6);
  EXPECT_GT(max_abs_diff(one, init), 1e-4) << "three SGD steps at lr 0.05 moved the parameters";
}

// The held line counts the optimizer state where it is: an int8 store's
// encoding stays in memory (it said "optimizer 0 B" while it held it).
TEST(RematTrainNproc, ShardedStateInAStoreIsShownWhereItIs) {
  Dir dir;
  auto [rc, out] = train(dir, "--nproc 2 --shard --master-port " + std::to_string(free_port()) +
                                  " --batch 2 --layers 2 --d-model 32 --heads 2 --seq-len 32 --steps 2 --threads 1"
                                  " --optimizer-in-backward --optimizer-state int8");
  ASSERT_EQ(rc, 0) << out;
  const auto at = out.find("[rank 0/2] step 2/2");
  ASSERT_NE(at, std::string::npos) << out;
  const std::string line = out.substr(at, out.find('\n', at) - at);
  EXPECT_NE(line.find(" (int8-encoded, "), std::string::npos) << line;
  EXPECT_NE(line.find(" less than float32)"), std::string::npos) << line;
  EXPECT_EQ(line.find("optimizer 0 B"), std::string::npos) << "the encoding is in memory: " << line;
}

TEST(RematTrainNproc, BadFlagsAreClearErrors) {
  Dir dir;
  {
    auto [rc, out] = train(dir, "--shard --steps 1");
    EXPECT_EQ(rc, 2);
    EXPECT_EQ(out,
              "remat-train: error: [remat::train] --shard shards across processes: add --nproc N (or --rank and "
              "--world-size).\n");
    std::tie(rc, out) = train(dir, "--shard --rank 0 --world-size 1 --resume nowhere.pt --steps 1");
    EXPECT_EQ(rc, 2);
    EXPECT_EQ(out,
              "remat-train: error: [remat::train] --resume does not combine with --shard: a sharded run's --save "
              "writes the model's weights only, not the optimizer's state and step count a resume needs. Resume a "
              "checkpoint that --save wrote without --shard (and train on without --shard), or start the sharded "
              "run afresh.\n");
  }
  {
    // Data parallel leaves every update to step(): a state store there would
    // say it held the state and hold nothing (an int8 store, nothing lossy).
    auto [rc, out] = train(dir, "--nproc 2 --optimizer-in-backward --optimizer-state int8 --steps 1");
    EXPECT_EQ(rc, 2);
    EXPECT_EQ(out,
              "remat-train: error: [remat::train] --optimizer-state int8 with data parallel ranks that are not "
              "sharded: DataParallel averages the gradients at the end of backward, so every update is left to the "
              "optimizer's step() after it and the state never leaves the optimizer. Add --shard (each rank updates "
              "and stores the state of its shard), or drop --optimizer-state.\n");
  }
  auto [rc, out] = train(dir, "--nproc 2 --master-port 70000 --steps 1");
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(out,
            "remat-train: error: [remat::parallel] master_port 70000 is not a TCP port; pick one in 1..65535 that is "
            "free on the master (e.g. 29500).\n");
  std::tie(rc, out) = train(dir, "--nproc 2 --rank 0 --world-size 2 --steps 1");
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(out,
            "remat-train: error: [remat::train] give --nproc (ranks started here) or --rank with --world-size (one "
            "rank, started by you), not both.\n");
  const int port = free_port();
  std::tie(rc, out) = train(dir, "--rank 1 --world-size 2 --master-port " + std::to_string(port) +
                                     " --dist-timeout 2 --steps 1 --layers 1 --d-model 16 --heads 2 --seq-len 16");
  EXPECT_EQ(rc, 2);
  const std::string want =
      "remat-train: error: [remat::parallel] rank 1 could not reach the TCPStore at 127.0.0.1:" + std::to_string(port) +
      " within 2.0 s: ";
  EXPECT_NE(out.find(want), std::string::npos) << out;
}

// A rank's flag error prints once, from the launcher, before any rank starts.
TEST(RematTrainNproc, ConfigErrorsPrintOnceBeforeRanksStart) {
  Dir dir;
  auto [rc, out] = train(dir, "--nproc 2 --batch 0 --steps 1");
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(out, "remat-train: error: [remat::train] --batch must be positive, got 0.\n");
  std::tie(rc, out) = train(dir, "--nproc 2 --steps 1 --seq-len 100000000");
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(out.rfind("remat-train: error: [remat::train] --data file '", 0), 0u) << out;
  EXPECT_NE(out.find(" bytes, fewer than seq_len + 2 = 100000002. Use a longer text or a smaller --seq-len.\n"),
            std::string::npos)
      << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 1) << "once, not per rank:\n" << out;
  std::tie(rc, out) = train(dir, "--nproc 2 --steps 1 --save /nonexistent/folder/model.pt");
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(out,
            "remat-train: error: [remat::train] --save '/nonexistent/folder/model.pt': the folder "
            "'/nonexistent/folder' does not exist (checked before training, so that no run is lost). Create it "
            "(mkdir -p /nonexistent/folder) or save elsewhere.\n");
  std::tie(rc, out) = train(dir, "--nproc 2 --shard --resume nowhere.pt --steps 1");
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(out,
            "remat-train: error: [remat::train] --resume does not combine with --shard: a sharded run's --save "
            "writes the model's weights only, not the optimizer's state and step count a resume needs. Resume a "
            "checkpoint that --save wrote without --shard (and train on without --shard), or start the sharded "
            "run afresh.\n");
}

/** A socket listening on a port of this machine (any address) while alive;
 *  port() is -1 when `want` could not be bound. */
class Listener {
 public:
  explicit Listener(int want = 0) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(want));
    socklen_t len = sizeof a;
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::listen(fd_, 4) == 0 &&
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
      port_ = ntohs(a.sin_port);
    }
  }
  ~Listener() { ::close(fd_); }
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = -1;
};

// An explicit --master-port that another process holds: one line, at once
// (not c10d's stack traces after --dist-timeout).
TEST(RematTrainNproc, BusyExplicitPortFailsAtOnceInOneLine) {
  Dir dir;
  Listener busy;
  ASSERT_GT(busy.port(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto [rc, out] = train(dir, "--nproc 2 --steps 1 --layers 1 --d-model 16 --heads 2 --seq-len 16 --master-port " +
                                  std::to_string(busy.port()));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(rc, 2) << out;
  EXPECT_EQ(out, "remat-train: error: [remat::train] --master-port " + std::to_string(busy.port()) +
                     " is in use on this machine (another process listens there). Pick another, or leave "
                     "--master-port out for a free one.\n");
  EXPECT_LT(s, 10.0) << "refused before any rank started";
  std::cout << "busy --master-port refused in " << s << " s\n";
}

// Without --master-port the launcher picks a free port: a run succeeds while
// 29500 (the old fixed default) is held.
TEST(RematTrainNproc, DefaultPortIsAFreeOne) {
  Dir dir;
  Listener held(29500);  // -1 when another process holds it already: busy either way
  auto [rc, out] =
      train(dir, "--nproc 2 --steps 1 --layers 1 --d-model 16 --heads 2 --seq-len 16 --batch 2 --threads 1");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("[rank 1/2] step 1/1"), std::string::npos) << out;
}

namespace {

/** The processes whose parent is `parent` (from /proc). */
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent) out.push_back(static_cast<pid_t>(std::stoi(name)));
  }
  return out;
}

/** True while pid runs (not gone, not a zombie). */
bool alive(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

/** Starts remat-train --nproc 2 on a long run, waits until both ranks
 *  train, sends the launcher sig; returns (launcher's wait status, ranks
 *  still alive 10 s later). */
std::pair<int, std::vector<pid_t>> stop_launcher_with(const Dir& dir, int sig) {
  const std::string out = (dir.path() / ("launcher" + std::to_string(sig) + ".out")).string();
  const std::string cmd = std::string("exec ") + REMAT_TRAIN_EXE +
                          " --nproc 2 --steps 100000 --layers 1 --d-model 16 --heads 2 --seq-len 16 --batch 2"
                          " --threads 1 >" +
                          out + " 2>&1";
  const pid_t launcher = ::fork();
  if (launcher == 0) {
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  std::vector<pid_t> ranks;
  for (int i = 0; i < 600; ++i) {  // up to 60 s for both ranks to print a step
    ranks = children_of(launcher);
    const std::string text = read_file(out);
    if (ranks.size() == 2 && text.find("[rank 0/2] step") != std::string::npos &&
        text.find("[rank 1/2] step") != std::string::npos) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(ranks.size(), 2u) << read_file(out);
  ::kill(launcher, sig);
  int status = 0;
  ::waitpid(launcher, &status, 0);
  std::vector<pid_t> left = ranks;
  for (int i = 0; i < 100 && !left.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    left.erase(std::remove_if(left.begin(), left.end(), [](pid_t p) { return !alive(p); }), left.end());
  }
  for (pid_t p : left) ::kill(p, SIGKILL);  // do not leave them running when the test fails
  return {status, left};
}

}  // namespace

// Killing the launcher takes its ranks down: SIGKILL (the ranks' parent-death
// signal) and SIGTERM (forwarded, then the launcher exits 128 + 15).
TEST(RematTrainNproc, StoppingTheLauncherStopsItsRanks) {
  Dir dir;
  {
    const auto [status, left] = stop_launcher_with(dir, SIGKILL);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    EXPECT_TRUE(left.empty()) << left.size() << " rank(s) outlived a launcher killed with SIGKILL";
  }
  {
    const auto [status, left] = stop_launcher_with(dir, SIGTERM);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << status;
    EXPECT_TRUE(left.empty()) << left.size() << " rank(s) outlived a launcher stopped with SIGTERM";
    EXPECT_NE(read_file(dir.path() / ("launcher" + std::to_string(SIGTERM) + ".out"))
                  .find("remat-train: stopped by signal 15 (Terminated); the ranks were stopped too"),
              std::string::npos);
  }
}

// --- In-process: one rank, errors -----------------------------------------

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const remat::Error& e) {
    return e.what();
  }
  return "(no remat::Error)";
}

TEST(ProcessGroup, BadValuesAreClearErrors) {
  EXPECT_EQ(message_of([] { remat::parallel::init_process_group(InitOptions(0, 1).master_port(70000)); }),
            "[remat::parallel] master_port 70000 is not a TCP port; pick one in 1..65535 that is free on the master "
            "(e.g. 29500).");
  EXPECT_EQ(message_of([] { remat::parallel::init_process_group(InitOptions(2, 2)); }),
            "[remat::parallel] rank 2 is outside [0, 2): give each of the world_size processes its own rank.");
  EXPECT_EQ(message_of([] { remat::parallel::init_process_group(InitOptions(0, 0)); }),
            "[remat::parallel] world_size 0 must be at least 1 (the number of processes).");
  EXPECT_EQ(
      message_of([] { remat::parallel::init_process_group(InitOptions(0, 1).timeout(std::chrono::milliseconds(0))); }),
      "[remat::parallel] timeout 0 ms must be positive (the default is 300 s).");
}

TEST(ProcessGroup, AnUnreachableStoreIsAClearErrorWithinTheTimeout) {
  const int port = free_port();
  const auto t0 = std::chrono::steady_clock::now();
  const std::string m = message_of([&] {
    remat::parallel::init_process_group(InitOptions(1, 2).master_port(port).timeout(std::chrono::milliseconds(2000)));
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string want =
      "[remat::parallel] rank 1 could not reach the TCPStore at 127.0.0.1:" + std::to_string(port) + " within 2.0 s: ";
  EXPECT_EQ(m.substr(0, want.size()), want) << m;
  EXPECT_NE(m.find("Check that rank 0 runs and that master_addr and master_port (--master-addr, --master-port) are "
                   "the same on every rank."),
            std::string::npos)
      << m;
  EXPECT_LT(s, 15.0);
}

TEST(ProcessGroup, APortInUseIsAClearError) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::listen(fd, 1), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  const std::string m = message_of([&] {
    remat::parallel::init_process_group(InitOptions(0, 1).master_port(port).timeout(std::chrono::milliseconds(2000)));
  });
  ::close(fd);
  const std::string want = "[remat::parallel] rank 0 could not serve the TCPStore on 127.0.0.1:" + std::to_string(port);
  EXPECT_EQ(m.substr(0, want.size()), want) << m;
  EXPECT_NE(m.find("Pick a free master_port (--master-port)"), std::string::npos) << m;
}

torch::nn::Sequential mlp() {
  torch::manual_seed(3);
  return torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::GELU(), torch::nn::Linear(32, 32),
                               torch::nn::GELU(), torch::nn::Linear(32, 32), torch::nn::GELU(),
                               torch::nn::Linear(32, 4));
}

// One rank: DataParallel divides by 1 and copies back, so gradients are
// bitwise those of a plain run, with CheckpointedSequential's early delivery
// (.grad allocated) as well, over several steps.
TEST(DataParallel, OneRankGivesBitwiseThePlainGradients) {
  Dir dir;
  auto group = remat::parallel::init_process_group(
      InitOptions(0, 1).file_store((dir.path() / "store").string()).timeout(std::chrono::milliseconds(10000)));
  EXPECT_EQ(group.rank(), 0);
  EXPECT_EQ(group.world_size(), 1);
  auto plain = mlp();
  auto seq = mlp();
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().segments(2));
  DataParallel ddp(seq.ptr(), group);
  torch::manual_seed(5);
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({8, 16});
    plain->forward(x).pow(2).sum().backward();
    auto loss = ddp.forward([&] { return net->forward(x).pow(2).sum(); });
    loss.backward();
    const auto pp = plain->parameters(), qp = seq->parameters();
    for (size_t i = 0; i < pp.size(); ++i) {
      ASSERT_TRUE(qp[i].grad().defined());
      EXPECT_TRUE(torch::equal(pp[i].grad(), qp[i].grad())) << "step " << step << " parameter " << i;
    }
    const auto s = ddp.last_stats();
    EXPECT_EQ(s.buckets, step == 0 ? 1 : s.buckets);
    EXPECT_GE(s.buckets, 1);
  }
}

TEST(DataParallel, BadModulesAreClearErrors) {
  Dir dir;
  auto group = remat::parallel::init_process_group(
      InitOptions(0, 1).file_store((dir.path() / "store").string()).timeout(std::chrono::milliseconds(10000)));
  auto frozen = torch::nn::Linear(4, 4);
  for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  EXPECT_EQ(message_of([&] { DataParallel d(frozen.ptr(), group); }),
            "[remat::parallel] the module has no parameter that requires grad: nothing to synchronise.");
  EXPECT_EQ(message_of([&] { DataParallel d(frozen.ptr(), remat::parallel::ProcessGroup()); }),
            "[remat::parallel] DataParallel got a ProcessGroup that was not joined; use init_process_group().");
  EXPECT_EQ(message_of([&] {
              DataParallel d(torch::nn::Linear(4, 4).ptr(), group,
                             remat::parallel::DataParallelOptions().bucket_cap_bytes(0));
            }),
            "[remat::parallel] bucket_cap_bytes 0 and first_bucket_cap_bytes 1048576 must be positive (the defaults "
            "are 25 MiB and 1 MiB).");
}

// --- FullyShard: sharded data parallel ------------------------------------

/** The GPT fsdp_worker trains (4 blocks of d_model 64), as initialised. */
remat::models::Gpt worker_gpt() { return worker::fsdp_gpt(); }

std::vector<at::Tensor> loaded_params(const fs::path& p) {
  auto gpt = worker_gpt();
  torch::load(gpt, p.string());
  std::vector<at::Tensor> v;
  for (const auto& t : gpt->parameters()) v.push_back(t.detach().clone());
  return v;
}

/** One line of fsdp_worker's figures (see its header). */
struct FsdpStats {
  int64_t forward_allgathers = -1, backward_allgathers = -1, reduce_scatters = -1, state_bytes = -1, max_gathered = -1,
          largest_unit = -1, root_bytes = -1, units = -1;
  double norm = -1;
  int by_allreduce = -1;
};

FsdpStats read_stats(const fs::path& p) {
  FsdpStats s;
  std::istringstream in(read_file(p));
  in >> s.forward_allgathers >> s.backward_allgathers >> s.reduce_scatters >> s.state_bytes >> s.max_gathered >>
      s.largest_unit >> s.root_bytes >> s.units >> s.norm >> s.by_allreduce;
  return s;
}

/** Runs `world` ranks of worker `exe` over a FileStore in dir, each with
 *  --out dir/OUT and its stderr in TAG.rankR.err; waits for all. */
std::vector<Proc> run_workers(const char* exe, const Dir& dir, const std::string& tag, const std::string& out,
                              int world, const std::vector<std::string>& extra, std::chrono::seconds limit) {
  std::vector<Proc> ps;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args{exe,
                                  "--rank",
                                  std::to_string(r),
                                  "--world",
                                  std::to_string(world),
                                  "--file-store",
                                  (dir.path() / (tag + ".store")).string(),
                                  "--out",
                                  (dir.path() / out).string()};
    args.insert(args.end(), extra.begin(), extra.end());
    ps.push_back(spawn(args, dir.path() / (tag + ".rank" + std::to_string(r) + ".err")));
  }
  wait_all(ps, limit);
  return ps;
}

/** Runs fsdp_worker on `world` ranks (--plain: one process, no FullyShard),
 *  each writing TAG.pt.rankR.stats; rank 0 the full model to TAG.pt. */
std::vector<Proc> run_fsdp(const Dir& dir, const std::string& tag, int world, std::vector<std::string> extra,
                           std::chrono::seconds limit = std::chrono::seconds(240)) {
  return run_workers(REMAT_FSDP_WORKER, dir, tag, tag + ".pt", world, extra, limit);
}

/** `world` sharded ranks at batch 4 / world against one plain process at
 *  batch 4 (same data, AdamW): parameters after the steps within 1e-6. */
void expect_sharded_equals_plain(int world, const std::string& strategy, std::vector<std::string> extra = {},
                                 const std::vector<std::string>& sharded_only = {}) {
  Dir dir;
  std::vector<std::string> common{"--strategy", strategy, "--steps", "3"};
  common.insert(common.end(), extra.begin(), extra.end());
  auto sharded_args = common;
  sharded_args.insert(sharded_args.end(), sharded_only.begin(), sharded_only.end());
  sharded_args.insert(sharded_args.end(), {"--batch", std::to_string(4 / world)});
  auto plain_args = common;
  plain_args.insert(plain_args.end(), {"--batch", "4", "--plain"});
  auto sharded = run_fsdp(dir, "sharded", world, sharded_args);
  auto plain = run_fsdp(dir, "plain", 1, plain_args);
  for (const auto& p : sharded) ASSERT_EQ(p.status, 0) << read_file(p.err);
  ASSERT_EQ(plain[0].status, 0) << read_file(plain[0].err);
  const auto a = loaded_params(dir.path() / "sharded.pt");
  const auto b = loaded_params(dir.path() / "plain.pt");
  auto init_gpt = worker_gpt();
  std::vector<at::Tensor> init;
  for (const auto& t : init_gpt->parameters()) init.push_back(t.detach());
  const double d = max_abs_diff(a, b);
  EXPECT_LE(d, 1e-6) << world << " ranks, " << strategy;
  EXPECT_GT(max_abs_diff(b, init), 1e-3) << "three AdamW steps at lr 1e-2 moved the parameters";
  if (std::find(extra.begin(), extra.end(), "--freeze") != extra.end()) {  // frozen layers never move
    auto back = worker_gpt(), fresh = worker_gpt();
    torch::load(back, (dir.path() / "sharded.pt").string());
    const auto bp = back->named_parameters(), fp = fresh->named_parameters();
    int frozen = 0;
    for (size_t i = 0; i < bp.size(); ++i) {
      if (bp[i].key().find(".attn.qkv.") == std::string::npos && bp[i].key().find(".mlp.fc.") == std::string::npos)
        continue;
      ++frozen;
      EXPECT_TRUE(torch::equal(bp[i].value(), fp[i].value())) << bp[i].key() << " is frozen and moved";
    }
    EXPECT_EQ(frozen, 16);  // 4 blocks x (qkv, fc) x (weight, bias)
  }
  {  // The full model save_full wrote, loaded into a plain model, gives the plain run's loss.
    auto sharded_gpt = worker_gpt(), plain_gpt = worker_gpt();
    torch::load(sharded_gpt, (dir.path() / "sharded.pt").string());
    torch::load(plain_gpt, (dir.path() / "plain.pt").string());
    torch::NoGradGuard no_grad;
    auto tok = torch::randint(64, {4, 33}, torch::kLong);
    auto x = tok.slice(1, 0, 32), y = tok.slice(1, 1, 33);
    const double ls = sharded_gpt->loss(sharded_gpt->blocks->forward(sharded_gpt->embed(x)), y).item<double>();
    const double lp = plain_gpt->loss(plain_gpt->blocks->forward(plain_gpt->embed(x)), y).item<double>();
    EXPECT_NEAR(ls, lp, 1e-5) << world << " ranks, " << strategy;
  }
  const auto s = read_stats(dir.path() / "sharded.pt.rank0.stats");
  const auto p = read_stats(dir.path() / "plain.pt.rank0.stats");
  std::cout << "[" << strategy << "] " << world << " ranks vs 1: max |param diff| " << d << "; last step "
            << s.forward_allgathers << " forward and " << s.backward_allgathers << " backward all-gathers, "
            << s.reduce_scatters << " reduce-scatters over " << s.units << " units + root; model state "
            << s.state_bytes << " B against " << p.state_bytes << " B plain; at most " << s.max_gathered
            << " B gathered; norm " << s.norm << " (plain " << p.norm << ")\n";
  EXPECT_EQ(s.by_allreduce, 0) << "Gloo here has reduce-scatter";
}

TEST(FullyShardProcesses, TwoRanksEqualOnePlain) { expect_sharded_equals_plain(2, "none"); }
TEST(FullyShardProcesses, TwoRanksEqualOnePerBlock) { expect_sharded_equals_plain(2, "block"); }
TEST(FullyShardProcesses, TwoRanksEqualOneSelective) { expect_sharded_equals_plain(2, "selective"); }
// Units inside units: the blocks, their attention and MLP each a unit, the
// attention and MLP checkpointed inside them.
TEST(FullyShardProcesses, TwoRanksEqualOneNestedUnits) { expect_sharded_equals_plain(2, "inner", {"--units", "all"}); }
// auto_checkpoint plans the whole step of each rank (blocks as units).
TEST(FullyShardProcesses, TwoRanksEqualOneAuto) { expect_sharded_equals_plain(2, "auto"); }
// The blocks as stages of a CheckpointedSequential, whose stage backwards
// run inside the outer backward.
TEST(FullyShardProcesses, TwoRanksEqualOneChain) { expect_sharded_equals_plain(2, "chain"); }
// Each shard updated inside backward once its reduce-scatter is done
// (remat::StepInBackward), against one plain process stepping after backward.
TEST(FullyShardProcesses, TwoRanksUpdatingInBackwardEqualOnePlain) {
  expect_sharded_equals_plain(2, "block", {}, {"--step-in-backward"});
}
// The same with the updates held for the backward's end: a shard's update
// runs as its reduction completes, in the end of backward, also when that
// end comes in a nested graph task (the blocks as a chain's stages).
TEST(FullyShardProcesses, TwoRanksUpdatingAtTheBackwardsEndEqualOnePlain) {
  expect_sharded_equals_plain(2, "block", {}, {"--step-in-backward", "--at-end"});
  expect_sharded_equals_plain(2, "chain", {}, {"--step-in-backward", "--at-end"});
}
TEST(FullyShardProcesses, TwoRanksEqualOneOffloadToDisk) {
  Dir scratch;
  expect_sharded_equals_plain(2, "offload", {"--offload-dir", scratch.path().string()});
}
// Units of frozen and trainable layers, and an evaluation forward between
// each backward and the optimizer's step: as one process, frozen layers fixed.
TEST(FullyShardProcesses, TwoRanksEqualOneWithFrozenLayersAndEvaluations) {
  expect_sharded_equals_plain(2, "block", {"--freeze", "--eval"});
}
// A block no rank uses on some steps gets no gradient then, as plainly:
// AdamW leaves it where it is. It was reduced as zeros, and the zero
// gradient moved it (weight decay, moments).
TEST(FullyShardProcesses, ABlockNoRankUsesOnAStepIsLeftAsPlain) {
  expect_sharded_equals_plain(2, "none", {"--skip-last-block-every", "2"});
  expect_sharded_equals_plain(2, "block", {"--skip-last-block-every", "2"}, {"--step-in-backward"});
}
// NOTE [stale gathered values] at two ranks: an evaluation with gradient
// (graph dropped) leaves the root and every unit gathered (no reshard after
// forward); SGD then steps through p.data(), which leaves the shards'
// versions as they were. Each rank compares what it holds with its shards
// and one all-reduce decides: the next step gathers again, as one process.
TEST(FullyShardProcesses, TwoRanksWithSgdAndAnEvaluationWithGradientEqualOne) {
  expect_sharded_equals_plain(2, "none", {"--sgd", "--eval-grad"}, {"--no-reshard"});
}
TEST(FullyShardProcesses, FourRanksEqualOnePerBlock) { expect_sharded_equals_plain(4, "block"); }
TEST(FullyShardProcesses, FourRanksEqualOneNestedUnitsCheckpointed) {
  expect_sharded_equals_plain(4, "block", {"--units", "all"});
}

TEST(FullyShardProcesses, FourRanksEqualOneSelective) { expect_sharded_equals_plain(4, "selective"); }
TEST(FullyShardProcesses, FourRanksEqualOneAuto) { expect_sharded_equals_plain(4, "auto"); }

/** Two micro-batches per step, and the global norm clipped over the
 *  shards: `world` ranks at batch 1 against one process at batch world. */
void expect_accumulation_and_clipping_equal_one(int world) {
  Dir dir;
  const std::vector<std::string> common{"--strategy", "block", "--steps", "3", "--grad-accum", "2", "--clip", "0.05"};
  auto sharded_args = common;
  sharded_args.insert(sharded_args.end(), {"--batch", "1"});
  auto plain_args = common;
  plain_args.insert(plain_args.end(), {"--batch", std::to_string(world), "--plain"});
  auto sharded = run_fsdp(dir, "sharded", world, sharded_args);
  auto plain = run_fsdp(dir, "plain", 1, plain_args);
  for (const auto& p : sharded) ASSERT_EQ(p.status, 0) << read_file(p.err);
  ASSERT_EQ(plain[0].status, 0) << read_file(plain[0].err);
  EXPECT_LE(max_abs_diff(loaded_params(dir.path() / "sharded.pt"), loaded_params(dir.path() / "plain.pt")), 1e-6);
  const auto s = read_stats(dir.path() / "sharded.pt.rank0.stats");
  const auto s1 = read_stats(dir.path() / "sharded.pt.rank1.stats");
  const auto p = read_stats(dir.path() / "plain.pt.rank0.stats");
  EXPECT_GT(p.norm, 0.05) << "clipping is active";
  EXPECT_NEAR(s.norm, p.norm, 1e-5 * p.norm) << "the norm over both ranks' shards";
  EXPECT_EQ(s.norm, s1.norm) << "every rank gets the same norm";
  // Each micro-batch: every unit reduced once, so two per step.
  EXPECT_EQ(s.reduce_scatters, 2 * (s.units + 1));
  EXPECT_EQ(s.forward_allgathers, 2 * (s.units + 1));
  EXPECT_EQ(s.backward_allgathers, 2 * s.units);
}

TEST(FullyShardProcesses, GradAccumulationAndClippingEqualOneTwoRanks) {
  expect_accumulation_and_clipping_equal_one(2);
}
TEST(FullyShardProcesses, GradAccumulationAndClippingEqualOneFourRanks) {
  expect_accumulation_and_clipping_equal_one(4);
}

/** Collectives of the last step on 2 ranks: forward all-gathers,
 *  backward all-gathers, reduce-scatters, units. */
FsdpStats two_rank_stats(std::vector<std::string> extra) {
  Dir dir;
  extra.insert(extra.end(), {"--steps", "2", "--batch", "1"});
  auto ps = run_fsdp(dir, "c", 2, extra);
  for (const auto& p : ps) EXPECT_EQ(p.status, 0) << read_file(p.err);
  return read_stats(dir.path() / "c.pt.rank0.stats");
}

// The target: one forward and one backward all-gather per unit per
// micro-batch, checkpointing or not; the recompute of a checkpointed unit
// (and of the units inside it) reuses the backward's gather.
TEST(FullyShardProcesses, OneForwardAndOneBackwardAllGatherPerUnit) {
  Dir scratch;
  // auto: the last of 3 steps is planned; chain: the blocks' re-runs run in
  // the chain's own graph tasks, inside the backward.
  for (const std::string strategy : {"none", "block", "selective", "auto", "chain", "offload"}) {
    const auto s = two_rank_stats({"--strategy", strategy, "--steps", "3", "--offload-dir", scratch.path().string()});
    EXPECT_EQ(s.units, 4) << strategy;
    EXPECT_EQ(s.forward_allgathers, s.units + 1) << strategy << ": each block, and the root in forward()";
    EXPECT_EQ(s.backward_allgathers, s.units) << strategy << ": the root stays gathered until its gradients";
    EXPECT_EQ(s.reduce_scatters, s.units + 1) << strategy;
  }
  // Blocks, attention and MLP units, the blocks checkpointed: the block's
  // recompute runs its attention and MLP while they are gathered for it.
  for (const std::string strategy : {"block", "inner"}) {
    const auto s = two_rank_stats({"--strategy", strategy, "--units", "all"});
    EXPECT_EQ(s.units, 12) << strategy;
    EXPECT_EQ(s.forward_allgathers, s.units + 1) << strategy;
    EXPECT_EQ(s.backward_allgathers, s.units) << strategy;
    EXPECT_EQ(s.reduce_scatters, s.units + 1) << strategy;
  }
  // Kept gathered from forward to backward: no backward gathers.
  const auto kept = two_rank_stats({"--strategy", "block", "--no-reshard"});
  EXPECT_EQ(kept.forward_allgathers, kept.units + 1);
  EXPECT_EQ(kept.backward_allgathers, 0);
  // The last block only: its backward comes first, right after its forward.
  const auto last = two_rank_stats({"--strategy", "block", "--keep-gathered", "blocks.3"});
  EXPECT_EQ(last.forward_allgathers, last.units + 1);
  EXPECT_EQ(last.backward_allgathers, last.units - 1);
}

// Parameters, gradients and AdamW's moments: about 1/N of one process's
// (padding and the replicated buffers on top); full parameters gathered:
// the root and the unit running, plus one prefetched unit.
TEST(FullyShardProcesses, ModelStatePerRankIsAboutOneNth) {
  Dir dir;
  auto plain = run_fsdp(dir, "plain", 1, {"--plain", "--steps", "1", "--batch", "4"});
  ASSERT_EQ(plain[0].status, 0) << read_file(plain[0].err);
  const auto p = read_stats(dir.path() / "plain.pt.rank0.stats");
  for (int world : {2, 4}) {
    auto ps = run_fsdp(dir, "w" + std::to_string(world), world,
                       {"--steps", "1", "--batch", std::to_string(4 / world), "--strategy", "block"});
    for (const auto& q : ps) ASSERT_EQ(q.status, 0) << read_file(q.err);
    for (int r = 0; r < world; ++r) {
      const auto s = read_stats(dir.path() / ("w" + std::to_string(world) + ".pt.rank" + std::to_string(r) + ".stats"));
      const double ratio = static_cast<double>(s.state_bytes) / static_cast<double>(p.state_bytes);
      std::cout << world << " ranks, rank " << r << ": model state " << s.state_bytes << " B = " << ratio
                << " of one process's " << p.state_bytes << " B; at most " << s.max_gathered << " B gathered\n";
      EXPECT_LE(ratio, 1.0 / world + 0.02) << world << " ranks, rank " << r;
      EXPECT_GT(ratio, 1.0 / world - 0.02) << world << " ranks, rank " << r;
      EXPECT_LE(s.max_gathered, s.root_bytes + 2 * s.largest_unit);
    }
  }
  // No prefetch: one unit at a time besides the root.
  auto np = run_fsdp(dir, "np", 2, {"--steps", "1", "--batch", "2", "--strategy", "block", "--prefetch", "0"});
  for (const auto& q : np) ASSERT_EQ(q.status, 0) << read_file(q.err);
  const auto s = read_stats(dir.path() / "np.pt.rank0.stats");
  EXPECT_EQ(s.max_gathered, s.root_bytes + s.largest_unit);
}

// save_sharded after two steps, load_sharded into a fresh run: the same
// full model as the run that saved it.
TEST(FullyShardProcesses, ShardedSaveLoadsBack) {
  Dir dir;
  const std::string prefix = (dir.path() / "ckpt").string();
  auto a = run_fsdp(dir, "a", 2, {"--steps", "2", "--save-sharded", prefix});
  for (const auto& p : a) ASSERT_EQ(p.status, 0) << read_file(p.err);
  EXPECT_TRUE(fs::exists(prefix + ".rank0-of-2"));
  EXPECT_TRUE(fs::exists(prefix + ".rank1-of-2"));
  auto b = run_fsdp(dir, "b", 2, {"--steps", "0", "--load-sharded", prefix});
  for (const auto& p : b) ASSERT_EQ(p.status, 0) << read_file(p.err);
  EXPECT_EQ(max_abs_diff(loaded_params(dir.path() / "a.pt"), loaded_params(dir.path() / "b.pt")), 0.0);
  // Another world size: a clear error naming the file it looked for.
  auto c = run_fsdp(dir, "c", 1, {"--steps", "0", "--load-sharded", prefix});
  ASSERT_EQ(c[0].status, 3);
  EXPECT_NE(read_file(c[0].err).find("FullyShard::load_sharded: '" + prefix +
                                     ".rank0-of-1' does not exist (rank 0 of 1 reads <prefix>.rank<r>-of-<world>"),
            std::string::npos)
      << read_file(c[0].err);
  // One rank's file missing: all or nothing, every rank fails (the one
  // without its file naming it) and none goes on with other parameters.
  fs::remove(prefix + ".rank1-of-2");
  auto d = run_fsdp(dir, "d", 2, {"--steps", "1", "--load-sharded", prefix});
  ASSERT_EQ(d[0].status, 3) << "rank 0 must not go on alone";
  ASSERT_EQ(d[1].status, 3);
  EXPECT_NE(read_file(d[1].err).find("FullyShard::load_sharded: '" + prefix + ".rank1-of-2' does not exist"),
            std::string::npos)
      << read_file(d[1].err);
  EXPECT_NE(read_file(d[0].err).find("[remat::parallel] FullyShard::load_sharded: rank 1 of 2 could not load its "
                                     "file of '" +
                                     prefix + "' (its error says why); no rank changed anything."),
            std::string::npos)
      << read_file(d[0].err);
}

TEST(FullyShardProcesses, ARankThatDiesMidStepFailsTheOthersWithAClearError) {
  Dir dir;
  const auto t0 = std::chrono::steady_clock::now();
  // Rank 1 exits after its forward of step 2; rank 0 is then in backward's collectives.
  auto ps = run_fsdp(dir, "die", 2, {"--steps", "3", "--die-at-step", "2", "--timeout-ms", "20000"},
                     std::chrono::seconds(120));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(ps[1].status, 7);
  ASSERT_EQ(ps[0].status, 3) << "rank 0 must fail, not hang (-1) or succeed; stderr: " << read_file(ps[0].err);
  const std::string err = read_file(ps[0].err);
  EXPECT_NE(err.find("[remat::parallel] rank 0 of 2: the "), std::string::npos) << err;
  EXPECT_NE(err.find("A peer process probably exited or stopped answering (timeout 20 s)"), std::string::npos) << err;
  EXPECT_LT(s, 60.0) << "within the 20 s timeout plus start-up";
}

// One rank: the reduce-scatter is a copy and AdamW is elementwise, so the
// sharded run's parameters are bitwise the plain run's, checkpointed blocks
// and all.
TEST(FullyShard, OneRankIsBitwisePlain) {
  Dir dir;
  auto group = remat::parallel::init_process_group(
      InitOptions(0, 1).file_store((dir.path() / "store").string()).timeout(std::chrono::milliseconds(10000)));
  auto plain = worker_gpt();
  auto sharded = worker_gpt();
  remat::enable_checkpointing(sharded, remat::select::type<remat::models::GptBlockImpl>());
  remat::parallel::FullyShard fsdp(sharded.ptr(), group);
  // Every checkpointable module owning parameters: blocks (their
  // LayerNorms), and their attention and MLP.
  ASSERT_EQ(fsdp.units().size(), 13u);
  EXPECT_EQ(fsdp.units()[0].name, "(root)");
  EXPECT_EQ(fsdp.units()[1].name, "blocks.0");
  EXPECT_EQ(fsdp.units()[2].name, "blocks.0.attn");
  const auto o = torch::optim::AdamWOptions(1e-2);
  torch::optim::AdamW opt_plain(plain->parameters(), o), opt_sharded(fsdp.parameters(), o);
  for (int step = 0; step < 3; ++step) {
    auto tok = torch::randint(64, {2, 33}, torch::kLong);
    auto x = tok.slice(1, 0, 32), y = tok.slice(1, 1, 33);
    opt_plain.zero_grad();
    opt_sharded.zero_grad();
    plain->loss(plain->blocks->forward(plain->embed(x)), y).backward();
    fsdp.forward([&] { return sharded->loss(sharded->blocks->forward(sharded->embed(x)), y); }).backward();
    opt_plain.step();
    opt_sharded.step();
    EXPECT_EQ(fsdp.memory().gathered_bytes, 0) << "every unit freed after backward";
  }
  const std::string path = (dir.path() / "full.pt").string();
  fsdp.save_full(path);
  auto back = worker_gpt();
  torch::load(back, path);
  const auto pp = plain->parameters(), bp = back->parameters();
  ASSERT_EQ(pp.size(), bp.size());
  for (size_t i = 0; i < pp.size(); ++i) EXPECT_TRUE(torch::equal(pp[i], bp[i])) << "parameter " << i;
  EXPECT_FALSE(fs::exists(path + ".tmp." + std::to_string(::getpid())));
}

/** A checkpointable unit whose forward throws while `fail` is set. */
struct FlakyImpl : torch::nn::Module, remat::Checkpointable {
  explicit FlakyImpl(torch::nn::Linear shared) : fc(register_module("fc", std::move(shared))) {}
  at::Tensor forward(const at::Tensor& x) {
    return checkpointed(
        [this](const at::Tensor& h) {
          if (fail) throw std::runtime_error("flaky forward");
          return torch::tanh(fc(h));
        },
        x);
  }
  torch::nn::Linear fc;
  bool fail = false;
};
TORCH_MODULE(Flaky);

struct TwoFlakyImpl : torch::nn::Module {
  TwoFlakyImpl(torch::nn::Linear a, torch::nn::Linear b)
      : first(register_module("first", Flaky(std::move(a)))), second(register_module("second", Flaky(std::move(b)))) {}
  at::Tensor forward(const at::Tensor& x) { return second(first(x)); }
  Flaky first, second;
};
TORCH_MODULE(TwoFlaky);

// A unit whose forward throws is freed, and the next step runs as usual; a
// save between forward and backward keeps what the backward needs.
TEST(FullyShard, AFailedForwardAndASaveMidStepLeaveTheStepWhole) {
  Dir dir;
  auto group = remat::parallel::init_process_group(
      InitOptions(0, 1).file_store((dir.path() / "store").string()).timeout(std::chrono::milliseconds(10000)));
  torch::manual_seed(3);
  TwoFlaky net(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
  TwoFlaky plain(torch::nn::Linear(8, 8), torch::nn::Linear(8, 8));
  for (size_t i = 0; i < net->parameters().size(); ++i) {
    torch::NoGradGuard g;
    plain->parameters()[i].copy_(net->parameters()[i]);
  }
  remat::parallel::FullyShard fsdp(net.ptr(), group);
  ASSERT_EQ(fsdp.units().size(), 3u);
  auto x = torch::randn({4, 8});
  net->second->fail = true;
  EXPECT_THROW(fsdp.forward([&] { return net->forward(x).sum(); }), std::runtime_error);
  EXPECT_EQ(fsdp.memory().gathered_bytes, 0) << "the failed unit is freed (the first one after its forward)";
  net->second->fail = false;
  auto loss = fsdp.forward([&] { return net->forward(x).sum(); });
  fsdp.save_full((dir.path() / "mid.pt").string());  // between forward and backward
  loss.backward();
  plain->forward(x).sum().backward();
  EXPECT_EQ(fsdp.memory().gathered_bytes, 0);
  const auto shards = fsdp.parameters();
  ASSERT_EQ(shards.size(), 2u);
  // One rank: each unit's shard gradient is its parameters' gradients, flattened in order.
  EXPECT_TRUE(torch::equal(shards[0].grad().narrow(0, 0, 64), plain->first->fc->weight.grad().reshape({-1})));
  EXPECT_TRUE(torch::equal(shards[1].grad().narrow(0, 0, 64), plain->second->fc->weight.grad().reshape({-1})));
}

TEST(FullyShard, UnitsSharingAParameterAreRefused) {
  Dir dir;
  auto group = remat::parallel::init_process_group(
      InitOptions(0, 1).file_store((dir.path() / "store").string()).timeout(std::chrono::milliseconds(10000)));
  torch::nn::Linear shared(8, 8);
  TwoFlaky net(shared, shared);
  EXPECT_EQ(message_of([&] { remat::parallel::FullyShard f(net.ptr(), group); }),
            "[remat::parallel] FullyShard: parameter 'first.fc.weight' of unit 'first' is also used by "
            "'second.fc', outside the unit; choose units (FullyShardOptions::units) that hold every module using "
            "their parameters.");
  // Nothing changed: the model still trains plainly.
  net->forward(torch::randn({2, 8})).sum().backward();
  EXPECT_TRUE(shared->weight.grad().defined());
}

TEST(FullyShard, BadUseIsAClearError) {
  Dir dir;
  auto group = remat::parallel::init_process_group(
      InitOptions(0, 1).file_store((dir.path() / "store").string()).timeout(std::chrono::milliseconds(10000)));
  auto gpt = worker_gpt();
  EXPECT_EQ(message_of([&] {
              remat::parallel::FullyShard f(gpt.ptr(), group, remat::parallel::FullyShardOptions().prefetch_bytes(-1));
            }),
            "[remat::parallel] FullyShard: prefetch_bytes -1 is negative; give 0 (no prefetch) or a byte bound "
            "(default 64 MiB).");
  EXPECT_EQ(message_of([&] { remat::parallel::FullyShard f(gpt.ptr(), remat::parallel::ProcessGroup()); }),
            "[remat::parallel] FullyShard: the ProcessGroup was not joined; use init_process_group().");
  // Two dtypes in one unit.
  auto mixed = worker_gpt();
  mixed->blocks[0]->parameters()[0].set_data(mixed->blocks[0]->parameters()[0].detach().to(at::kDouble));
  EXPECT_NE(message_of([&] {
              remat::parallel::FullyShard f(mixed.ptr(), group);
            }).find("[remat::parallel] FullyShard: unit 'blocks.0' holds parameters of two dtypes ("),
            std::string::npos);
  {  // auto_checkpoint's profile with units inside units: refused by name.
    auto nested = worker_gpt();
    remat::parallel::FullyShard f(nested.ptr(), group);
    auto planner = remat::auto_checkpoint(nested, remat::AutoOptions().memory_budget_fraction(1.0));
    auto tok = torch::randint(64, {2, 33}, torch::kLong);
    auto x = tok.slice(1, 0, 32), y = tok.slice(1, 1, 33);
    auto step = [&] {
      f.forward([&] { return nested->loss(nested->blocks->forward(nested->embed(x)), y); }).backward();
    };
    planner.step(step);  // warm-up: plain
    EXPECT_EQ(message_of([&] { planner.step(step); }),
              "[remat::parallel] FullyShard: unit 'blocks.0.attn' lies inside another checkpointable module, and "
              "auto_checkpoint is profiling the step; under auto_checkpoint, shard by the outermost checkpointable "
              "modules (FullyShardOptions::units, e.g. select::type<Block>()).");
  }
  EXPECT_EQ(message_of([&] {
              remat::parallel::FullyShard f(gpt.ptr(), group,
                                            remat::parallel::FullyShardOptions()
                                                .units(remat::select::type<remat::models::GptBlockImpl>())
                                                .keep_gathered(remat::select::name("blocks.3.mlp")));
            }),
            "[remat::parallel] FullyShard: keep_gathered chose 'blocks.3.mlp', which is not a unit "
            "(FullyShardOptions::units did not choose it, or it owns no parameter); choose among the units.");
  remat::parallel::FullyShard fsdp(gpt.ptr(), group);
  EXPECT_EQ(message_of([&] { remat::parallel::FullyShard again(gpt.ptr(), group); }),
            "[remat::parallel] FullyShard: unit 'blocks.0' already has hooks (another FullyShard on the same "
            "module?); shard a model once.");
  EXPECT_EQ(message_of([&] { fsdp.load_sharded((dir.path() / "none").string()); }),
            "[remat::parallel] FullyShard::load_sharded: '" + (dir.path() / "none").string() +
                ".rank0-of-1' does not exist (rank 0 of 1 reads <prefix>.rank<r>-of-<world>, one file per rank, as "
                "save_sharded wrote them); put each rank's file where that rank reads it, or give the prefix and "
                "world size they were saved with.");
}

}  // namespace

// --- Pipeline: one stage per process --------------------------------------

namespace {

/** Runs pipe_worker on `world` ranks (--plain: one process), each writing
 *  TAG.rankR.pt (the parameters it owns) and TAG.rankR.stats. */
std::vector<Proc> run_pipe(const Dir& dir, const std::string& tag, int world, std::vector<std::string> extra,
                           std::chrono::seconds limit = std::chrono::seconds(240)) {
  return run_workers(REMAT_PIPE_WORKER, dir, tag, tag, world, extra, limit);
}

/** One line of pipe_worker's figures (see its header). */
struct PipeStats {
  int max_in_flight = -1, planned_in_flight = -1;
  int64_t peak = -1, kept_per_micro = -1, budget = -1, measured_peak = -1;
  int changed = -1;
  double loss = -1;
  int64_t grad_bytes = -1;
};

PipeStats read_pipe_stats(const fs::path& p) {
  PipeStats s;
  std::istringstream in(read_file(p));
  in >> s.max_in_flight >> s.planned_in_flight >> s.peak >> s.kept_per_micro >> s.budget >> s.measured_peak >>
      s.changed >> s.loss >> s.grad_bytes;
  return s;
}

/** name -> tensor of an archive pipe_worker wrote. */
std::map<std::string, at::Tensor> read_named(const fs::path& p) {
  torch::serialize::InputArchive a;
  a.load_from(p.string());
  std::map<std::string, at::Tensor> out;
  for (const auto& k : a.keys()) {
    at::Tensor t;
    a.read(k, t);
    out[k] = t;
  }
  return out;
}

/** `world` stages, `micro` micro-batches of a global batch of 8, against one
 *  process at batch 8 (same data, AdamW, 3 steps; 4 under auto, whose first
 *  two are its warm-up and profiled steps): every parameter each stage owns
 *  within 1e-6 of the plain run's, the tied embedding equal on the first
 *  and last stage, the loss within 1e-6. */
void expect_pipeline_equals_plain(int world, int micro, const std::string& schedule, const std::string& strategy,
                                  std::vector<std::string> extra = {}, int replicas = 1) {
  Dir dir;
  const int stages = world / replicas;
  if (replicas > 1) extra.insert(extra.end(), {"--replicas", std::to_string(replicas)});
  std::vector<std::string> common{"--strategy", strategy, "--steps", strategy == "auto" ? "4" : "3", "--batch", "8"};
  common.insert(common.end(), extra.begin(), extra.end());
  auto pipe_args = common;
  pipe_args.insert(pipe_args.end(), {"--micro", std::to_string(micro), "--schedule", schedule});
  auto plain_args = common;
  plain_args.push_back("--plain");
  auto pipe = run_pipe(dir, "pipe", world, pipe_args);
  auto plain = run_pipe(dir, "plain", 1, plain_args);
  for (const auto& p : pipe) ASSERT_EQ(p.status, 0) << read_file(p.err);
  ASSERT_EQ(plain[0].status, 0) << read_file(plain[0].err);
  const auto want = read_named(dir.path() / "plain.rank0.pt");
  const auto init = worker::fsdp_gpt()->named_parameters();
  std::map<std::string, int> seen;
  double worst = 0, moved = 0;
  for (int r = 0; r < world; ++r) {
    for (const auto& [name, t] : read_named(dir.path() / ("pipe.rank" + std::to_string(r) + ".pt"))) {
      ASSERT_EQ(want.count(name), 1u) << name;
      const double d = (t - want.at(name)).abs().max().item<double>();
      EXPECT_LE(d, 1e-6) << name << " on stage " << r;
      worst = std::max(worst, d);
      moved = std::max(moved, (t - init[name].detach()).abs().max().item<double>());
      ++seen[name];
    }
  }
  EXPECT_EQ(seen.size(), want.size()) << "every parameter lives on some stage";
  EXPECT_EQ(seen["wte.weight"], (stages > 1 ? 2 : 1) * replicas)
      << "the tied embedding lives on the first and last stage of each replica";
  EXPECT_GT(moved, 1e-3) << "the steps moved the parameters";
  const auto s0 = read_pipe_stats(dir.path() / "pipe.rank0.stats");
  const auto sp = read_pipe_stats(dir.path() / "plain.rank0.stats");
  EXPECT_NEAR(s0.loss, sp.loss, 1e-6);
  for (int r = 0; r < world; ++r) {
    const auto s = read_pipe_stats(dir.path() / ("pipe.rank" + std::to_string(r) + ".stats"));
    const int holds = schedule == "gpipe" ? micro : std::min(stages - r % stages, micro);
    EXPECT_EQ(s.planned_in_flight, holds) << "stage " << r;
    EXPECT_EQ(s.max_in_flight, holds) << "stage " << r << " held that many micro-batches at once";
    if (strategy == "auto") {
      EXPECT_GT(s.changed, 0) << "stage " << r << ": the plan between the leanest and plain recomputes something";
      EXPECT_LE(static_cast<double>(s.measured_peak), 1.02 * static_cast<double>(s.budget)) << "stage " << r;
    }
  }
  std::cout << "[" << stages << " stages x " << replicas << " replicas, " << micro << " micro-batches, " << schedule
            << ", " << strategy << "] max |param diff| " << worst << ", loss " << s0.loss << " (plain " << sp.loss
            << ")\n";
}

}  // namespace

TEST(PipelineProcesses, TwoStagesGPipeEqualOnePlain) { expect_pipeline_equals_plain(2, 4, "gpipe", "none"); }
TEST(PipelineProcesses, TwoStages1F1BEqualOnePlain) { expect_pipeline_equals_plain(2, 4, "1f1b", "none"); }
TEST(PipelineProcesses, TwoStages1F1BEqualOnePerBlock) { expect_pipeline_equals_plain(2, 4, "1f1b", "block"); }
TEST(PipelineProcesses, TwoStagesGPipeEqualOnePerBlockEightMicroBatches) {
  expect_pipeline_equals_plain(2, 8, "gpipe", "block");
}
TEST(PipelineProcesses, TwoStages1F1BEqualOnePlannedEightMicroBatches) {
  expect_pipeline_equals_plain(2, 8, "1f1b", "auto");
}
// A stage whose first op works in place on what it received (an in-place
// ReLU), as it may on the previous block's output in one process.
TEST(PipelineProcesses, AStageStartingWithAnInPlaceReluEqualsOne) {
  expect_pipeline_equals_plain(2, 4, "1f1b", "none", {"--inplace-relu"});
}
// Each stage updates in its last micro-batch's backward (remat::StepInBackward),
// the tied embedding after the stages' sum: as one process.
TEST(PipelineProcesses, TwoStages1F1BUpdatingInBackwardEqualOne) {
  expect_pipeline_equals_plain(2, 4, "1f1b", "block", {"--step-in-backward"});
}
TEST(PipelineProcesses, TwoStagesGPipeEqualOnePlanned) { expect_pipeline_equals_plain(2, 4, "gpipe", "auto"); }
TEST(PipelineProcesses, FourStages1F1BEqualOnePlain) { expect_pipeline_equals_plain(4, 4, "1f1b", "none"); }
TEST(PipelineProcesses, FourStagesGPipeEqualOnePerBlock) { expect_pipeline_equals_plain(4, 4, "gpipe", "block"); }
TEST(PipelineProcesses, FourStages1F1BEqualOnePerBlockEightMicroBatches) {
  expect_pipeline_equals_plain(4, 8, "1f1b", "block");
}
TEST(PipelineProcesses, FourStagesGPipeEqualOnePlainEightMicroBatches) {
  expect_pipeline_equals_plain(4, 8, "gpipe", "none");
}
TEST(PipelineProcesses, FourStages1F1BEqualOnePlanned) { expect_pipeline_equals_plain(4, 8, "1f1b", "auto"); }
// The global norm over the stages (the tied embedding counted once).
TEST(PipelineProcesses, ClippingOverTheStagesEqualsOne) {
  expect_pipeline_equals_plain(2, 4, "1f1b", "none", {"--clip", "0.05"});
  expect_pipeline_equals_plain(4, 4, "gpipe", "none", {"--clip", "0.05"});
}
// Several tensors of several dtypes at each boundary (int64, empty, one
// that needs no gradient): only the differentiable one gets a gradient back.
TEST(PipelineProcesses, SeveralTensorsAtEachBoundaryEqualOne) {
  expect_pipeline_equals_plain(4, 4, "1f1b", "block", {"--extras"});
}
// Pipeline x data: 2 stages, each replicated twice (4 processes; the
// replicas split the batch and average_gradients over a new_group), clipped.
TEST(PipelineProcesses, TwoStagesTimesTwoReplicasEqualOne) {
  expect_pipeline_equals_plain(4, 2, "1f1b", "block", {"--clip", "0.05"}, 2);
}
TEST(PipelineProcesses, TwoStagesTimesTwoReplicasPlannedEqualOne) {
  expect_pipeline_equals_plain(4, 4, "gpipe", "auto", {}, 2);
}

// What a stage holds: 1F1B's first stage at most P micro-batches' kept
// activations, GPipe's all M. The bound on 1F1B's peak is those P, the
// stage's parameter gradients (allocated in the step) and one more
// micro-batch for the backward's working set; GPipe's peak is at least M.
TEST(PipelineProcesses, OneF1BFirstStageHoldsPMicroBatchesGPipeHoldsM) {
  for (int world : {2, 4}) {
    Dir dir;
    const std::vector<std::string> common{"--steps", "2", "--batch", "8", "--micro", "8"};
    auto a = common, b = common;
    a.insert(a.end(), {"--schedule", "1f1b"});
    b.insert(b.end(), {"--schedule", "gpipe"});
    auto f = run_pipe(dir, "f", world, a);
    auto g = run_pipe(dir, "g", world, b);
    for (const auto& p : f) ASSERT_EQ(p.status, 0) << read_file(p.err);
    for (const auto& p : g) ASSERT_EQ(p.status, 0) << read_file(p.err);
    const auto sf = read_pipe_stats(dir.path() / "f.rank0.stats");
    const auto sg = read_pipe_stats(dir.path() / "g.rank0.stats");
    ASSERT_GT(sf.kept_per_micro, 0);
    EXPECT_EQ(sf.max_in_flight, world);
    EXPECT_EQ(sg.max_in_flight, 8);
    EXPECT_LE(sf.peak, (world + 1) * sf.kept_per_micro + sf.grad_bytes) << world << " stages";
    EXPECT_GE(sg.peak, 8 * sg.kept_per_micro) << world << " stages";
    std::cout << "[" << world << " stages, 8 micro-batches] stage 0 peaks: 1F1B " << sf.peak << " B, GPipe " << sg.peak
              << " B; one micro-batch keeps " << sf.kept_per_micro << " B, gradients " << sf.grad_bytes << " B\n";
  }
}

// A stage that dies: its neighbours' sends or receives fail (Gloo sees the
// closed connection), and the stage beyond gets the abort passed on.
TEST(PipelineProcesses, AStageThatDiesFailsEveryOtherStageWithAClearError) {
  Dir dir;
  const auto t0 = std::chrono::steady_clock::now();
  auto ps = run_pipe(dir, "die", 4, {"--steps", "3", "--die-at-step", "2", "--timeout-ms", "20000"},
                     std::chrono::seconds(120));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(ps[1].status, 7);
  for (int r : {0, 2, 3})
    ASSERT_EQ(ps[r].status, 3) << "stage " << r << " must fail, not hang: " << read_file(ps[r].err);
  const std::string e0 = read_file(ps[0].err), e2 = read_file(ps[2].err), e3 = read_file(ps[3].err);
  // Stage 0 meets the dead neighbour where it is at that moment: sending
  // one of the activations of its warm-up (1F1B sends up to 4 before it
  // waits: whether a send already sees the closed connection depends on
  // the machine's load), or waiting for the first gradients.
  bool sending = false;
  for (int mb = 0; mb < 4; ++mb) {
    sending |= e0.find("[remat::parallel] pipeline stage 0 of 4: sending the activations of micro-batch " +
                       std::to_string(mb) + " to stage 1 failed: ") != std::string::npos;
  }
  EXPECT_TRUE(e0.find("[remat::parallel] pipeline stage 0 of 4: receiving the gradients of micro-batch 0 from stage 1 "
                      "failed: ") != std::string::npos ||
              sending)
      << e0;
  EXPECT_NE(e2.find("[remat::parallel] pipeline stage 2 of 4: receiving the activations of micro-batch 0 from stage "
                    "1 failed: "),
            std::string::npos)
      << e2;
  EXPECT_NE(e3.find("[remat::parallel] pipeline stage 3 of 4: stopped because another stage failed: pipeline stage 2 "
                    "of 4: receiving the activations of micro-batch 0 from stage 1 failed: "),
            std::string::npos)
      << e3;
  for (const auto* e : {&e0, &e2, &e3}) {
    EXPECT_NE(e->find("A peer process probably exited or stopped answering (timeout 20 s)."), std::string::npos) << *e;
  }
  EXPECT_LT(s, 60.0) << "within the 20 s timeout plus start-up";
}

// Stage 0 sends half its width: stage 1's forward fails, and every stage
// says so.
TEST(PipelineProcesses, AShapeMismatchBetweenStagesIsAClearErrorOnEveryStage) {
  for (int world : {2, 4}) {
    Dir dir;
    auto ps = run_pipe(dir, "mismatch", world, {"--steps", "1", "--mismatch", "--timeout-ms", "20000"},
                       std::chrono::seconds(120));
    const std::string what =
        "pipeline stage 1 of " + std::to_string(world) +
        ": the forward of micro-batch 0 on inputs ([2, 32, 32] Float) failed: Given normalized_shape=[64], expected "
        "input with shape [*, 64], but got input of size[2, 32, 32]";
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(ps[r].status, 3) << "stage " << r << ": " << read_file(ps[r].err);
      const std::string want = r == 1 ? "pipe_worker rank 1: [remat::parallel] " + what
                                      : "pipe_worker rank " + std::to_string(r) +
                                            ": [remat::parallel] pipeline stage " + std::to_string(r) + " of " +
                                            std::to_string(world) + ": stopped because another stage failed: " + what;
      EXPECT_EQ(read_file(ps[r].err), want + "\n") << world << " stages";
    }
  }
}

// A backward that throws on stage 0 under GPipe: stage 1 has nothing more
// to receive from it, and learns of it from the step's status all-reduce,
// well within the timeout.
TEST(PipelineProcesses, AFailedBackwardStopsEveryStageWithoutWaitingForTheTimeout) {
  Dir dir;
  const auto t0 = std::chrono::steady_clock::now();
  auto ps = run_pipe(dir, "bwd", 2, {"--steps", "1", "--schedule", "gpipe", "--fail-backward", "--timeout-ms", "30000"},
                     std::chrono::seconds(120));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(ps[0].status, 3) << read_file(ps[0].err);
  ASSERT_EQ(ps[1].status, 3) << read_file(ps[1].err);
  EXPECT_EQ(read_file(ps[0].err),
            "pipe_worker rank 0: [remat::parallel] pipeline stage 0 of 2: the backward of micro-batch 0 failed: "
            "pipe_worker: a backward that throws\n");
  EXPECT_EQ(read_file(ps[1].err),
            "pipe_worker rank 1: [remat::parallel] pipeline stage 1 of 2: stopped because stage 0 failed (its error is "
            "reported on that rank).\n");
  EXPECT_LT(s, 20.0) << "not at the 30 s timeout";
}

// Ranks that disagree on the micro-batches are refused when the Pipeline is made.
TEST(PipelineProcesses, RanksWithOtherOptionsAreRefusedAtConstruction) {
  Dir dir;
  auto ps = run_pipe(dir, "opts", 2, {"--steps", "1", "--other-micro-on-rank-1", "--timeout-ms", "30000"},
                     std::chrono::seconds(120));
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ps[r].status, 3) << read_file(ps[r].err);
    EXPECT_EQ(read_file(ps[r].err),
              "pipe_worker rank " + std::to_string(r) + ": [remat::parallel] pipeline stage " + std::to_string(r) +
                  " of 2: the ranks' PipelineOptions differ: microbatches ranges over 4..8 "
                  "(this rank " +
                  (r == 0 ? "4" : "8") + "); give every rank the same microbatches, schedule and tied list.\n");
  }
}

// One stage: M micro-batches are gradient accumulation, bitwise.
TEST(Pipeline, OneStageIsBitwiseGradientAccumulation) {
  Dir dir;
  auto group = remat::parallel::init_process_group(
      InitOptions(0, 1).file_store((dir.path() / "store").string()).timeout(std::chrono::milliseconds(10000)));
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::GELU(), torch::nn::Linear(16, 4));
  torch::nn::Sequential twin(torch::nn::Linear(8, 16), torch::nn::GELU(), torch::nn::Linear(16, 4));
  {
    torch::NoGradGuard g;
    for (size_t i = 0; i < model->parameters().size(); ++i) twin->parameters()[i].copy_(model->parameters()[i]);
  }
  remat::parallel::Pipeline pipe(group, remat::parallel::sequential_stage(model),
                                 remat::parallel::PipelineOptions().microbatches(3));
  auto x = torch::randn({6, 8}), y = torch::randn({6, 4});
  auto mse = [](const std::vector<at::Tensor>& o, const std::vector<at::Tensor>& t) {
    return torch::mse_loss(o[0], t[0]);
  };
  const double loss = pipe.step({x}, {y}, mse).item<double>();
  double want = 0;
  for (int m = 0; m < 3; ++m) {
    auto l = torch::mse_loss(twin->forward(x.chunk(3)[m]), y.chunk(3)[m]) / 3.0;
    l.backward();
    want += l.item<double>();
  }
  EXPECT_EQ(loss, want);
  for (size_t i = 0; i < model->parameters().size(); ++i) {
    EXPECT_TRUE(torch::equal(model->parameters()[i].grad(), twin->parameters()[i].grad())) << i;
  }
  EXPECT_EQ(pipe.stats().max_in_flight, 1);
  EXPECT_EQ(pipe.planned_in_flight(), 1);
}

TEST(Pipeline, BadValuesAreClearErrors) {
  Dir dir;
  auto group = remat::parallel::init_process_group(
      InitOptions(0, 1).file_store((dir.path() / "store").string()).timeout(std::chrono::milliseconds(10000)));
  torch::nn::Sequential model(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 4), torch::nn::ReLU(),
                              torch::nn::Linear(4, 2));
  using remat::parallel::Pipeline;
  using remat::parallel::PipelineOptions;
  EXPECT_EQ(message_of([&] { remat::parallel::parse_pipeline_schedule("zb"); }),
            "[remat::parallel] pipeline schedule 'zb' is not one of gpipe, 1f1b.");
  EXPECT_EQ(remat::parallel::parse_pipeline_schedule("GPipe"), remat::parallel::PipelineSchedule::kGPipe);
  EXPECT_EQ(message_of([&] {
              remat::parallel::pipeline_part(model, {2, 2}, 0);
            }),
            "[remat::parallel] pipeline cut 2 (cuts[1]) must be greater than 2 and less than the model's 5 modules: "
            "give P - 1 increasing indices, each stage at least one module.");
  EXPECT_EQ(message_of([&] { remat::parallel::pipeline_part(model, {5}, 0); }),
            "[remat::parallel] pipeline cut 5 (cuts[0]) must be greater than 0 and less than the model's 5 modules: "
            "give P - 1 increasing indices, each stage at least one module.");
  EXPECT_EQ(message_of([&] {
              remat::parallel::pipeline_part(model, {2, 4}, 3);
            }),
            "[remat::parallel] rank 3 has no stage: 2 cuts make 3 stages (give world_size - 1 cuts).");
  {  // The parts share the model's modules.
    auto p0 = remat::parallel::pipeline_part(model, {2, 4}, 0), p2 = remat::parallel::pipeline_part(model, {2, 4}, 2);
    EXPECT_EQ(p0->size(), 2u);
    EXPECT_EQ(p2->size(), 1u);
    EXPECT_EQ(p0->ptr(1).get(), model->ptr(1).get());
    EXPECT_EQ(p2->ptr(0).get(), model->ptr(4).get());
  }
  auto stage = remat::parallel::sequential_stage(model);
  EXPECT_EQ(message_of([&] { Pipeline p(remat::parallel::ProcessGroup(), stage); }),
            "[remat::parallel] Pipeline needs a joined process group; call init_process_group() first.");
  EXPECT_EQ(message_of([&] { Pipeline p(group, remat::parallel::StageFn()); }),
            "[remat::parallel] Pipeline needs a stage function (an empty StageFn was given).");
  EXPECT_EQ(message_of([&] { Pipeline p(group, stage, PipelineOptions().microbatches(0)); }),
            "[remat::parallel] PipelineOptions::microbatches 0 must be at least 1.");
  const auto w = model->parameters()[0];
  EXPECT_EQ(message_of([&] {
              Pipeline p(group, stage, PipelineOptions().tied({w, w}));
            }),
            "[remat::parallel] PipelineOptions::tied lists one parameter twice (at 0 and 1).");
  EXPECT_EQ(message_of([&] { Pipeline p(group, stage, PipelineOptions().tied({torch::zeros({2}, torch::kLong)})); }),
            "[remat::parallel] PipelineOptions::tied[0] is not a floating parameter; tie parameters only.");
  Pipeline pipe(group, stage, PipelineOptions().microbatches(4));
  auto mse = [](const std::vector<at::Tensor>& o, const std::vector<at::Tensor>& t) {
    return torch::mse_loss(o[0], t[0]);
  };
  EXPECT_EQ(message_of([&] {
              pipe.step({torch::randn({6, 4})}, {torch::randn({6, 2})}, mse);
            }),
            "[remat::parallel] pipeline stage 0 of 1: inputs[0] ([6, 4] Float) does not split into 4 micro-batches "
            "along dim 0; give a batch that is a multiple of PipelineOptions::microbatches.");
  EXPECT_EQ(message_of([&] { pipe.step({}, {}, mse); }),
            "[remat::parallel] pipeline stage 0 of 1: step() got no inputs; the first stage splits them into 4 "
            "micro-batches.");
  EXPECT_EQ(message_of([&] {
              pipe.step({torch::randn({8, 4})}, {}, remat::parallel::LossFn());
            }),
            "[remat::parallel] pipeline stage 0 of 1: the forward of micro-batch 0 on inputs ([2, 4] Float) failed: "
            "[remat::parallel] the last stage needs a LossFn; pass one to step() on every rank.");
  EXPECT_EQ(message_of([&] {
              pipe.step({torch::randn({8, 4})}, {torch::randn({8, 2})},
                        [](const std::vector<at::Tensor>& o, const std::vector<at::Tensor>&) { return o[0]; });
            }),
            "[remat::parallel] pipeline stage 0 of 1: the forward of micro-batch 0 on inputs ([2, 4] Float) failed: "
            "[remat::parallel] the loss of micro-batch 0 is [2, 2] Float; return a scalar (the micro-batch's mean).");
  EXPECT_EQ(message_of([&] { pipe.clip_grad_norm(model->parameters(), 0.0); }),
            "[remat::parallel] clip_grad_norm: max_norm 0.000000 must be a positive finite number.");
  // After the errors, a good step runs and leaves gradients.
  for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
  pipe.step({torch::randn({8, 4})}, {torch::randn({8, 2})}, mse);
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
}

// --- remat-train --pipeline -------------------------------------------------

namespace {

/** The loss printed on the line of `step` ("step 3/3  loss 4.01"), after `prefix`. */
double printed_loss(const std::string& out, const std::string& prefix, int step, int steps) {
  const std::string key = prefix + "step " + std::to_string(step) + "/" + std::to_string(steps) + "  loss ";
  const auto at = out.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(out.substr(at + key.size(), 12));
}

}  // namespace

// Two stages of 4 micro-batches of 2 train as one process at batch 8: the
// same loss at every step (the third sees two updates), with the stages'
// figures printed; under auto, each stage's plan.
TEST(RematTrainPipeline, TwoStagesTrainAsOneAtTheWholeBatch) {
  Dir dir;
  const std::string model =
      " --layers 4 --d-model 32 --heads 2 --seq-len 32 --steps 3 --optimizer sgd --lr 0.05 --threads 1"
      " --clip-norm 0.05";
  for (const char* schedule : {"1f1b", "gpipe"}) {
    auto [rc2, out2] =
        train(dir, std::string("--pipeline 2 --microbatches 4 --batch 2 --checkpoint block --schedule ") + schedule +
                       " --master-port " + std::to_string(free_port()) + model);
    ASSERT_EQ(rc2, 0) << out2;
    EXPECT_NE(
        out2.find(std::string("pipeline of 2 stages (Gloo), 4 micro-batches of 2 (") + schedule + "), global batch 8"),
        std::string::npos)
        << out2;
    for (const char* line : {"[stage 0/2] step 3/3", "[stage 1/2] step 3/3", " bubble ", " waiting "}) {
      EXPECT_NE(out2.find(line), std::string::npos) << line << "\n" << out2;
    }
    auto [rc1, out1] = train(dir, "--batch 8 --checkpoint block" + model);
    ASSERT_EQ(rc1, 0) << out1;
    for (int s = 1; s <= 3; ++s) {
      const double one = printed_loss(out1, "", s, 3);
      ASSERT_GT(one, 0) << out1;
      for (const char* stage : {"[stage 0/2] ", "[stage 1/2] "}) {
        EXPECT_NEAR(printed_loss(out2, stage, s, 3), one, 2e-6) << schedule << " step " << s << "\n" << out2;
      }
    }
  }
  {  // 2 replicas of the pipeline: 4 processes, each replica 4 micro-batches of 1.
    auto [rc4, out4] =
        train(dir, "--pipeline 2 --nproc 4 --microbatches 4 --batch 1 --checkpoint block --master-port " +
                       std::to_string(free_port()) + model);
    ASSERT_EQ(rc4, 0) << out4;
    EXPECT_NE(out4.find("4 micro-batches of 1 (1f1b), 2 data-parallel replicas, global batch 8"), std::string::npos)
        << out4;
    auto [rc1, out1] = train(dir, "--batch 8 --checkpoint block" + model);
    ASSERT_EQ(rc1, 0) << out1;
    for (int s = 1; s <= 3; ++s) {
      for (const char* who : {"[stage 0/2, replica 0/2] ", "[stage 1/2, replica 1/2] "}) {
        EXPECT_NEAR(printed_loss(out4, who, s, 3), printed_loss(out1, "", s, 3), 2e-6) << who << s << "\n" << out4;
      }
    }
  }
  auto [rc, out] = train(dir,
                         "--pipeline 2 --microbatches 4 --batch 2 --checkpoint auto --memory-budget 1MiB "
                         "--layers 4 --d-model 32 --heads 2 --seq-len 32 --steps 4 --threads 1 --master-port " +
                             std::to_string(free_port()));
  ASSERT_EQ(rc, 0) << out;
  for (const char* line : {"[stage 0/2] stage 0 of 2 (1f1b, 4 micro-batches): holds at most 2 at once",
                           "[stage 1/2] stage 1 of 2 (1f1b, 4 micro-batches): holds at most 1 at once",
                           "  planner: budget ", "    blocks.0 ", "    blocks.3 ",
                           "[stage 0/2] auto: budget 1.00 MiB as asked (--memory-budget: the step's peak above its "
                           "start), ",
                           " as applied to the planner (all tracked memory), which adds the "}) {
    EXPECT_NE(out.find(line), std::string::npos) << line << "\n" << out;
  }
}

TEST(RematTrainPipeline, BadFlagsAreClearErrors) {
  Dir dir;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--pipeline 2 --shard",
       "--pipeline does not combine with --shard (each stage's parameters are whole on its process); replicate the "
       "stages with --nproc instead."},
      {"--pipeline 2 --nproc 3",
       "--nproc 3 with --pipeline 2: give a multiple of the stages (each replica of the pipeline takes --pipeline "
       "processes)."},
      {"--pipeline 2 --model resnet", "--pipeline cuts the GPT's blocks into stages; use --model gpt."},
      {"--pipeline 2 --checkpoint sqrt",
       "--checkpoint sqrt segments the whole block stack, and a pipeline stage runs part of it; use block, "
       "selective, auto or offload."},
      {"--pipeline 2 --save x.pt",
       "--save and --resume write and read one process's whole model; a pipeline's stages each hold a part. Drop "
       "them with --pipeline."},
      {"--pipeline 2 --grad-accum 2",
       "--grad-accum with --pipeline: the pipeline accumulates its micro-batches; use --microbatches."},
      {"--pipeline 2 --microbatches 0", "--microbatches must be at least 1, got 0."},
      {"--pipeline -1", "--pipeline must be at least 1 stage, got -1."},
      {"--pipeline 2 --rank 0 --world-size 3",
       "--pipeline 2 needs a --world-size that is a multiple of it (one process per stage and replica), got 3."},
      {"--pipeline 2 --explain-memory", "--max-*-under and --explain-memory run in one process; drop --pipeline."},
      {"--microbatches 4", "--microbatches and --schedule set up a pipeline; add --pipeline P."},
      {"--schedule gpipe", "--microbatches and --schedule set up a pipeline; add --pipeline P."},
      {"--pipeline 2 --world-size 4", "--world-size 4 needs --rank."},
  };
  for (const auto& [args, msg] : cases) {
    auto [rc, out] = train(dir, args + " --steps 1");
    EXPECT_EQ(rc, 2) << args;
    EXPECT_EQ(out, "remat-train: error: [remat::train] " + msg + "\n") << args;
  }
  // More stages than blocks: said once, before any stage starts.
  auto [rc, out] = train(dir, "--pipeline 3 --layers 2 --d-model 16 --heads 2 --seq-len 16 --steps 1 --master-port " +
                                  std::to_string(free_port()));
  EXPECT_EQ(rc, 2);
  EXPECT_EQ(out,
            "remat-train: error: [remat::train] --pipeline 3 is more stages than the GPT's 2 blocks; give at most 2 "
            "(or more --layers).\n");
}

// new_group and average_gradients, two ranks as two threads of this process.
TEST(ProcessGroup, NewGroupAndAverageGradients) {
  Dir dir;
  const std::string store = (dir.path() / "store").string();
  std::vector<std::string> errors(2);
  std::vector<at::Tensor> grads(2);
  auto rank_body = [&](int r) {
    auto g = remat::parallel::init_process_group(
        InitOptions(r, 2).file_store(store).timeout(std::chrono::milliseconds(20000)));
    EXPECT_EQ(message_of([&] { g.new_group({0, 2}); }), "[remat::parallel] new_group: rank 2 is outside [0, 2).");
    EXPECT_EQ(message_of([&] { g.new_group({1, 1}); }), "[remat::parallel] new_group: rank 1 is listed twice.");
    const int other = 1 - r;
    errors[r] = message_of([&] { g.new_group({other}); });
    // Both ranks, reversed: rank 1 is rank 0 of the new group.
    auto sub = g.new_group({1, 0});
    EXPECT_EQ(sub.rank(), 1 - r);
    EXPECT_EQ(sub.world_size(), 2);
    // A parameter with a gradient on rank 0 only: the average is half of it on both.
    auto p = torch::zeros({3}, torch::requires_grad());
    auto q = torch::zeros({2}, torch::TensorOptions().dtype(torch::kDouble).requires_grad(true));
    if (r == 0) p.mutable_grad() = torch::tensor({2.0f, 4.0f, 6.0f});
    q.mutable_grad() = torch::full({2}, static_cast<double>(r + 1), torch::kDouble);
    remat::parallel::average_gradients(sub, {p, q});
    grads[r] = torch::cat({p.grad().to(torch::kDouble), q.grad()});
  };
  std::thread t0(rank_body, 0), t1(rank_body, 1);
  t0.join();
  t1.join();
  EXPECT_EQ(errors[0], "[remat::parallel] new_group: rank 0 is not in [1]; only the ranks listed call new_group.");
  EXPECT_EQ(errors[1], "[remat::parallel] new_group: rank 1 is not in [0]; only the ranks listed call new_group.");
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(torch::equal(grads[r], torch::tensor({1.0, 2.0, 3.0, 1.5, 1.5}, torch::kDouble))) << grads[r];
  }
  EXPECT_EQ(message_of([&] { remat::parallel::average_gradients(remat::parallel::ProcessGroup(), {}); }),
            "[remat::parallel] average_gradients on a ProcessGroup that was not joined; use init_process_group().");
  EXPECT_EQ(message_of([&] { remat::parallel::ProcessGroup().new_group({0}); }),
            "[remat::parallel] new_group on a ProcessGroup that was not joined; use init_process_group().");
}
