// JSON reading and writing for chains and plans (nlohmann-json, private to the
// library). Leaves out the tool's table output (tools/remat-plan).
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "remat/plan/error.h"
#include "remat/plan/json.h"

namespace remat::plan {
namespace {

using nlohmann::json;

[[noreturn]] void field_error(const std::string& field, const std::string& why) {
  throw Error("[remat::plan] chain JSON: " + field + ": " + why);
}

int64_t get_bytes(const json& obj, const std::string& key, const std::string& path, bool required) {
  const std::string field = path + key;
  auto it = obj.find(key);
  if (it == obj.end()) {
    if (required) field_error(field, "missing.");
    return 0;
  }
  // nlohmann stores every non-negative integer as unsigned, and its
  // is_number_integer() is true for those too: test unsigned first.
  if (it->is_number_unsigned()) {
    const uint64_t v = it->get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      field_error(field, "too large (" + it->dump() + "); at most 2^63 - 1 bytes.");
    return static_cast<int64_t>(v);
  }
  if (it->is_number_integer()) {
    const int64_t v = it->get<int64_t>();
    if (v < 0) field_error(field, "negative (" + std::to_string(v) + "); sizes are bytes >= 0.");
    return v;
  }
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (!(v >= 0)) field_error(field, "negative or not a number (" + it->dump() + "); sizes are bytes >= 0.");
    if (v != std::floor(v) || v > 9.2e18) field_error(field, "not a whole number of bytes (" + it->dump() + ").");
    return static_cast<int64_t>(v);
  }
  field_error(field, "expected a number of bytes, got " + std::string(it->type_name()) + ".");
}

double get_ms(const json& obj, const std::string& key, const std::string& path) {
  const std::string field = path + key;
  auto it = obj.find(key);
  if (it == obj.end()) field_error(field, "missing.");
  if (!it->is_number()) field_error(field, "expected a number of ms, got " + std::string(it->type_name()) + ".");
  const double v = it->get<double>();
  if (!std::isfinite(v) || v < 0) field_error(field, "negative (" + it->dump() + "); times are ms >= 0.");
  return v;
}

}  // namespace

Chain chain_from_json(std::string_view text) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::exception& e) {
    // parse_error, and out_of_range for a number beyond double (1e400).
    throw Error(std::string("[remat::plan] chain JSON: malformed: ") + e.what());
  }
  if (!j.is_object()) throw Error("[remat::plan] chain JSON: expected an object with input_bytes and stages.");
  Chain chain;
  chain.input_bytes = get_bytes(j, "input_bytes", "", true);
  if (j.contains("input_grad_bytes")) chain.input_grad_bytes = get_bytes(j, "input_grad_bytes", "", true);
  auto st = j.find("stages");
  if (st == j.end()) field_error("stages", "missing.");
  if (!st->is_array()) field_error("stages", "expected an array of stages.");
  if (st->empty()) field_error("stages", "empty; a chain needs at least one stage.");
  for (size_t i = 0; i < st->size(); ++i) {
    const json& s = (*st)[i];
    const std::string path = "stages[" + std::to_string(i) + "].";
    if (!s.is_object()) field_error("stages[" + std::to_string(i) + "]", "expected an object.");
    Stage stage;
    auto name = s.find("name");
    if (name == s.end()) stage.name = "stage" + std::to_string(i);
    else if (name->is_string()) stage.name = name->get<std::string>();
    else field_error(path + "name", "expected a string.");
    stage.forward_ms = get_ms(s, "forward_ms", path);
    stage.backward_ms = get_ms(s, "backward_ms", path);
    if (s.contains("recompute_ms")) stage.recompute_ms = get_ms(s, "recompute_ms", path);
    stage.output_bytes = get_bytes(s, "output_bytes", path, true);
    stage.saved_bytes = get_bytes(s, "saved_bytes", path, true);
    stage.forward_tmp_bytes = get_bytes(s, "forward_tmp_bytes", path, false);
    if (s.contains("plain_forward_tmp_bytes"))
      stage.plain_forward_tmp_bytes = get_bytes(s, "plain_forward_tmp_bytes", path, true);
    stage.backward_tmp_bytes = get_bytes(s, "backward_tmp_bytes", path, false);
    stage.backward_freed_bytes = get_bytes(s, "backward_freed_bytes", path, false);
    stage.shared_input_bytes = get_bytes(s, "shared_input_bytes", path, false);
    if (s.contains("output_grad_bytes")) stage.output_grad_bytes = get_bytes(s, "output_grad_bytes", path, true);
    if (auto opts = s.find("options"); opts != s.end()) {
      if (!opts->is_array()) field_error(path + "options", "expected an array of options.");
      for (size_t k = 0; k < opts->size(); ++k) {
        const json& o = (*opts)[k];
        const std::string op = path + "options[" + std::to_string(k) + "].";
        if (!o.is_object()) field_error(path + "options[" + std::to_string(k) + "]", "expected an object.");
        StageOption opt;
        auto oname = o.find("name");
        if (oname == o.end()) opt.name = "option" + std::to_string(k + 1);
        else if (oname->is_string()) opt.name = oname->get<std::string>();
        else field_error(op + "name", "expected a string.");
        opt.saved_bytes = get_bytes(o, "saved_bytes", op, true);
        opt.forward_ms = get_ms(o, "forward_ms", op);
        opt.backward_ms = get_ms(o, "backward_ms", op);
        opt.forward_tmp_bytes = get_bytes(o, "forward_tmp_bytes", op, false);
        opt.backward_tmp_bytes = get_bytes(o, "backward_tmp_bytes", op, false);
        opt.backward_freed_bytes = get_bytes(o, "backward_freed_bytes", op, false);
        stage.options.push_back(std::move(opt));
      }
    }
    if (stage.saved_bytes < stage.output_bytes)
      field_error(path + "saved_bytes", "(" + std::to_string(stage.saved_bytes) + ") < output_bytes (" +
                                            std::to_string(stage.output_bytes) +
                                            "); the saved set includes the stage's output.");
    chain.stages.push_back(std::move(stage));
  }
  chain.validate();
  return chain;
}

std::string chain_to_json(const Chain& chain, int indent) {
  json j;
  j["input_bytes"] = chain.input_bytes;
  if (chain.input_grad_bytes >= 0) j["input_grad_bytes"] = chain.input_grad_bytes;
  j["stages"] = json::array();
  for (const Stage& s : chain.stages) {
    json o;
    o["name"] = s.name;
    o["forward_ms"] = s.forward_ms;
    o["backward_ms"] = s.backward_ms;
    if (s.recompute_ms >= 0) o["recompute_ms"] = s.recompute_ms;
    o["output_bytes"] = s.output_bytes;
    o["saved_bytes"] = s.saved_bytes;
    if (s.forward_tmp_bytes) o["forward_tmp_bytes"] = s.forward_tmp_bytes;
    if (s.plain_forward_tmp_bytes >= 0) o["plain_forward_tmp_bytes"] = s.plain_forward_tmp_bytes;
    if (s.backward_tmp_bytes) o["backward_tmp_bytes"] = s.backward_tmp_bytes;
    if (s.backward_freed_bytes) o["backward_freed_bytes"] = s.backward_freed_bytes;
    if (s.shared_input_bytes) o["shared_input_bytes"] = s.shared_input_bytes;
    if (s.output_grad_bytes >= 0) o["output_grad_bytes"] = s.output_grad_bytes;
    if (!s.options.empty()) {
      json opts = json::array();
      for (const StageOption& x : s.options) {
        json e = {{"name", x.name},
                  {"saved_bytes", x.saved_bytes},
                  {"forward_ms", x.forward_ms},
                  {"backward_ms", x.backward_ms}};
        if (x.forward_tmp_bytes) e["forward_tmp_bytes"] = x.forward_tmp_bytes;
        if (x.backward_tmp_bytes) e["backward_tmp_bytes"] = x.backward_tmp_bytes;
        if (x.backward_freed_bytes) e["backward_freed_bytes"] = x.backward_freed_bytes;
        opts.push_back(e);
      }
      o["options"] = opts;
    }
    j["stages"].push_back(o);
  }
  return j.dump(indent);
}

std::string plan_to_json(const Chain& chain, const Plan& plan, int indent) {
  json j;
  j["algorithm"] = plan.algorithm;
  const Prediction& p = plan.prediction;
  j["prediction"] = {{"peak_bytes", p.peak_bytes},
                     {"time_ms", p.time_ms},
                     {"forward_executions", p.forward_executions},
                     {"forwards_per_stage", p.forwards_per_stage}};
  if (plan.optimality_gap_ms >= 0) {
    j["lower_bound_ms"] = plan.lower_bound_ms;
    j["optimality_gap_ms"] = plan.optimality_gap_ms;
    j["memory_unit_bytes"] = plan.memory_unit_bytes;
  }
  json ops = json::array();
  for (size_t k = 0; k < plan.schedule.ops.size(); ++k) {
    const Op& op = plan.schedule.ops[k];
    json o = {{"op", op_kind_name(op.kind)}, {"stage", op.stage}};
    if (op.kind != OpKind::kDrop && op.stage >= 0 && op.stage < chain.size()) o["name"] = chain.stages[op.stage].name;
    if (op.option != 0) {
      o["option"] = op.option;
      if (op.stage >= 0 && op.stage < chain.size() && op.option > 0 &&
          op.option <= static_cast<int>(chain.stages[op.stage].options.size()))
        o["option_name"] = chain.stages[op.stage].options[op.option - 1].name;
    }
    if (k < p.op_bytes.size()) o["bytes"] = p.op_bytes[k];
    ops.push_back(o);
  }
  j["schedule"] = ops;
  return j.dump(indent);
}

}  // namespace remat::plan
