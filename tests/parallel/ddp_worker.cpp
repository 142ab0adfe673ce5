// One rank of a data-parallel run for test_parallel: a small GPT trained by
// remat::models::Trainer under one checkpoint strategy, its gradients
// synchronised by remat::parallel::DataParallel; writes the parameters
// and the last step's gradients (torch::save of tensor lists, parameters()
// order) and CommStats. SGD by default: parameters then differ by lr x the
// gradients' difference. Exit codes: 0 done, 3 an error (message on stderr),
// 7 killed itself on purpose (--die-at-step).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/serialize.h>
#include <torch/types.h>

#include <remat/error.h>
#include <remat/models/trainer.h>
#include <remat/parallel/data_parallel.h>

namespace {

std::string arg(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (argv[i] == "--" + name) return argv[i + 1];
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) {
  const int rank = std::stoi(arg(argc, argv, "rank", "0"));
  const int world = std::stoi(arg(argc, argv, "world", "1"));
  const int die_at = std::stoi(arg(argc, argv, "die-at-step", "0"));
  const std::string out = arg(argc, argv, "out", "");
  try {
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
