// Runs the built remat-plan (path from REMAT_PLAN_EXE) on good and bad input:
// exit codes 0/1/2, JSON key names, homogeneous mode. Leaves out the table
// layout beyond a few anchors.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>
#include <tuple>

#include <nlohmann/json.hpp>

namespace {

struct CliRun {
  int code;
  std::string out;
};

CliRun run(const std::string& args, const std::string& stdin_text = "") {
  // Per process: ctest -j runs the Cli tests in parallel processes.
  const std::string in = ::testing::TempDir() + "remat_plan_cli_stdin_" + std::to_string(::getpid()) + ".json";
  std::ofstream(in) << stdin_text;
  const std::string cmd = std::string(REMAT_PLAN_EXE) + " " + args + " < " + in + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = pclose(p);
  std::remove(in.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

const char* kChain = R"({"input_bytes": 1048576, "stages": [
  {"name": "conv1", "forward_ms": 1.5, "backward_ms": 3, "output_bytes": 4194304, "saved_bytes": 8388608},
  {"name": "relu1", "forward_ms": 0.2, "backward_ms": 0.3, "output_bytes": 4194304, "saved_bytes": 4194304},
  {"name": "conv2", "forward_ms": 2.0, "backward_ms": 4, "output_bytes": 2097152, "saved_bytes": 6291456,
   "forward_tmp_bytes": 1048576},
  {"name": "relu2", "forward_ms": 0.1, "backward_ms": 0.2, "output_bytes": 2097152, "saved_bytes": 2097152},
  {"name": "fc", "forward_ms": 0.5, "backward_ms": 1, "output_bytes": 4096, "saved_bytes": 2101248,
   "backward_tmp_bytes": 65536}]})";

}  // namespace

TEST(Cli, PlansFromStdinAsJson) {
  const CliRun r = run("--algorithm optimal --budget-bytes 20MiB --json", kChain);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["algorithm"], "optimal");
  EXPECT_EQ(j["budget_bytes"], 20971520);
  for (const char* key : {"peak_bytes", "time_ms", "forward_executions", "forwards_per_stage"})
    EXPECT_TRUE(j["prediction"].contains(key)) << key;
  EXPECT_LE(j["prediction"]["peak_bytes"].get<int64_t>(), 20971520);
  // The bound on the gap to the exact optimum: 500 slots of 40 KiB (sizes are
  // multiples of 4 KiB), and the schedule of the sizes rounded down fits, so
  // it is optimal: 0.
  EXPECT_EQ(j["optimality_gap_ms"], 0.0);
  EXPECT_EQ(j["lower_bound_ms"], j["prediction"]["time_ms"]);
  EXPECT_EQ(j["memory_unit_bytes"], 40960);
  EXPECT_EQ(j["prediction"]["forwards_per_stage"].size(), 5u);
  ASSERT_FALSE(j["schedule"].empty());
  for (const auto& op : j["schedule"]) {
    const std::string name = op["op"];
    EXPECT_TRUE(name == "forward" || name == "forward_save" || name == "backward" || name == "drop") << name;
    EXPECT_TRUE(op.contains("stage"));
  }
}

TEST(Cli, FileTableAndAlgorithms) {
  const std::string path = ::testing::TempDir() + "remat_plan_cli_chain_" + std::to_string(::getpid()) + ".json";
  std::ofstream(path) << kChain;
  for (const char* alg : {"store-all", "sqrt", "uniform:2", "revolve:2"}) {
    const CliRun r = run(path + " --algorithm " + alg);
    EXPECT_EQ(r.code, 0) << alg << r.out;
    EXPECT_NE(r.out.find("forward_save"), std::string::npos) << alg;
    EXPECT_NE(r.out.find("peak"), std::string::npos) << alg;
    EXPECT_EQ(r.out.find("gap "), std::string::npos) << alg;  // only optimal has a bound
    const CliRun js = run(path + " --json --algorithm " + alg);
    EXPECT_FALSE(nlohmann::json::parse(js.out).contains("optimality_gap_ms")) << alg;
  }
  // A first discretization of 3 slots: the bound is still consistent.
  const CliRun o = run(path + " --json --budget-bytes 19MiB --memory-slots 3");
  ASSERT_EQ(o.code, 0) << o.out;
  const auto oj = nlohmann::json::parse(o.out);
  EXPECT_GE(oj["optimality_gap_ms"].get<double>(), 0);
  EXPECT_NEAR(oj["lower_bound_ms"].get<double>() + oj["optimality_gap_ms"].get<double>(),
              oj["prediction"]["time_ms"].get<double>(), 1e-9);
  const CliRun t = run(path + " --budget-bytes 20MiB");
  EXPECT_NE(t.out.find("\ngap        <= 0.000 ms (0.00%) from the exact optimum; lower bound "), std::string::npos)
      << t.out;
  EXPECT_EQ(run(path + " --algorithm greedy --budget-bytes 1.5GB").code, 0);
  const CliRun p = run(path + " --pareto --json");
  ASSERT_EQ(p.code, 0) << p.out;
  const auto j = nlohmann::json::parse(p.out);
  ASSERT_FALSE(j["frontier"].empty());
  EXPECT_TRUE(j["frontier"][0].contains("peak_bytes"));
  EXPECT_TRUE(j["frontier"][0].contains("time_ms"));
  EXPECT_EQ(run(path + " --pareto").code, 0);
  std::remove(path.c_str());
}

TEST(Cli, HomogeneousMode) {
  for (const char* alg : {"revolve", "optimal"}) {
    const CliRun r = run(std::string("--steps 10 --slots 2 --algorithm ") + alg + " --json");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(nlohmann::json::parse(r.out)["forward_executions"], 30) << alg;  // 10 + t(10, 2) = 10 + 20
  }
  EXPECT_EQ(run("--steps 10 --algorithm revolve").code, 2);
}

TEST(Cli, BadInputExitsTwoAndNamesTheField) {
  CliRun r = run("--budget-bytes 1GiB", "{\"input_bytes\": 1, \"stages\": [");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("malformed"), std::string::npos) << r.out;
  r = run(
      "--budget-bytes 1GiB",
      R"({"input_bytes": 1, "stages": [{"forward_ms": 1, "backward_ms": 1, "output_bytes": -1, "saved_bytes": 1}]})");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("stages[0].output_bytes: negative"), std::string::npos) << r.out;
  r = run("--budget-bytes 1GiB",
          R"({"input_bytes": 1, "stages": [{"forward_ms": 1, "output_bytes": 1, "saved_bytes": 1}]})");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("stages[0].backward_ms: missing"), std::string::npos) << r.out;
  EXPECT_EQ(run("--budget-bytes lots", kChain).code, 2);
  EXPECT_EQ(run("--algorithm magic --budget-bytes 1GiB", kChain).code, 2);
  EXPECT_EQ(run("--no-such-flag", kChain).code, 2);
  EXPECT_EQ(run("--algorithm optimal", kChain).code, 2);
  EXPECT_EQ(run("/nonexistent/chain.json --algorithm sqrt").code, 2);
  r = run("--budget-bytes 1MiB", kChain);
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("no schedule fits in 1.00 MiB; the smallest feasible peak is"), std::string::npos) << r.out;
  r = run("--help");
  EXPECT_EQ(r.code, 0);
  for (const char* word : {"--algorithm", "--budget-bytes", "--json", "--pareto", "--steps", "--slots", "Exit codes"})
    EXPECT_NE(r.out.find(word), std::string::npos) << word;
}

// --scope: all schedules beat rotor's persistent class on this chain (the one
// of docs/planner.md, "Which schedules"); a bad value is exit 2.
TEST(Cli, ScopeChoosesTheSearchedSchedules) {
  const char* chain = R"({"input_bytes": 11, "stages": [
    {"name": "s0", "forward_ms": 0.98, "backward_ms": 8.90, "output_bytes": 2, "saved_bytes": 10},
    {"name": "s1", "forward_ms": 4.42, "backward_ms": 8.85, "output_bytes": 1, "saved_bytes": 4},
    {"name": "s2", "forward_ms": 0.27, "backward_ms": 1.81, "output_bytes": 10, "saved_bytes": 19},
    {"name": "s3", "forward_ms": 2.55, "backward_ms": 5.82, "output_bytes": 6, "saved_bytes": 15},
    {"name": "s4", "forward_ms": 4.55, "backward_ms": 5.80, "output_bytes": 10, "saved_bytes": 20},
    {"name": "s5", "forward_ms": 0.30, "backward_ms": 2.21, "output_bytes": 7, "saved_bytes": 13},
    {"name": "s6", "forward_ms": 2.18, "backward_ms": 3.57, "output_bytes": 6, "saved_bytes": 14}]})";
  auto plan_of = [&](const std::string& scope) {
    const CliRun r = run("--budget-bytes 53 --json" + scope, chain);
    EXPECT_EQ(r.code, 0) << r.out;
    const auto j = nlohmann::json::parse(r.out);
    return std::make_pair(j["prediction"]["time_ms"].get<double>(), j["scope"].get<std::string>());
  };
  for (const auto& [flag, ms, scope] : {std::tuple<std::string, double, std::string>{"", 78.32, "all"},
                                        {" --scope all", 78.32, "all"},
                                        {" --scope persistent", 91.94, "persistent"}}) {
    const auto [got_ms, got_scope] = plan_of(flag);
    EXPECT_NEAR(got_ms, ms, 1e-9) << flag;
    EXPECT_EQ(got_scope, scope) << flag;
  }
  const CliRun table = run("--budget-bytes 53 --scope persistent", chain);
  EXPECT_NE(table.out.find("scope      persistent schedules\n"), std::string::npos) << table.out;
  const CliRun bad = run("--budget-bytes 53 --scope some", chain);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.out.find("[remat::plan] scope: unknown \"some\"; expected auto, all or persistent."), std::string::npos)
      << bad.out;
}
