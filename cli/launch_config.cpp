#include "tessera/cli/launch_config.h"

#include <functional>
#include <set>

#include "tessera/core/error.h"
#include "tessera/dist/env.h"
#include "tessera/train/yaml_file.h"

namespace tessera::cli {
namespace {

using Json = nlohmann::json;

// Keys that say the same thing: setting one forgets what an earlier source said of the others.
const std::vector<std::set<std::string>>& linked_keys() {
  static const std::vector<std::set<std::string>> groups = {
      {"nproc_per_node", "num_processes"},
      {"master_addr", "rdzv_endpoint"},
      {"master_port", "rdzv_endpoint"},
  };
  return groups;
}

std::string describe(const Json& value) { return value.dump(); }

// One key of an Accelerate file: where its value goes, or which values are harmless.
struct ConfigKey {
  // Returns the Tessera setting and value to take, or fails naming the key (`what`).
  std::function<void(const Json& value, const std::string& what, LaunchSettings& out,
                     const std::string& source)>
      take;
};

void refuse(const std::string& what, const Json& value, const std::string& why) {
  TESSERA_FAIL(what, " is ", describe(value), ": ", why);
}

// A key Tessera has no use for: accepted only holding one of `harmless`.
ConfigKey only(std::vector<Json> harmless, std::string why) {
  return {[harmless, why](const Json& v, const std::string& what, LaunchSettings&,
                          const std::string&) {
    for (const Json& h : harmless)
      if (v == h) return;
    refuse(what, v, why);
  }};
}

// A key that maps onto a Tessera setting (null: not set).
ConfigKey to(std::string key) {
  return {[key](const Json& v, const std::string& what, LaunchSettings& out, const std::string& source) {
    if (!v.is_null()) out.set(key, v, source, what);
  }};
}

const Json kNone = nullptr;
const Json kEmptyList = Json::array();
const Json kEmptyObject = Json::object();

void take_distributed_type(const Json& v, const std::string& what, LaunchSettings& out,
                           const std::string& source) {
  const std::string type = v.is_string() ? v.get<std::string>() : "";
  if (type == "NO" || type == "MULTI_GPU") return;
  if (type == "MULTI_CPU") return out.set("use_cpu", true, source, what);
  if (type == "DEEPSPEED") return out.set("use_deepspeed", true, source, what);
  if (type == "FSDP") return out.set("use_fsdp", true, source, what);
  refuse(what, v, "Tessera runs NO, MULTI_CPU, MULTI_GPU, DEEPSPEED or FSDP");
}

void take_gpu_ids(const Json& v, const std::string& what, LaunchSettings& out,
                  const std::string& source) {
  if (v.is_null()) return;
  if (v.is_number_integer()) return out.set("gpu_ids", std::to_string(v.get<int64_t>()), source, what);
  if (!v.is_string()) refuse(what, v, "must be all or a list of device numbers like 0,1");
  out.set("gpu_ids", v, source, what);
}

// The keys of Accelerate's deepspeed_config block.
void take_deepspeed(const Json& block, const std::string& what, LaunchSettings& out,
                    const std::string& source);
void take_fsdp(const Json& block, const std::string& what, LaunchSettings& out,
               const std::string& source);

void take_block(const std::map<std::string, ConfigKey>& keys, const Json& block,
                const std::string& what, LaunchSettings& out, const std::string& source) {
  if (block.is_null()) return;
  TESSERA_CHECK(block.is_object(), what, " must be a mapping, got ", describe(block));
  for (const auto& [key, value] : block.items()) {
    const std::string inner = what.substr(0, what.size() - 1) + "." + key + "\"";
    auto it = keys.find(key);
    TESSERA_CHECK(it != keys.end(), inner, " is not a setting Tessera knows");
    it->second.take(value, inner, out, source);
  }
}

void take_deepspeed(const Json& block, const std::string& what, LaunchSettings& out,
                    const std::string& source) {
  static const std::map<std::string, ConfigKey> keys = {
      {"deepspeed_config_file", to("deepspeed_config_file")},
      {"zero_stage", to("zero_stage")},
      {"gradient_accumulation_steps", to("gradient_accumulation_steps")},
      {"offload_optimizer_device",
       only({"none", kNone}, "set offload in the DeepSpeed JSON (deepspeed_config_file) or "
                             "`tessera train --offload` instead")},
      {"offload_param_device",
       only({"none", kNone}, "set offload in the DeepSpeed JSON (deepspeed_config_file) or "
                             "`tessera train --offload` instead")},
      // Stage 3 shards the parameters as the model is prepared, with or without the flag.
      {"zero3_init_flag", only({true, false, kNone}, "must be true or false")},
      {"zero3_save_16bit_model", only({false, kNone}, "Tessera saves the full-precision model")},
      {"deepspeed_multinode_launcher",
       only({"standard", kNone}, "Tessera starts every node with its own `tessera launch`")},
      {"gradient_clipping", only({kNone}, "set gradient_clipping in the DeepSpeed JSON instead")},
  };
  take_block(keys, block, what, out, source);
}

void take_fsdp(const Json& block, const std::string& what, LaunchSettings& out,
               const std::string& source) {
  static const std::map<std::string, ConfigKey> keys = {
      {"fsdp_sharding_strategy",
       {[](const Json& v, const std::string& what, LaunchSettings& out, const std::string& source) {
         // Accelerate writes the strategy's name, older versions its number.
         static const char* by_number[] = {"", "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
         if (v.is_number_integer() && v.get<int>() >= 1 && v.get<int>() <= 3)
           return out.set("fsdp_sharding_strategy", by_number[v.get<int>()], source, what);
         if (!v.is_string()) refuse(what, v, "must be FULL_SHARD, SHARD_GRAD_OP or NO_SHARD");
         out.set("fsdp_sharding_strategy", v, source, what);
       }}},
      {"fsdp_offload_params", only({false, kNone}, "use `tessera train --fsdp \"FULL_SHARD offload\"`")},
      {"fsdp_activation_checkpointing",
       only({false, kNone}, "use `tessera train --gradient-checkpointing`")},
      // How Tessera's stage 3 works anyway: one unit per transformer block, gathered ahead,
      // the model's own parameter objects, a state dict gathered or sharded at saving.
      {"fsdp_auto_wrap_policy", only({"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", kNone},
                                     "Tessera wraps each transformer block")},
      {"fsdp_transformer_layer_cls_to_wrap", {[](auto&&...) {}}},
      {"fsdp_min_num_params", {[](auto&&...) {}}},
      {"fsdp_backward_prefetch", {[](auto&&...) {}}},
      {"fsdp_forward_prefetch", only({true, false, kNone}, "must be true or false")},
      {"fsdp_state_dict_type", {[](auto&&...) {}}},
      {"fsdp_sync_module_states", only({true, false, kNone}, "must be true or false")},
      {"fsdp_use_orig_params", only({true, false, kNone}, "must be true or false")},
      {"fsdp_cpu_ram_efficient_loading", only({true, false, kNone}, "must be true or false")},
      {"fsdp_version", only({1, kNone}, "Tessera's sharding is FSDP 1's")},
  };
  take_block(keys, block, what, out, source);
}

const std::map<std::string, ConfigKey>& accelerate_keys() {
  static const std::map<std::string, ConfigKey> keys = {
      {"compute_environment", only({"LOCAL_MACHINE", kNone}, "Tessera runs on LOCAL_MACHINE")},
      {"distributed_type", {take_distributed_type}},
      {"num_processes", to("num_processes")},
      {"num_machines", to("nnodes")},
      {"machine_rank", to("node_rank")},
      {"main_process_ip", to("master_addr")},
      {"main_process_port", to("master_port")},
      {"mixed_precision", to("mixed_precision")},
      {"gpu_ids", {take_gpu_ids}},
      {"use_cpu", to("use_cpu")},
      {"deepspeed_config", {take_deepspeed}},
      {"fsdp_config", {take_fsdp}},
      // Tessera's rendezvous is rank 0's TCP store at the main process: static, or c10d's.
      {"rdzv_backend", only({"static", "c10d", kNone}, "Tessera rendezvous at the main process")},
      {"same_network", only({true, false, kNone}, "must be true or false")},
      {"main_training_function",
       only({"main", kNone}, "Tessera runs the program's main (notebook launching is not supported)")},
      {"debug", only({false, kNone}, "Tessera has no distributed debug mode")},
      {"downcast_bf16", only({false, "no", kNone}, "Tessera does not downcast to bf16")},
      {"enable_cpu_affinity", only({false, kNone}, "Tessera does not pin ranks to cores")},
      {"tpu_use_cluster", only({false, kNone}, "Tessera has no TPU support")},
      {"tpu_use_sudo", only({false, kNone}, "Tessera has no TPU support")},
      {"tpu_env", only({kEmptyList, kNone}, "Tessera has no TPU support")},
      {"tpu_name", only({kNone}, "Tessera has no TPU support")},
      {"tpu_zone", only({kNone}, "Tessera has no TPU support")},
      {"commands", only({kNone}, "Tessera has no TPU support")},
      {"command_file", only({kNone}, "Tessera has no TPU support")},
      {"megatron_lm_config", only({kEmptyObject, kNone}, "Tessera has no Megatron-LM support")},
      {"ipex_config", only({kEmptyObject, kNone}, "Tessera has no IPEX support")},
      {"mpirun_config", only({kEmptyObject, kNone}, "run mpirun yourself (Tessera reads its environment)")},
      {"dynamo_config", only({kEmptyObject, Json{{"dynamo_backend", "NO"}}, kNone},
                             "Tessera has no torch.compile")},
  };
  return keys;
}

// Settings Tessera's own file may give by Tessera's names, beside Accelerate's schema.
const std::set<std::string>& tessera_keys() {
  static const std::set<std::string> keys = {
      "nproc_per_node", "nnodes",       "node_rank",           "master_addr",
      "master_port",    "rdzv_endpoint", "reduce_dtype",       "max_restarts",
      "exit_barrier_timeout", "watchdog_timeout", "watchdog_action", "fsdp_sharding_strategy",
      "zero_stage", "deepspeed_config_file", "gradient_accumulation_steps", "tp_size", "pp_size"};
  return keys;
}

}  // namespace

void LaunchSettings::set(const std::string& key, Json value, const std::string& source,
                         const std::string& description) {
  for (const auto& group : linked_keys())
    if (group.count(key))
      for (const std::string& other : group)
        if (other != key && sources.count(other) && sources[other] != source)
          values.erase(other), sources.erase(other), descriptions.erase(other);
  values[key] = std::move(value);
  sources[key] = source;
  descriptions[key] = description.empty() ? source + ": key \"" + key + "\"" : description;
}

std::string default_config_path() {
  std::string hf_home = dist::env_string("HF_HOME");
  if (hf_home.empty()) {
    const std::string cache = dist::env_string("XDG_CACHE_HOME", dist::env_string("HOME", ".") + "/.cache");
    hf_home = cache + "/huggingface";
  }
  return hf_home + "/accelerate/default_config.yaml";
}

LaunchSettings read_launch_config(const std::string& path) {
  const Json config = train::read_yaml_file(path);
  const std::string source = "config '" + path + "'";
  TESSERA_CHECK(config.is_object() || config.is_null(), source,
                ": expected a mapping of launch settings (what `accelerate config` or `tessera "
                "config` writes)");
  LaunchSettings out;
  if (config.is_null()) return out;
  for (const auto& [key, value] : config.items()) {
    const std::string what = source + ": key \"" + key + "\"";
    if (auto it = accelerate_keys().find(key); it != accelerate_keys().end()) {
      it->second.take(value, what, out, source);
    } else {
      TESSERA_CHECK(tessera_keys().count(key), what,
                    " is not a setting of Accelerate's config schema nor of `tessera launch`");
      if (!value.is_null()) out.set(key, value, source, what);
    }
  }
  return out;
}

namespace {

// Typed reads of settings, naming the key and its source when the type is wrong.
class SettingReader {
 public:
  explicit SettingReader(const LaunchSettings& s) : s_(s) {}
  bool has(const std::string& key) const { return s_.values.contains(key); }
  std::string what(const std::string& key) const { return s_.descriptions.at(key); }
  int integer(const std::string& key) const {
    const Json& v = s_.values.at(key);
    if (v.is_string()) {  // PyYAML writes ports as text sometimes: '29500'
      const std::string t = v.get<std::string>();
      if (!t.empty() && t.find_first_not_of("0123456789") == std::string::npos && t.size() < 10)
        return std::stoi(t);
    }
    TESSERA_CHECK(v.is_number_integer() && v.get<int64_t>() >= INT_MIN && v.get<int64_t>() <= INT_MAX,
                  what(key), " must be an integer, got ", v.dump());
    return v.get<int>();
  }
  double real(const std::string& key) const {
    const Json& v = s_.values.at(key);
    TESSERA_CHECK(v.is_number(), what(key), " must be a number, got ", v.dump());
    return v.get<double>();
  }
  std::string text(const std::string& key) const {
    const Json& v = s_.values.at(key);
    TESSERA_CHECK(v.is_string(), what(key), " must be text, got ", v.dump());
    return v.get<std::string>();
  }
  bool flag(const std::string& key) const {
    const Json& v = s_.values.at(key);
    TESSERA_CHECK(v.is_boolean(), what(key), " must be true or false, got ", v.dump());
    return v.get<bool>();
  }
  void one_of(const std::string& key, const std::string& value,
              const std::vector<std::string>& allowed) const {
    std::string list;
    for (const auto& a : allowed) {
      if (a == value) return;
      list += (list.empty() ? "" : ", ") + a;
    }
    TESSERA_FAIL(what(key), " must be one of ", list, "; got '", value, "'");
  }

 private:
  const LaunchSettings& s_;
};

void apply_job_shape(const SettingReader& r, dist::LaunchOptions& o) {
  if (r.has("nnodes")) o.nnodes = r.integer("nnodes");
  if (r.has("node_rank")) o.node_rank = r.integer("node_rank");
  if (r.has("nproc_per_node")) o.nproc_per_node = r.integer("nproc_per_node");
  if (r.has("num_processes")) {
    // Accelerate's num_processes counts the processes of every machine together.
    const int total = r.integer("num_processes");
    TESSERA_CHECK(o.nnodes >= 1 && total >= 1 && total % o.nnodes == 0, r.what("num_processes"),
                  " is ", total, ", the processes of all ", o.nnodes,
                  " machines together: it must be a positive multiple of the number of machines");
    o.nproc_per_node = total / o.nnodes;
  }
  if (r.has("rdzv_endpoint")) {
    const std::string endpoint = r.text("rdzv_endpoint");
    const size_t colon = endpoint.rfind(':');
    TESSERA_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < endpoint.size() &&
                      endpoint.find_first_not_of("0123456789", colon + 1) == std::string::npos &&
                      endpoint.size() - colon <= 6,
                  r.what("rdzv_endpoint"), " must be HOST:PORT, got '", endpoint, "'");
    o.master_addr = endpoint.substr(0, colon);
    o.master_port = std::stoi(endpoint.substr(colon + 1));
  }
  if (r.has("master_addr")) o.master_addr = r.text("master_addr");
  if (r.has("master_port")) o.master_port = r.integer("master_port");
  const bool addr = r.has("master_addr") || r.has("rdzv_endpoint");
  const bool port = r.has("master_port") || r.has("rdzv_endpoint");
  dist::take_master_from_environment(o, addr, port);
}

void apply_sharding(const SettingReader& r, dist::LaunchOptions& o) {
  const bool deepspeed = r.has("use_deepspeed") && r.flag("use_deepspeed");
  const bool fsdp = r.has("use_fsdp") && r.flag("use_fsdp");
  TESSERA_CHECK(!(deepspeed && fsdp), r.what("use_deepspeed"), " and ", r.what("use_fsdp"),
                " contradict each other: a job shards with one of them");
  if (r.has("zero_stage")) o.zero_stage = r.integer("zero_stage");
  if (r.has("deepspeed_config_file")) {
    TESSERA_CHECK(deepspeed, r.what("deepspeed_config_file"),
                  " needs DeepSpeed: --use_deepspeed (distributed_type: DEEPSPEED)");
    o.deepspeed_config_file = r.text("deepspeed_config_file");
  }
  if (r.has("fsdp_sharding_strategy")) {
    TESSERA_CHECK(fsdp, r.what("fsdp_sharding_strategy"),
                  " needs FSDP: --use_fsdp (distributed_type: FSDP)");
    o.fsdp_sharding_strategy = r.text("fsdp_sharding_strategy");
  } else if (fsdp) {
    o.fsdp_sharding_strategy = "FULL_SHARD";  // Accelerate's default strategy
  }
  if (r.has("gradient_accumulation_steps"))
    o.gradient_accumulation_steps = r.integer("gradient_accumulation_steps");
  if (r.has("tp_size")) o.tp_size = r.integer("tp_size");
  if (r.has("pp_size")) o.pp_size = r.integer("pp_size");
}

}  // namespace

void apply_launch_settings(const LaunchSettings& settings, dist::LaunchOptions& o) {
  const SettingReader r(settings);
  apply_job_shape(r, o);
  apply_sharding(r, o);
  if (r.has("mixed_precision")) {
    o.mixed_precision = r.text("mixed_precision");
    r.one_of("mixed_precision", o.mixed_precision, {"no", "fp16", "bf16"});
  }
  if (r.has("reduce_dtype")) {
    o.reduce_dtype = r.text("reduce_dtype");
    r.one_of("reduce_dtype", o.reduce_dtype, {"fp32", "fp16", "bf16"});
  }
  if (r.has("max_restarts")) o.max_restarts = r.integer("max_restarts");
  if (r.has("exit_barrier_timeout")) o.exit_barrier_timeout_s = r.real("exit_barrier_timeout");
  if (r.has("watchdog_timeout")) o.watchdog_timeout_s = r.real("watchdog_timeout");
  if (r.has("watchdog_action")) {
    o.watchdog_action = r.text("watchdog_action");
    r.one_of("watchdog_action", o.watchdog_action, {"end", "report"});
  }
  if (r.has("gpu_ids")) o.gpu_ids = r.text("gpu_ids");
  if (r.has("use_cpu")) o.use_cpu = r.flag("use_cpu");
}

}  // namespace tessera::cli
