// Consumer check, built against the installed package with every exported
// library target: remat::remat (a checkpointed MLP layer and a planned
// chain), remat::models (a small GPT, its blocks switched to checkpointing)
// and remat::parallel (DataParallel and FullyShard on a one-process group);
// exit 0 when every result matches its plain run. tests/consumer_subdir
// builds it with REMAT_CONSUMER_RUNTIME_ONLY: remat::remat alone.
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <string>

#include <remat/remat.h>
#include <remat/sequential.h>
#include <torch/torch.h>

#ifndef REMAT_CONSUMER_RUNTIME_ONLY  // tests/consumer_subdir: remat::remat alone
#include <remat/models/gpt.h>
#include <remat/parallel/data_parallel.h>
#include <remat/parallel/fully_shard.h>
#endif

namespace {

bool report(const char* what, bool ok) {
  std::printf("consumer: %s: %s\n", what, ok ? "matches the plain run" : "DIFFERS from the plain run");
  return ok;
}

// remat::remat: checkpoint_sequential and CheckpointedSequential against plain.
bool runtime() {
  torch::manual_seed(0);
  torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Tanh());
  auto x = torch::randn({4, 8}, torch::requires_grad());
  seq->forward(x).square().sum().backward();
  auto plain = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  remat::checkpoint_sequential(seq, 2, x).square().sum().backward();
  auto ckpt = x.grad().clone();
  x.mutable_grad() = torch::Tensor();
  remat::CheckpointedSequential net(seq, remat::SequentialOptions().algorithm("revolve:2"));
  net->forward(x).square().sum().backward();
  return report("remat::remat", torch::equal(plain, ckpt) && torch::equal(plain, x.grad()));
}

#ifndef REMAT_CONSUMER_RUNTIME_ONLY
// remat::models: a small GPT's loss, plain and with every block checkpointed.
bool models() {
  remat::models::GptConfig c;
  c.vocab = 16;
  c.seq_len = 8;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 2;
  torch::manual_seed(0);
  remat::models::Gpt gpt(c);
  const auto idx = torch::randint(c.vocab, {2, c.seq_len});
  auto grad = [&] {
    gpt->zero_grad();
    gpt->loss(gpt->blocks->forward(gpt->embed(idx)), idx).backward();
    return gpt->wte->weight.grad().clone();
  };
  const auto plain = grad();
  const int64_t on = remat::enable_checkpointing(gpt, remat::select::type<remat::models::GptBlockImpl>());
  return report("remat::models", on == c.layers && torch::equal(plain, grad()));
}

// remat::parallel: one process, so the averaged gradients are the plain ones:
// one SGD step, plain and through DataParallel and FullyShard, same weights.
bool parallel() {
  const auto dir = std::filesystem::temp_directory_path() / ("remat-consumer-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto group =
      remat::parallel::init_process_group(remat::parallel::InitOptions(0, 1).file_store((dir / "store").string()));
  torch::manual_seed(0);
  torch::nn::Linear plain_net(8, 4), ddp_net(8, 4), fsdp_net(8, 4);
  {
    torch::NoGradGuard no_grad;
    for (auto* n : {&ddp_net, &fsdp_net}) {
      (*n)->weight.copy_(plain_net->weight);
      (*n)->bias.copy_(plain_net->bias);
    }
  }
  const auto x = torch::randn({4, 8});
  torch::optim::SGD plain_opt(plain_net->parameters(), 0.1);
  plain_net->forward(x).square().sum().backward();
  plain_opt.step();

  remat::parallel::DataParallel ddp(ddp_net.ptr(), group);
  torch::optim::SGD ddp_opt(ddp_net->parameters(), 0.1);
  ddp.forward([&] { return ddp_net->forward(x).square().sum(); }).backward();
  ddp_opt.step();
  const bool ddp_ok = torch::allclose(plain_net->weight, ddp_net->weight);

  remat::parallel::FullyShard fsdp(fsdp_net.ptr(), group);
  torch::optim::SGD fsdp_opt(fsdp.parameters(), 0.1);
  fsdp.forward([&] { return fsdp_net->forward(x).square().sum(); }).backward();
  fsdp_opt.step();
  const std::string saved = (dir / "full.pt").string();
  fsdp.save_full(saved);
  torch::nn::Linear loaded(8, 4);
  torch::load(loaded, saved);
  const bool fsdp_ok = torch::allclose(plain_net->weight, loaded->weight);
  std::filesystem::remove_all(dir);
  const bool a = report("remat::parallel DataParallel", ddp_ok);
  return report("remat::parallel FullyShard", fsdp_ok) && a;
}
#endif

}  // namespace

int main() {
#ifdef REMAT_CONSUMER_RUNTIME_ONLY
  return runtime() ? 0 : 1;
#else
  const bool a = runtime(), b = models(), c = parallel();
  return a && b && c ? 0 : 1;
#endif
}
