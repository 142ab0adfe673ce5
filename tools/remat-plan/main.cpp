// remat-plan: reads a chain as JSON (file or stdin), plans a checkpoint
// schedule with one of remat::plan's algorithms and prints the prediction and
// the schedule as a table or as JSON; also the time/peak frontier and Revolve's
// homogeneous model. Leaves out running anything: it only plans.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "remat/plan/plan.h"

namespace rp = remat::plan;
using nlohmann::json;

namespace {

constexpr int kExitInfeasible = 1;
constexpr int kExitBadInput = 2;

std::string read_all(std::istream& in) {
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

json prediction_json(const rp::Prediction& p) {
  return {{"peak_bytes", p.peak_bytes},
          {"time_ms", p.time_ms},
          {"forward_executions", p.forward_executions},
          {"forwards_per_stage", p.forwards_per_stage}};
}

void print_table(const rp::Chain& chain, const rp::Plan& plan, int64_t budget_bytes, const char* scope) {
  const rp::Prediction& p = plan.prediction;
  std::printf("algorithm  %s\n", plan.algorithm.c_str());
  if (scope) std::printf("scope      %s schedules\n", scope);
  if (budget_bytes >= 0)
    std::printf("budget     %s (%lld bytes)\n", rp::format_bytes(budget_bytes).c_str(),
                static_cast<long long>(budget_bytes));
  std::printf("peak       %s (%lld bytes)\n", rp::format_bytes(p.peak_bytes).c_str(),
              static_cast<long long>(p.peak_bytes));
  std::printf("time       %.3f ms\n", p.time_ms);
  if (plan.optimality_gap_ms >= 0)
    std::printf("gap        <= %.3f ms (%.2f%%) from the exact optimum; lower bound %.3f ms; unit %lld bytes\n",
                plan.optimality_gap_ms, 100 * plan.relative_gap(), plan.lower_bound_ms,
                static_cast<long long>(plan.memory_unit_bytes));
  std::printf("forwards   %lld (per stage:", static_cast<long long>(p.forward_executions));
  for (int f : p.forwards_per_stage) std::printf(" %d", f);
  std::printf(")\n\n%5s  %-13s %5s  %-16s %14s\n", "#", "op", "stage", "name", "live bytes");
  for (size_t k = 0; k < plan.schedule.ops.size(); ++k) {
    const rp::Op& op = plan.schedule.ops[k];
    const std::string name =
        op.kind == rp::OpKind::kDrop ? "a_" + std::to_string(op.stage) : chain.stages[op.stage].name;
    std::printf("%5zu  %-13s %5d  %-16s %14lld\n", k, rp::op_kind_name(op.kind), op.stage, name.c_str(),
                static_cast<long long>(p.op_bytes[k]));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "remat-plan: plan gradient-checkpointing schedules for a chain of stages.\n\n"
      "The chain is JSON, from CHAIN or stdin:\n"
      "  {\"input_bytes\": N, \"stages\": [{\"name\": \"...\", \"forward_ms\": f, \"backward_ms\": b,\n"
      "    \"output_bytes\": x, \"saved_bytes\": a, \"forward_tmp_bytes\": t (optional),\n"
      "    \"backward_tmp_bytes\": u, \"plain_forward_tmp_bytes\": p, \"backward_freed_bytes\": r,\n"
      "    \"shared_input_bytes\": h, \"output_grad_bytes\": g, \"recompute_ms\": c (each optional)}, ...]}\n"
      "saved_bytes includes the stage's output and excludes its input (see docs/planner.md).\n\n"
      "Output: the prediction (peak_bytes, time_ms, forward_executions, forwards_per_stage)\n"
      "and the schedule (ops forward, forward_save, backward, drop with their stage) as a\n"
      "table, or with --json as {\"algorithm\", \"budget_bytes\", \"scope\" (optimal: all or persistent\n"
      "schedules searched), \"prediction\", \"schedule\"}; for optimal also \"lower_bound_ms\",\n"
      "\"optimality_gap_ms\" (the most the plan can be slower than the exact optimum of its scope)\n"
      "and \"memory_unit_bytes\" (bytes per slot of the DP's finest discretization).\n\n"
      "Homogeneous mode: --steps L --slots C plans L unit steps in Revolve's model (C checkpoint\n"
      "slots, the chain input occupying one) and reports forward_executions, which includes\n"
      "the L forwards that precede each step's backward.\n\n"
      "Exit codes: 0 ok, 1 no schedule fits the budget, 2 bad input or flags."};
  // REMAT_VERSION: the project's CMake version; REMAT_TORCH_VERSION: the
  // LibTorch the rest of this build (the remat runtime) was built against
  // (CMakeLists.txt); remat-plan itself is torch-free.
#ifdef REMAT_TORCH_VERSION
  app.set_version_flag("--version",
                       "remat-plan, remat " REMAT_VERSION "\nLibTorch " REMAT_TORCH_VERSION
                       " (remat's runtime in this build; remat-plan itself does not use LibTorch)",
                       "print remat's version and LibTorch's, then exit");
#else
  app.set_version_flag("--version",
                       "remat-plan, remat " REMAT_VERSION "\nLibTorch: none (a planner-only build, REMAT_PLAN_ONLY)",
                       "print remat's version and LibTorch's, then exit");
#endif
  std::string chain_path = "-";
  std::string algorithm = "optimal";
  std::string budget_text;
  std::string scope_text = "auto";
  bool as_json = false, want_pareto = false;
  int points = 24, memory_slots = 500, steps = 0, slots = 0;
  app.add_option("chain", chain_path, "chain JSON file; '-' or absent reads stdin");
  app.add_option("-a,--algorithm", algorithm,
                 "optimal | greedy | sqrt | uniform:K | revolve:S | store-all (default optimal; "
                 "optimal and greedy need --budget-bytes)");
  app.add_option("-b,--budget-bytes", budget_text,
                 "memory budget: bytes, or with a unit: 512MiB, 2GiB, 1.5GB, 64k (KiB/MiB/GiB and K/M/G are "
                 "powers of 1024, kB/MB/GB of 1000)");
  app.add_flag("--json", as_json, "print JSON instead of a table");
  app.add_flag("--pareto", want_pareto,
               "print the time/peak frontier of optimal over budgets from the smallest feasible peak to the "
               "store-all peak");
  app.add_option("--points", points, "budgets tried by --pareto (default 24)")->check(CLI::Range(2, 10000));
  app.add_option("--memory-slots", memory_slots,
                 "optimal's first discretization (default 500); refined while the gap bound is large")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--scope", scope_text,
                 "schedules optimal searches: all (exact over every schedule; O(L^4 M)), persistent "
                 "(checkpoints kept until their backward, rotor's class; O(L^3 M)), or auto (all while it "
                 "stays cheap, about L <= 83 at 500 slots; the default)");
  auto* steps_opt =
      app.add_option("--steps", steps, "homogeneous mode: number of unit steps L")->check(CLI::Range(1, 100000));
  auto* slots_opt = app.add_option("--slots", slots, "homogeneous mode: checkpoint slots C, a_0 included")
                        ->check(CLI::Range(1, 100000));
  steps_opt->needs(slots_opt);
  slots_opt->needs(steps_opt);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return kExitBadInput;
  }

  int64_t budget_bytes = -1;
  rp::OptimalScope scope = rp::OptimalScope::kAuto;
  rp::Chain chain;
  try {
    if (!budget_text.empty()) budget_bytes = rp::parse_bytes(budget_text);
    scope = rp::parse_optimal_scope(scope_text);
    if (steps > 0) {
      if (want_pareto) throw rp::Error("[remat::plan] remat-plan: --pareto does not apply to --steps/--slots.");
      rp::HomogeneousProblem h = rp::homogeneous_problem(steps, slots);
      chain = h.chain;
      const rp::SolveOptions o = rp::parse_algorithm(algorithm);
      if (o.algorithm != rp::Algorithm::kRevolve && o.algorithm != rp::Algorithm::kOptimal)
        throw rp::Error("[remat::plan] remat-plan: --steps/--slots takes --algorithm revolve or optimal.");
      if (o.algorithm == rp::Algorithm::kRevolve && algorithm != "revolve" && o.param != slots)
        throw rp::Error("[remat::plan] remat-plan: " + algorithm + " contradicts --slots " + std::to_string(slots) +
                        ".");
      const bool is_revolve = o.algorithm == rp::Algorithm::kRevolve;
      rp::Plan plan = is_revolve ? rp::revolve(chain, slots) : rp::optimal(chain, h.budget_bytes, memory_slots, scope);
      const int64_t fwd = plan.prediction.forward_executions;
      if (as_json) {
        json j = {{"steps", steps},
                  {"slots", slots},
                  {"algorithm", is_revolve ? "revolve" : "optimal"},
                  {"forward_executions", fwd},
                  {"recomputations", fwd - steps},
                  {"prediction", prediction_json(plan.prediction)}};
        std::cout << j.dump(2) << "\n";
      } else {
        std::printf(
            "steps              %d\nslots              %d\nalgorithm          %s\n"
            "forward_executions %lld (%lld recomputations)\n",
            steps, slots, is_revolve ? "revolve" : "optimal", static_cast<long long>(fwd),
            static_cast<long long>(fwd - steps));
      }
      return 0;
    }
    std::string text;
    if (chain_path == "-") {
      text = read_all(std::cin);
    } else {
      std::ifstream in(chain_path);
      if (!in) throw rp::Error("[remat::plan] remat-plan: cannot read chain file \"" + chain_path + "\".");
      text = read_all(in);
    }
    chain = rp::chain_from_json(text);
  } catch (const rp::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return kExitBadInput;
  }

  try {
    if (want_pareto) {
      const auto front = rp::pareto(chain, points, memory_slots, scope);
      if (as_json) {
        json arr = json::array();
        for (const auto& p : front)
          arr.push_back({{"budget_bytes", p.budget_bytes},
                         {"peak_bytes", p.plan.prediction.peak_bytes},
                         {"time_ms", p.plan.prediction.time_ms},
                         {"forward_executions", p.plan.prediction.forward_executions}});
        std::cout << json{{"frontier", arr}}.dump(2) << "\n";
      } else {
        std::printf("%-12s %-12s %12s %9s\n", "budget", "peak", "time_ms", "forwards");
        for (const auto& p : front)
          std::printf("%-12s %-12s %12.3f %9lld\n", rp::format_bytes(p.budget_bytes).c_str(),
                      rp::format_bytes(p.plan.prediction.peak_bytes).c_str(), p.plan.prediction.time_ms,
                      static_cast<long long>(p.plan.prediction.forward_executions));
      }
      return 0;
    }
    rp::SolveOptions options = rp::parse_algorithm(algorithm);
    options.with_budget_bytes(budget_bytes).with_memory_slots(memory_slots).with_scope(scope);
    if ((options.algorithm == rp::Algorithm::kOptimal || options.algorithm == rp::Algorithm::kGreedy) &&
        budget_bytes < 0) {
      std::fprintf(stderr, "[remat::plan] remat-plan: --algorithm %s needs --budget-bytes.\n", algorithm.c_str());
      return kExitBadInput;
    }
    const rp::Plan plan = rp::solve(chain, options);
    // Which schedules optimal searched: all, or rotor's persistent class.
    const char* scope_name = options.algorithm == rp::Algorithm::kOptimal
                                 ? rp::optimal_scope_name(rp::optimal_scope(chain, budget_bytes, memory_slots, scope))
                                 : nullptr;
    if (as_json) {
      json j = json::parse(rp::plan_to_json(chain, plan));
      if (budget_bytes >= 0) j["budget_bytes"] = budget_bytes;
      if (scope_name) j["scope"] = scope_name;
      std::cout << j.dump(2) << "\n";
    } else {
      print_table(chain, plan, budget_bytes, scope_name);
    }
  } catch (const rp::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    const std::string what = e.what();
    const bool infeasible = what.find("fits in") != std::string::npos;
    return infeasible ? kExitInfeasible : kExitBadInput;
  }
  return 0;
}
