// remat-train: trains a GPT (character level on a text file) or a ResNet
// (synthetic images) under one checkpoint strategy and prints a line per step.
// This file only parses flags; the loop is remat::models::Trainer.
// Leaves out: evaluation, sampling text, learning-rate schedules.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <iostream>
#include <string>

#include <c10/util/Exception.h>

#include <remat/error.h>
#include <remat/models/trainer.h>
#include <remat/plan/error.h>

namespace {

int fail(const std::string& what) {
  std::cerr << "remat-train: error: " << what.substr(0, what.find('\n')) << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"remat-train: train a GPT or ResNet with activation checkpointing (remat)"};
  remat::models::TrainConfig cfg;
  std::string checkpoint = "none", budget, seq_cap, batch_cap;
  int64_t fit_step = 1;
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
  app.add_option("--seed", cfg.seed, "seed of parameters, dropout and data")->capture_default_str();
  app.add_option("--checkpoint", checkpoint, "none, block, sqrt, selective or auto")
      ->check(CLI::IsMember({"none", "block", "sqrt", "selective", "auto"}))
      ->capture_default_str();
  app.add_option("--policy", cfg.policy,
                 "with --checkpoint selective: megatron (GPT default), save_matmuls (ResNet default), "
                 "save_nothing or attention")
      ->check(CLI::IsMember({"megatron", "save_matmuls", "save_nothing", "attention"}));
  bool explain_memory = false;
  app.add_flag("--explain-memory", explain_memory,
               "print what one block saves for backward (op, name, shape, bytes; with the policy) and exit");
  app.add_option("--memory-budget", budget, "activation budget for --checkpoint auto, e.g. 512MiB, 2GiB, 1000000");
  app.add_option("--max-seq-len-under", seq_cap,
                 "GPT: find the longest --seq-len whose step peaks at or under this (e.g. 1GiB): predicted, then "
                 "measured");
  app.add_option("--max-batch-under", batch_cap, "GPT: the same for --batch");
  app.add_option("--fit-step", fit_step, "granularity of --max-*-under (tokens or sequences)")->capture_default_str();
  app.add_option("--grad-accum", cfg.grad_accum, "micro-batches per optimizer step")->capture_default_str();
  app.add_option("--clip-norm", cfg.clip_norm, "max global gradient norm (0: off)")->capture_default_str();
  app.add_flag("--bf16", cfg.bf16, "forward under CPU autocast to bfloat16");
  app.add_option("--data", cfg.data_path, "text file for the GPT")->capture_default_str();
  app.add_option("--threads", cfg.threads, "torch intra-op threads")->capture_default_str();
  app.add_option("--save", cfg.save_path, "write a checkpoint here at the end (atomically)");
  app.add_option("--resume", cfg.resume_path, "continue from a checkpoint written by --save");
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(std::string(e.what()) + " (run remat-train --help for the flags)");
  }
  try {
    cfg.checkpoint = remat::models::parse_strategy(checkpoint);
    if (!budget.empty()) cfg.memory_budget_bytes = remat::plan::parse_bytes(budget);
    if (!seq_cap.empty() || !batch_cap.empty()) {
      if (!seq_cap.empty() && !batch_cap.empty()) {
        return fail(
            "[remat::train] give one of --max-seq-len-under and --max-batch-under (the other value stays fixed).");
      }
      if (!budget.empty()) {
        return fail(
            "[remat::train] --memory-budget is chosen by --max-*-under for --checkpoint auto (the largest whose "
            "whole step fits the cap); drop --memory-budget.");
      }
      remat::models::FitOptions fit;
      fit.dimension = seq_cap.empty() ? remat::models::FitDimension::kBatch : remat::models::FitDimension::kSeqLen;
      const std::string flag = seq_cap.empty() ? "--max-batch-under" : "--max-seq-len-under";
      try {
        fit.cap_bytes = remat::plan::parse_bytes(seq_cap.empty() ? batch_cap : seq_cap);
      } catch (const remat::Error& e) {
        return fail("[remat::train] " + flag + ": " + e.what());
      }
      fit.step = fit_step;
      if (cfg.checkpoint == remat::models::Strategy::kAuto) cfg.memory_budget_bytes = fit.cap_bytes;
      std::cout << remat::models::Trainer(cfg).summary() << "\n";
      const auto r = remat::models::max_under(cfg, fit, &std::cout);
      std::cout << remat::models::format_fit(r, cfg);
      return 0;
    }
    remat::models::Trainer trainer(cfg);
    if (explain_memory) {
      std::cout << trainer.summary() << "\n" << trainer.explain_memory();
      return 0;
    }
    trainer.run(&std::cout);
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
