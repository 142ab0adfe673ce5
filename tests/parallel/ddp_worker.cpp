// One rank of a data-parallel run for test_parallel: a small GPT trained by
// remat::models::Trainer under one checkpoint strategy, its gradients
// synchronised by remat::parallel::DataParallel; writes the parameters
// and the last step's gradients (torch::save of tensor lists, parameters()
// order) and CommStats. SGD by default: parameters then differ by lr x the
// gradients' difference. Exit codes: 0 done, 3 an error (message on stderr),
// 7 killed itself on purpose (--die-at-step).
//
// --model mlp: a small MLP with a frozen input layer and a branch that the
// forward takes on some steps only (--branch-every N: steps 0, N, 2N...),
// plain SGD on a global batch of world x --batch rows split by rank; options
// --find-unused, --eval (after each step, a forward through
// DataParallel::forward under no grad), --seed-by-rank (each rank initialises with its own seed;
// rank 0's is the 1-process seed). Every rank writes its parameters (all,
// frozen included, parameters() order) as initialised (--out
// PREFIX.rankR.own), right after DataParallel's constructor (.init) and
// after the steps (PREFIX.rankR).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <remat/error.h>
#include <remat/models/trainer.h>
#include <remat/optim.h>
#include <remat/parallel/data_parallel.h>

#include "worker_args.h"

namespace {

using worker::arg;
using worker::flag;

/** x -> frozen (no grad) -> tanh -> trunk -> tanh -> head, plus, on the
 *  steps that take it, extra's output added to the head's. */
struct MlpImpl : torch::nn::Module {
  MlpImpl()
      : frozen(register_module("frozen", torch::nn::Linear(8, 8))),
        trunk(register_module("trunk", torch::nn::Linear(8, 16))),
        head(register_module("head", torch::nn::Linear(16, 4))),
        extra(register_module("extra", torch::nn::Linear(16, 4))) {
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  }
  at::Tensor forward(const at::Tensor& x, bool branch) {
    auto h = torch::tanh(trunk(torch::tanh(frozen(x))));  // (B, 16)
    auto y = head(h);                                     // (B, 4)
    return branch ? y + extra(h) : y;
  }
  torch::nn::Linear frozen, trunk, head, extra;
};
TORCH_MODULE(Mlp);

std::vector<at::Tensor> snapshot(torch::nn::Module& m) {
  std::vector<at::Tensor> v;
  for (const auto& p : m.parameters()) v.push_back(p.detach().clone());
  return v;
}

void run_mlp(int argc, char** argv, int rank, int world, const remat::parallel::InitOptions& init) {
  const int64_t batch = std::stoi(arg(argc, argv, "batch", "2"));
  const int steps = std::stoi(arg(argc, argv, "steps", "3"));
  const int branch_every = std::stoi(arg(argc, argv, "branch-every", "1"));
  const double lr = std::stod(arg(argc, argv, "lr", "0.1"));
  const std::string out = arg(argc, argv, "out", "");
  torch::manual_seed(flag(argc, argv, "seed-by-rank") ? 1 + 100 * rank : 1);
  Mlp model;
  const std::string prefix = out + ".rank" + std::to_string(rank);
  if (!out.empty()) torch::save(snapshot(*model), prefix + ".own");
  auto group = remat::parallel::init_process_group(init);
  remat::parallel::DataParallel ddp(
      model.ptr(), group,
      remat::parallel::DataParallelOptions().find_unused_parameters(flag(argc, argv, "find-unused")));
  if (!out.empty()) torch::save(snapshot(*model), prefix + ".init");
  // --step-in-backward (with momentum, so that state matters): the Reducer
  // averages at the end of backward, so the updates are left to opt.step()
  // and the result must not change.
  const bool in_bw = flag(argc, argv, "step-in-backward");
  const bool eval = flag(argc, argv, "eval");
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(lr).momentum(in_bw ? 0.9 : 0.0));
  std::optional<remat::StepInBackward> in_backward;
  if (in_bw) in_backward.emplace(opt);
  for (int step = 0; step < steps; ++step) {
    // The same global batch on every rank and in the 1-process run; each rank takes its rows.
    auto gen = at::detail::createCPUGenerator(1000 + step);
    auto x = torch::randn({world * batch, 8}, gen).slice(0, rank * batch, (rank + 1) * batch);  // (B, 8)
    auto t = torch::randn({world * batch, 4}, gen).slice(0, rank * batch, (rank + 1) * batch);  // (B, 4)
    opt.zero_grad();
    const bool branch = step % branch_every == 0;
    auto loss = ddp.forward([&] { return (model->forward(x, branch) - t).square().mean(); });
    loss.backward();
    opt.step();
    if (eval) {  // an evaluation through DataParallel's forward, under no grad
      torch::NoGradGuard no_grad;
      (void)ddp.forward([&] { return (model->forward(x, branch) - t).square().mean(); }).item<double>();
    }
  }
  if (in_backward && (in_backward->stats().deferred == 0 || in_backward->stats().updates != 0)) {
    std::fprintf(stderr, "ddp_worker: DataParallel's parameters were not left to opt.step(): %s\n",
                 in_backward->describe().c_str());
    std::exit(3);
  }
  if (!out.empty()) torch::save(snapshot(*model), prefix);
}

}  // namespace

int main(int argc, char** argv) {
  const int rank = std::stoi(arg(argc, argv, "rank", "0"));
  const int world = std::stoi(arg(argc, argv, "world", "1"));
  const int die_at = std::stoi(arg(argc, argv, "die-at-step", "0"));
  const std::string out = arg(argc, argv, "out", "");
  try {
    if (arg(argc, argv, "model", "gpt") == "mlp") {
      run_mlp(argc, argv, rank, world,
              remat::parallel::InitOptions(rank, world)
                  .master_port(std::stoi(arg(argc, argv, "port", "29500")))
                  .file_store(arg(argc, argv, "file-store", ""))
                  .timeout(std::chrono::milliseconds(std::stoi(arg(argc, argv, "timeout-ms", "60000")))));
      return 0;
    }
    remat::models::TrainConfig cfg;
    cfg.model = "gpt";
    cfg.layers = 4;
    cfg.d_model = 64;
    cfg.heads = 4;
    cfg.seq_len = 32;
    cfg.batch = std::stoi(arg(argc, argv, "batch", "2"));
    cfg.grad_accum = std::stoi(arg(argc, argv, "grad-accum", "1"));
    cfg.steps = std::stoi(arg(argc, argv, "steps", "3"));
    cfg.threads = 1;
    cfg.optimizer = arg(argc, argv, "optimizer", "sgd");
    cfg.lr = std::stod(arg(argc, argv, "lr", "0.05"));
    cfg.checkpoint = remat::models::parse_strategy(arg(argc, argv, "strategy", "none"));
    // auto: a budget well under the plain chain's peak, so stages are recomputed.
    if (cfg.checkpoint == remat::models::Strategy::kAuto) cfg.memory_budget_bytes = int64_t{1} << 20;
    cfg.data_rank = rank;
    cfg.data_world = world;
    remat::models::Trainer trainer(cfg);

    auto init = remat::parallel::InitOptions(rank, world)
                    .master_port(std::stoi(arg(argc, argv, "port", "29500")))
                    .file_store(arg(argc, argv, "file-store", ""))
                    .timeout(std::chrono::milliseconds(std::stoi(arg(argc, argv, "timeout-ms", "60000"))));
    auto group = remat::parallel::init_process_group(init);
    remat::parallel::DataParallel ddp(trainer.module(), group,
                                      remat::parallel::DataParallelOptions()
                                          .bucket_cap_bytes(std::stoll(arg(argc, argv, "bucket-cap", "65536")))
                                          .first_bucket_cap_bytes(16384));
    remat::models::StepHooks hooks;
    hooks.before_forward = [&] { ddp.prepare_for_forward(); };
    hooks.before_backward = [&](const at::Tensor& loss, bool sync) {
      if (die_at > 0 && rank == world - 1 && trainer.steps_done() + 1 == die_at) std::_Exit(7);
      if (sync) ddp.prepare_for_backward({loss});
    };
    trainer.set_step_hooks(hooks);
    while (trainer.steps_done() < cfg.steps) trainer.step();
    const auto stats = ddp.last_stats();
    // The group's own collectives: a barrier, then a sum of rank + 1 over the ranks.
    group.barrier();
    at::Tensor sum = torch::full({2}, static_cast<double>(rank + 1));
    group.all_reduce_sum(sum);
    if (!out.empty()) {
      std::vector<at::Tensor> params, grads;  // grads: the last step's, synchronised
      for (const auto& p : trainer.module()->parameters()) {
        params.push_back(p.detach().clone());
        grads.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
      }
      torch::save(params, out);
      torch::save(grads, out + ".grad");
      std::ofstream(out + ".stats") << stats.buckets << " " << stats.bytes << " " << stats.allreduce_ms << " "
                                    << stats.exposed_ms << " " << stats.overlap << " " << sum[0].item<double>() << "\n";
    }
  } catch (const std::exception& e) {
    const auto* c = dynamic_cast<const c10::Error*>(&e);
    std::cerr << "ddp_worker rank " << rank << ": " << (c ? c->what_without_backtrace() : e.what()) << "\n";
    return 3;
  }
  return 0;
}
