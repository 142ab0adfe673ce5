// bench/auto/workload.h: the whole training step that remat_auto and
// remat_auto_levers plan (docs/BENCHMARKS.md, "Whole training step under a
// budget"): the sizes, the model with its optimizer and step, and the size
// record of their result files.
// --model gpt: the reference GPT (token + position embedding, explicit
// attention, final LayerNorm, LM head tied to the embedding, mean
// cross-entropy), AdamW lr 1e-3. --model resnet: remat's ResNet (BatchNorm),
// cross-entropy, SGD with momentum 0.9 (lr 0.01). Gradients zeroed in place
// (zero_grad(false)); data: random, a new batch per step from a generator
// of the step's own.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "bench.h"

#include <torch/torch.h>

#include <remat/models/gpt.h>
#include <remat/models/resnet.h>
#include <remat/offload.h>

namespace bench::auto_step {

struct Size {
  int64_t d_model, heads, blocks, seq_len, batch, vocab;
};
constexpr Size kReference{512, 8, 8, 512, 4, 8192};  // the CPU reference GPT
constexpr Size kQuick{64, 4, 4, 64, 4, 512};         // a toy size for smoke runs
struct ImageSize {
  int64_t depth, width, image, batch, classes;
};
constexpr ImageSize kResNet{18, 32, 32, 100, 10};
constexpr ImageSize kResNetQuick{10, 8, 16, 8, 10};

/** A model, its optimizer and one training step of it. */
struct Net {
  std::shared_ptr<torch::nn::Module> module;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::function<void()> step;
};

/** The GPT (gpt_model) or the ResNet, parameters from seed 0, batches from
 *  a generator seeded with data_seed. */
inline Net make_net(bool gpt_model, const Size& size, const ImageSize& isize, uint64_t data_seed) {
  torch::manual_seed(0);
  Net n;
  auto gen = std::make_shared<at::Generator>(at::detail::createCPUGenerator(data_seed));
  if (gpt_model) {
    remat::models::GptConfig c;
    c.vocab = size.vocab;
    c.seq_len = size.seq_len;
    c.d_model = size.d_model;
    c.heads = size.heads;
    c.layers = size.blocks;
    remat::models::Gpt gpt(c);
    n.module = gpt.ptr();
    n.opt = std::make_unique<torch::optim::AdamW>(gpt->parameters(), torch::optim::AdamWOptions(1e-3));
    auto* opt = n.opt.get();
    n.step = [gpt, opt, gen, size]() mutable {
      auto idx = torch::randint(size.vocab, {size.batch, size.seq_len + 1}, *gen, torch::kLong);
      auto x = idx.slice(1, 0, size.seq_len), y = idx.slice(1, 1, size.seq_len + 1);
      opt->zero_grad(false);
      gpt->loss(gpt->blocks->forward(gpt->embed(x)), y).backward();
      opt->step();
    };
  } else {
    remat::models::ResNetConfig c;
    c.depth = isize.depth;
    c.width = isize.width;
    c.classes = isize.classes;
    remat::models::ResNet resnet(c);
    n.module = resnet.ptr();
    n.opt = std::make_unique<torch::optim::SGD>(resnet->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    auto* opt = n.opt.get();
    n.step = [resnet, opt, gen, isize]() mutable {
      auto x = torch::randn({isize.batch, 3, isize.image, isize.image}, *gen);
      auto y = torch::randint(isize.classes, {isize.batch}, *gen, torch::kLong);
      opt->zero_grad(false);
      torch::nn::functional::cross_entropy(resnet->forward(x), y).backward();
      opt->step();
    };
  }
  return n;
}

/** What both programs read from their command line: --model gpt|resnet
 *  (exits 2 otherwise), --quick, --rounds (3; 2 quick), --budgets (8),
 *  --out (stem + ".json", or "-quick.json"), --threads (1, set here). */
struct Settings {
  bool quick = false, gpt_model = true;
  Size size = kReference;
  ImageSize isize = kResNet;
  int rounds = 3, budgets = 8;
  std::string out_path;
};
inline Settings settings(int argc, char** argv, const char* program, const std::string& gpt_stem,
                         const std::string& resnet_stem) {
  Settings s;
  s.quick = flag(argc, argv, "--quick");
  const std::string model = arg(argc, argv, "--model", "gpt");
  if (model != "gpt" && model != "resnet") {
    std::fprintf(stderr, "%s: --model must be gpt or resnet, got '%s'\n", program, model.c_str());
    std::exit(2);
  }
  s.gpt_model = model == "gpt";
  s.size = s.quick ? kQuick : kReference;
  s.isize = s.quick ? kResNetQuick : kResNet;
  s.rounds = static_cast<int>(int_arg(argc, argv, "--rounds", s.quick ? "2" : "3"));
  s.budgets = static_cast<int>(int_arg(argc, argv, "--budgets", "8"));
  s.out_path = arg(argc, argv, "--out", (s.gpt_model ? gpt_stem : resnet_stem) + (s.quick ? "-quick.json" : ".json"));
  torch::set_num_threads(static_cast<int>(int_arg(argc, argv, "--threads", "1")));
  return s;
}

/** The disk store of both programs: files in dir, --offload-inflight-kib
 *  (16384) in flight. */
inline remat::OffloadOptions disk_store(int argc, char** argv, const std::string& dir) {
  return remat::OffloadOptions(remat::OffloadTarget::kDisk)
      .directory(dir)
      .max_inflight_bytes(int_arg(argc, argv, "--offload-inflight-kib", "16384") << 10);
}

/** The meta record's ", \"size\": {...}" of the step. */
inline void write_size(std::ostream& out, bool gpt_model, const Size& size, const ImageSize& isize) {
  if (gpt_model) {
    out << ", \"size\": {\"d_model\": " << size.d_model << ", \"heads\": " << size.heads
        << ", \"blocks\": " << size.blocks << ", \"seq_len\": " << size.seq_len << ", \"batch\": " << size.batch
        << ", \"vocab\": " << size.vocab << "}";
  } else {
    out << ", \"size\": {\"depth\": " << isize.depth << ", \"width\": " << isize.width << ", \"image\": " << isize.image
        << ", \"batch\": " << isize.batch << ", \"classes\": " << isize.classes << "}";
  }
}

}  // namespace bench::auto_step
