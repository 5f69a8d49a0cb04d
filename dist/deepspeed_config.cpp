#include "tessera/dist/deepspeed_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/dist/accelerator.h"

namespace tessera::dist {

namespace {

using Json = nlohmann::json;

bool is_auto(const Json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

// Every key of `object` must be one of `known`; the error names the dotted key.
void check_keys(const Json& object, const std::set<std::string>& known, const std::string& prefix,
                const std::string& source) {
  TESSERA_CHECK(object.is_object(), source, ": \"", prefix.empty() ? "(top level)" : prefix,
                "\" must be an object, got ", object.dump());
  for (const auto& [key, value] : object.items()) {
    if (known.count(key)) continue;
    std::string names;
    for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
    TESSERA_FAIL(source, ": unknown key \"", prefix.empty() ? key : prefix + "." + key,
                 "\" (Tessera reads: ", names, ")");
  }
}

std::optional<int64_t> integer(const Json& v, const std::string& key, const std::string& source,
                               int64_t minimum) {
  if (is_auto(v)) return std::nullopt;
  const bool whole = v.is_number_integer() ||
                     (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>() &&
                      std::fabs(v.get<double>()) < 9e15);
  TESSERA_CHECK(whole && v.get<double>() >= static_cast<double>(minimum), source, ": \"", key,
                "\" must be an integer >= ", minimum, " or \"auto\", got ", v.dump());
  return static_cast<int64_t>(v.get<double>());
}

std::optional<bool> boolean(const Json& v, const std::string& key, const std::string& source) {
  if (is_auto(v)) return std::nullopt;
  TESSERA_CHECK(v.is_boolean(), source, ": \"", key, "\" must be true, false or \"auto\", got ",
                v.dump());
  return v.get<bool>();
}

// {"device": "cpu" | "none", "pin_memory": bool}: whether the state goes to the host.
std::optional<bool> offload_device(const Json& block, const std::string& prefix,
                                   const std::string& source) {
  check_keys(block,
             {"device", "pin_memory", "ratio", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
              "pipeline_read", "pipeline_write", "fast_init"},
             prefix, source);
  // Tessera pins the host copies whenever a GPU trains; on the CPU nothing needs pinning.
  if (block.contains("pin_memory")) boolean(block["pin_memory"], prefix + ".pin_memory", source);
  for (const char* nvme : {"nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pipeline_read",
                           "pipeline_write", "fast_init"})
    TESSERA_CHECK(!block.contains(nvme), source, ": \"", prefix, ".", nvme,
                  "\" configures NVMe offload, which is not supported (device \"cpu\" keeps the "
                  "state in host memory)");
  if (block.contains("ratio")) {
    const Json& ratio = block["ratio"];
    TESSERA_CHECK(ratio.is_number() && ratio.get<double>() == 1.0, source, ": \"", prefix,
                  ".ratio\" is ", ratio.dump(), "; only 1.0 (offload all of it) is supported");
  }
  if (!block.contains("device")) return std::nullopt;
  const Json& device = block["device"];
  TESSERA_CHECK(device.is_string(), source, ": \"", prefix,
                ".device\" must be \"cpu\" or \"none\", got ", device.dump());
  const std::string d = device.get<std::string>();
  if (d == "auto") return std::nullopt;
  TESSERA_CHECK(d == "cpu" || d == "none", source, ": \"", prefix,
                ".device\" must be \"cpu\" or \"none\", got \"", d, "\"",
                d == "nvme" ? " (NVMe offload is not supported)" : "");
  return d == "cpu";
}

// Keys of zero_optimization (and of the top level) Tessera does not read as values: what
// it always does (true accepted, false refused), features it lacks (false accepted, true
// refused), and numbers that must keep DeepSpeed's default.
struct SwitchRule {
  const char* key;
  bool required;       // the only value accepted
  const char* reason;  // why the other one is refused
};

const std::vector<SwitchRule>& zero_switch_rules() {
  static const std::vector<SwitchRule> rules = {
      {"contiguous_gradients", true, "Tessera always keeps gradients in contiguous flat buckets"},
      {"reduce_scatter", true, "Tessera always reduce-scatters gradients at stages 2 and 3"},
      {"allgather_partitions", true, "Tessera always all-gathers the updated shards after a step"},
      {"stage3_gather_16bit_weights_on_model_save", true,
       "Tessera always gathers the full weights when it saves a model"},
      {"stage3_gather_fp16_weights_on_model_save", true,
       "Tessera always gathers the full weights when it saves a model"},
      {"load_from_fp32_weights", true,
       "Tessera always restores the f32 master weights from the optimizer state"},
      {"grad_hooks", true, "Tessera always reduces buckets from gradient-ready hooks"},
      {"elastic_checkpoint", true,
       "Tessera's sharded optimizer checkpoints always load at another world size"},
      {"memory_efficient_linear", true,
       "Tessera always releases a block's gathered weights after its forward"},
      {"round_robin_gradients", false, "round-robin gradient partitioning is not implemented"},
      {"zero_quantized_weights", false, "ZeRO++ quantized weights are not implemented"},
      {"zero_quantized_nontrainable_weights", false, "ZeRO++ quantized weights are not implemented"},
      {"zero_quantized_gradients", false, "ZeRO++ quantized gradients are not implemented"},
      {"mics_hierarchical_params_gather", false, "MiCS is not implemented"},
  };
  return rules;
}

const SwitchRule* find_rule(const std::vector<SwitchRule>& rules, const std::string& key) {
  for (const SwitchRule& r : rules)
    if (key == r.key) return &r;
  return nullptr;
}

void check_switch(const Json& v, const SwitchRule& rule, const std::string& key, const std::string& source) {
  const auto on = boolean(v, key, source);
  TESSERA_CHECK(!on || *on == rule.required, source, ": \"", key, "\": ", *on ? "true" : "false",
                " is not supported (", rule.reason, ")");
}

// A number given only in elements; "auto" and a missing key are nullopt.
std::optional<int64_t> elements(const Json& z, const std::string& key, const std::string& p,
                                const std::string& source, int64_t minimum) {
  return z.contains(key) ? integer(z[key], p + "." + key, source, minimum) : std::nullopt;
}

void read_zero_buckets(DeepSpeedConfig& c, const Json& z, const std::string& p) {
  c.reduce_bucket_size = elements(z, "reduce_bucket_size", p, c.source, 1);
  // Tessera all-gathers the updated parameters in the buckets it reduced, so one size serves both.
  const auto gather = elements(z, "allgather_bucket_size", p, c.source, 1);
  if (gather && c.reduce_bucket_size)
    TESSERA_CHECK(*gather == *c.reduce_bucket_size, c.source, ": \"", p,
                  ".allgather_bucket_size\" is ", *gather, " but \"", p, ".reduce_bucket_size\" is ",
                  *c.reduce_bucket_size,
                  "; Tessera all-gathers the buckets it reduces, so they must be equal");
  if (gather) c.reduce_bucket_size = gather;
  c.stage3_prefetch_bucket_size = elements(z, "stage3_prefetch_bucket_size", p, c.source, 0);
  c.stage3_max_live_parameters = elements(z, "stage3_max_live_parameters", p, c.source, 1);
}

// Memory tuning without a counterpart: accepted, each noted with what Tessera does.
void note_memory_tuning(DeepSpeedConfig& c, const Json& z, const std::string& p) {
  const auto note = [&](const char* key, int64_t keeps_results_when_at_most, const char* tessera) {
    const auto v = elements(z, key, p, c.source, 0);
    if (v && *v > keeps_results_when_at_most)
      c.notes.push_back(p + "." + key + " = " + std::to_string(*v) + ": " + tessera +
                        "; this changes memory and communication in DeepSpeed, not results");
  };
  note("stage3_max_reuse_distance", 0,
       "Tessera's stage 3 releases a block after its forward and gathers it again for backward");
  note("stage3_param_persistence_threshold", 0, "Tessera's stage 3 partitions every parameter");
  const auto sub_group = elements(z, "sub_group_size", p, c.source, 1);
  if (sub_group && *sub_group < 1'000'000'000)
    c.notes.push_back(p + ".sub_group_size = " + std::to_string(*sub_group) +
                      ": Tessera's optimizer steps each rank's whole shard at once (DeepSpeed's "
                      "behaviour when the shard holds at most sub_group_size elements); this "
                      "changes the step's peak memory in DeepSpeed, not results");
}

void read_zero_optimization(DeepSpeedConfig& c, const Json& z) {
  const std::string p = "zero_optimization";
  std::set<std::string> known = {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size",
                                 "allgather_bucket_size", "stage3_prefetch_bucket_size",
                                 "stage3_max_live_parameters", "stage3_max_reuse_distance",
                                 "stage3_param_persistence_threshold", "sub_group_size",
                                 "ignore_unused_parameters", "cpu_offload", "zero_hpz_partition_size",
                                 "mics_shard_size", "overlap_comm"};
  for (const SwitchRule& r : zero_switch_rules()) known.insert(r.key);
  check_keys(z, known, p, c.source);
  if (z.contains("stage")) {
    c.zero_stage = integer(z["stage"], p + ".stage", c.source, 0);
    TESSERA_CHECK(!c.zero_stage || *c.zero_stage <= 3, c.source, ": \"", p,
                  ".stage\" must be 0, 1, 2 or 3, got ", *c.zero_stage);
  }
  if (z.contains("offload_optimizer"))
    c.offload_optimizer =
        offload_device(z["offload_optimizer"], p + ".offload_optimizer", c.source);
  if (z.contains("offload_param"))
    c.offload_param = offload_device(z["offload_param"], p + ".offload_param", c.source);
  // DeepSpeed's older switch for the same ZeRO-Offload of the optimizer.
  if (z.contains("cpu_offload")) {
    const auto on = boolean(z["cpu_offload"], p + ".cpu_offload", c.source);
    TESSERA_CHECK(!on || !c.offload_optimizer || *on == *c.offload_optimizer, c.source, ": \"", p,
                  ".cpu_offload\" and \"", p, ".offload_optimizer.device\" contradict each other");
    if (on) c.offload_optimizer = *on;
  }
  // overlap_comm: whether a bucket's reduction overlaps the next bucket's gradients
  // (max_buckets_in_flight 2 or 1, applied in apply_to).
  if (z.contains("overlap_comm")) c.overlap_comm = boolean(z["overlap_comm"], p + ".overlap_comm", c.source);
  read_zero_buckets(c, z, p);
  note_memory_tuning(c, z, p);
  if (z.contains("ignore_unused_parameters"))
    c.ignore_unused_parameters = boolean(z["ignore_unused_parameters"], p + ".ignore_unused_parameters", c.source);
  const auto hpz = elements(z, "zero_hpz_partition_size", p, c.source, 1);
  TESSERA_CHECK(!hpz || *hpz == 1, c.source, ": \"", p, ".zero_hpz_partition_size\" is ", hpz.value_or(1),
                "; only 1 is supported (ZeRO++ hierarchical partitioning is not implemented)");
  // MiCS's shard groups are hybrid sharding's (dist/zero.h): shard within groups of this many
  // ranks, replicate across them; -1 (or 0) is off.
  if (z.contains("mics_shard_size")) {
    const Json& v = z["mics_shard_size"];
    TESSERA_CHECK(
        v.is_number_integer() && v.get<int64_t>() >= -1 && v.get<int64_t>() <= (int64_t{1} << 30),
        c.source, ": \"", p,
        ".mics_shard_size\" must be a whole number of ranks (or -1: off), got ", v.dump());
    if (v.get<int64_t>() > 0) c.hybrid_shard_size = static_cast<int>(v.get<int64_t>());
  }
  for (const SwitchRule& rule : zero_switch_rules())
    if (z.contains(rule.key)) check_switch(z[rule.key], rule, p + "." + rule.key, c.source);
}

double positive_number(const Json& v, const std::string& key, const std::string& source, double minimum) {
  TESSERA_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= minimum, source,
                ": \"", key, "\" must be a number >= ", minimum, ", got ", v.dump());
  return v.get<double>();
}

// fp16's loss-scale keys, with DeepSpeed's defaults for the ones not given.
optim::LossScalerOptions fp16_loss_scaler(const Json& block, const std::string& source) {
  optim::LossScalerOptions o{.init_scale = 65536.0, .growth_interval = 1000, .hysteresis = 2, .min_scale = 1};
  if (block.contains("initial_scale_power")) {
    const auto power = integer(block["initial_scale_power"], "fp16.initial_scale_power", source, 0);
    TESSERA_CHECK(!power || *power <= 64, source, ": \"fp16.initial_scale_power\" must be at most 64, got ", *power);
    if (power) o.init_scale = std::ldexp(1.0, static_cast<int>(*power));
  }
  if (block.contains("loss_scale_window"))
    o.growth_interval = integer(block["loss_scale_window"], "fp16.loss_scale_window", source, 1).value_or(1000);
  if (block.contains("hysteresis"))
    o.hysteresis = integer(block["hysteresis"], "fp16.hysteresis", source, 1).value_or(2);
  if (block.contains("consecutive_hysteresis"))
    o.consecutive_hysteresis =
        boolean(block["consecutive_hysteresis"], "fp16.consecutive_hysteresis", source).value_or(false);
  if (block.contains("min_loss_scale") && !is_auto(block["min_loss_scale"]))
    o.min_scale = positive_number(block["min_loss_scale"], "fp16.min_loss_scale", source, 0);
  if (block.contains("loss_scale") && !is_auto(block["loss_scale"])) {
    const double fixed = positive_number(block["loss_scale"], "fp16.loss_scale", source, 0);
    if (fixed > 0) {  // a static scale
      o.dynamic = false;
      o.init_scale = fixed;
      o.min_scale = std::min(o.min_scale, fixed);
    }
  }
  TESSERA_CHECK(o.min_scale <= o.init_scale, source, ": \"fp16.min_loss_scale\" (", o.min_scale,
                ") exceeds the initial scale 2^initial_scale_power = ", o.init_scale);
  return o;
}

// bf16.enabled / fp16.enabled (and fp16's loss scaler).
std::optional<bool> precision_enabled(DeepSpeedConfig& c, const Json& config, const char* name) {
  if (!config.contains(name)) return std::nullopt;
  const Json& block = config[name];
  const std::string& source = c.source;
  if (std::string(name) != "fp16") {
    check_keys(block, {"enabled"}, name, source);
  } else {
    check_keys(block,
               {"enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window",
                "hysteresis", "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads"},
               name, source);
    // Tessera's autocast casts floating inputs and its models take integer token ids: either
    // value computes the same.
    if (block.contains("auto_cast")) boolean(block["auto_cast"], "fp16.auto_cast", source);
    if (block.contains("fp16_master_weights_and_grads"))
      check_switch(block["fp16_master_weights_and_grads"],
                   {"fp16_master_weights_and_grads", false, "Tessera keeps f32 master weights"},
                   "fp16.fp16_master_weights_and_grads", source);
    c.loss_scaler = fp16_loss_scaler(block, source);
  }
  return block.contains("enabled")
             ? boolean(block["enabled"], std::string(name) + ".enabled", source)
             : std::nullopt;
}

std::optional<double> real_or_auto(const Json& v, const std::string& key, const std::string& source) {
  if (is_auto(v)) return std::nullopt;
  return positive_number(v, key, source, 0);
}

// optimizer: {"type": "AdamW" | "Adam", "params": {lr, betas, eps, weight_decay, ...}}.
void read_optimizer(DeepSpeedConfig& c, const Json& block) {
  const std::string& source = c.source;
  check_keys(block, {"type", "params"}, "optimizer", source);
  const std::string type = block.contains("type") && block["type"].is_string() ? block["type"].get<std::string>() : "";
  std::string lower = type;
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  TESSERA_CHECK(lower == "adamw" || lower == "adam", source, ": \"optimizer.type\" is ",
                block.contains("type") ? block["type"].dump() : "missing",
                "; Tessera trains with AdamW (\"Adam\" or \"AdamW\"; other optimizers are not implemented)");
  if (!block.contains("params")) return;
  const Json& params = block["params"];
  check_keys(params, {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "bias_correction", "amsgrad"},
             "optimizer.params", source);
  if (params.contains("lr")) c.optimizer_lr = real_or_auto(params["lr"], "optimizer.params.lr", source);
  if (params.contains("eps")) c.optimizer_eps = real_or_auto(params["eps"], "optimizer.params.eps", source);
  if (params.contains("weight_decay"))
    c.optimizer_weight_decay = real_or_auto(params["weight_decay"], "optimizer.params.weight_decay", source);
  if (params.contains("betas") && !is_auto(params["betas"])) {
    const Json& b = params["betas"];
    TESSERA_CHECK(b.is_array() && b.size() == 2 && b[0].is_number() && b[1].is_number(), source,
                  ": \"optimizer.params.betas\" must be [beta1, beta2] or \"auto\", got ", b.dump());
    c.optimizer_beta1 = b[0].get<double>();
    c.optimizer_beta2 = b[1].get<double>();
  }
  // torch_adam picks DeepSpeed's kernel; both compute torch's AdamW.
  if (params.contains("torch_adam")) boolean(params["torch_adam"], "optimizer.params.torch_adam", source);
  const SwitchRule adam_rules[] = {
      {"adam_w_mode", true, "Tessera's AdamW decouples weight decay; Adam with L2 decay is not implemented"},
      {"bias_correction", true, "Tessera's AdamW always corrects the moments' bias"},
      {"amsgrad", false, "AMSGrad is not implemented"}};
  for (const SwitchRule& rule : adam_rules)
    if (params.contains(rule.key)) check_switch(params[rule.key], rule, std::string("optimizer.params.") + rule.key, source);
}

void read_communication_dtype(DeepSpeedConfig& c, const Json& v) {
  TESSERA_CHECK(v.is_string(), c.source, ": \"communication_data_type\" must be \"fp32\", \"fp16\" or \"bf16\", got ", v.dump());
  const std::string d = v.get<std::string>();
  TESSERA_CHECK(d == "fp32" || d == "fp16" || d == "bf16", c.source,
                ": \"communication_data_type\" must be \"fp32\", \"fp16\" or \"bf16\", got \"", d, "\"");
  c.communication_data_type = d;
}

std::string normalised(std::string name) {
  for (char& ch : name)
    ch = ch == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return name;
}

}  // namespace

void refuse_contradiction(bool agree, const std::string& one, const std::string& one_value,
                          const std::string& other, const std::string& other_value) {
  TESSERA_CHECK(agree, one, " is ", one_value, " but ", other, " is ", other_value,
                "; they contradict each other");
}

int fsdp_sharding_stage(const std::string& name) {
  const std::string n = normalised(name);
  if (n == "FULL_SHARD" || n == "HYBRID_SHARD") return 3;
  if (n == "SHARD_GRAD_OP" || n == "_HYBRID_SHARD_ZERO2" || n == "HYBRID_SHARD_ZERO2") return 2;
  if (n == "NO_SHARD") return 0;
  TESSERA_FAIL(
      "FSDP sharding strategy must be FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2), ",
      "HYBRID_SHARD (ZeRO-3 within groups of hybrid_shard_size ranks), _HYBRID_SHARD_ZERO2 ",
      "(ZeRO-2 likewise) or NO_SHARD (DDP); got '", name, "'");
}

bool fsdp_sharding_is_hybrid(const std::string& name) {
  const std::string n = normalised(name);
  return n == "HYBRID_SHARD" || n == "_HYBRID_SHARD_ZERO2" || n == "HYBRID_SHARD_ZERO2";
}

DeepSpeedConfig DeepSpeedConfig::from_json(const Json& config, const std::string& source) {
  DeepSpeedConfig c;
  c.source = source;
  check_keys(config,
             {"zero_optimization", "gradient_accumulation_steps", "gradient_clipping", "bf16", "bfloat16",
              "fp16", "amp", "optimizer", "scheduler", "communication_data_type",
              "train_micro_batch_size_per_gpu", "train_batch_size"},
             "", source);
  TESSERA_CHECK(!config.contains("amp"), source,
                ": \"amp\" (NVIDIA Apex) is not supported; use \"fp16\" or \"bf16\"");
  TESSERA_CHECK(!config.contains("scheduler"), source,
                ": \"scheduler\" (DeepSpeed's WarmupLR, WarmupDecayLR, ...) is not supported; give "
                "the schedule as lr_scheduler_type / warmup_steps (transformers' names) or --schedule");
  TESSERA_CHECK(!(config.contains("bf16") && config.contains("bfloat16")), source,
                ": \"bf16\" and \"bfloat16\" are the same block; give one");
  if (config.contains("zero_optimization")) read_zero_optimization(c, config["zero_optimization"]);
  if (config.contains("optimizer")) read_optimizer(c, config["optimizer"]);
  if (config.contains("communication_data_type")) read_communication_dtype(c, config["communication_data_type"]);
  if (config.contains("gradient_accumulation_steps"))
    c.gradient_accumulation_steps =
        integer(config["gradient_accumulation_steps"], "gradient_accumulation_steps", source, 1);
  if (config.contains("gradient_clipping")) {
    const Json& v = config["gradient_clipping"];
    if (!is_auto(v)) {
      TESSERA_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() >= 0, source,
                    ": \"gradient_clipping\" must be a number >= 0 or \"auto\", got ", v.dump());
      c.gradient_clipping = v.get<double>();
    }
  }
  if (config.contains("train_micro_batch_size_per_gpu"))
    c.train_micro_batch_size_per_gpu = integer(config["train_micro_batch_size_per_gpu"],
                                               "train_micro_batch_size_per_gpu", source, 1);
  if (config.contains("train_batch_size"))
    c.train_batch_size = integer(config["train_batch_size"], "train_batch_size", source, 1);
  const auto bf16 = precision_enabled(c, config, config.contains("bfloat16") ? "bfloat16" : "bf16");
  const auto fp16 = precision_enabled(c, config, "fp16");
  TESSERA_CHECK(!(bf16.value_or(false) && fp16.value_or(false)), source,
                ": \"bf16.enabled\" and \"fp16.enabled\" are both true; choose one");
  if (bf16.value_or(false))
    c.mixed_precision = "bf16";
  else if (fp16.value_or(false))
    c.mixed_precision = "fp16";
  else if (bf16 || fp16)
    c.mixed_precision = "no";
  // Whole batches only: the three sizes are tied by train = micro x accumulation x world.
  if (c.train_batch_size && c.train_micro_batch_size_per_gpu && c.gradient_accumulation_steps)
    TESSERA_CHECK(*c.train_batch_size % (*c.train_micro_batch_size_per_gpu * *c.gradient_accumulation_steps) == 0,
                  source, ": \"train_batch_size\" ", *c.train_batch_size,
                  " is not a multiple of train_micro_batch_size_per_gpu x gradient_accumulation_steps = ",
                  *c.train_micro_batch_size_per_gpu * *c.gradient_accumulation_steps);
  // Offload needs shards to move: parameters only exist sharded under stage 3.
  const int stage = c.zero_stage.value_or(-1);
  TESSERA_CHECK(
      !c.offload_param.value_or(false) || stage == 3 || stage == -1, source,
      ": \"zero_optimization.offload_param.device\" is \"cpu\" but \"zero_optimization.stage\" is ",
      stage, "; parameter offload needs stage 3");
  TESSERA_CHECK(!c.offload_optimizer.value_or(false) || stage != 0, source,
                ": \"zero_optimization.offload_optimizer.device\" is \"cpu\" but "
                "\"zero_optimization.stage\" is 0 "
                "(DDP keeps no optimizer shards to offload)");
  return c;
}

DeepSpeedConfig DeepSpeedConfig::read(const std::string& path) {
  std::string text;
  try {
    text = read_file(path);
  } catch (const Error& e) {
    TESSERA_FAIL("DeepSpeed config '", path, "': cannot read it: ", e.what());
  }
  Json config;
  try {
    config = Json::parse(text);
  } catch (const Json::parse_error& e) {
    TESSERA_FAIL("DeepSpeed config '", path, "': not valid JSON at byte ", e.byte, ": ", e.what());
  }
  DeepSpeedConfig c = from_json(config, "DeepSpeed config '" + path + "'");
  c.path = path;
  return c;
}

void DeepSpeedConfig::apply_to(AcceleratorOptions& o) const {
  auto agree = [&](bool explicit_value, bool same, const std::string& key,
                   const std::string& option, const std::string& theirs, const std::string& ours) {
    refuse_contradiction(!explicit_value || same, source + ": \"" + key + "\"", theirs, option,
                         ours);
  };
  if (zero_stage) {
    agree(o.zero_stage >= 0, o.zero_stage == *zero_stage, "zero_optimization.stage", "zero_stage",
          std::to_string(*zero_stage), std::to_string(o.zero_stage));
    o.zero_stage = *zero_stage;
  }
  if (mixed_precision) {
    agree(!o.mixed_precision.empty(), o.mixed_precision == *mixed_precision, "bf16/fp16.enabled",
          "mixed_precision", *mixed_precision, o.mixed_precision);
    o.mixed_precision = *mixed_precision;
  }
  if (gradient_accumulation_steps) {
    agree(o.gradient_accumulation_steps > 1,
          o.gradient_accumulation_steps == *gradient_accumulation_steps,
          "gradient_accumulation_steps", "gradient_accumulation_steps",
          std::to_string(*gradient_accumulation_steps),
          std::to_string(o.gradient_accumulation_steps));
    o.gradient_accumulation_steps = static_cast<int>(*gradient_accumulation_steps);
  }
  if (offload_optimizer) {
    agree(o.offload_optimizer, *offload_optimizer, "zero_optimization.offload_optimizer.device",
          "offload_optimizer", *offload_optimizer ? "cpu" : "none", "on");
    o.offload_optimizer = *offload_optimizer;
  }
  if (offload_param) {
    agree(o.offload_param, *offload_param, "zero_optimization.offload_param.device",
          "offload_param", *offload_param ? "cpu" : "none", "on");
    o.offload_param = *offload_param;
  }
  if (reduce_bucket_size) {
    const size_t bytes = static_cast<size_t>(*reduce_bucket_size) * 4;  // f32 gradients
    agree(o.bucket_bytes != kDefaultBucketBytes, o.bucket_bytes == bytes,
          "zero_optimization.reduce_bucket_size", "bucket_bytes",
          std::to_string(*reduce_bucket_size) + " elements (" + std::to_string(bytes) + " bytes)",
          std::to_string(o.bucket_bytes) + " bytes");
    o.bucket_bytes = bytes;
  }
  if (hybrid_shard_size) {
    agree(o.hybrid_shard_size >= 0, o.hybrid_shard_size == *hybrid_shard_size,
          "zero_optimization.mics_shard_size", "hybrid_shard_size",
          std::to_string(*hybrid_shard_size), std::to_string(o.hybrid_shard_size));
    o.hybrid_shard_size = *hybrid_shard_size;
  }
  if (stage3_prefetch_bucket_size) o.stage3_prefetch_bucket_size = *stage3_prefetch_bucket_size;
  // What is gathered ahead is live beside the running unit: the cap bounds the prefetch.
  if (stage3_max_live_parameters)
    o.stage3_prefetch_bucket_size = std::min(o.stage3_prefetch_bucket_size, *stage3_max_live_parameters);
  if (ignore_unused_parameters) o.find_unused_parameters = o.find_unused_parameters || *ignore_unused_parameters;
  if (communication_data_type) {
    agree(!o.reduce_dtype.empty(), o.reduce_dtype == *communication_data_type, "communication_data_type",
          "reduce_dtype", *communication_data_type, o.reduce_dtype);
    o.reduce_dtype = *communication_data_type;
  }
  if (loss_scaler && !o.loss_scaler) o.loss_scaler = loss_scaler;
  // DeepSpeed double-buffers its buckets under overlap_comm: one filling, one being reduced.
  if (overlap_comm) {
    const size_t buckets = *overlap_comm ? 2 : 1;
    agree(o.max_buckets_in_flight != kDefaultBucketsInFlight, o.max_buckets_in_flight == buckets,
          "zero_optimization.overlap_comm", "max_buckets_in_flight",
          std::string(*overlap_comm ? "true" : "false") + " (" + std::to_string(buckets) +
              " bucket(s) in flight)",
          std::to_string(o.max_buckets_in_flight));
    o.max_buckets_in_flight = buckets;
  }
}

}  // namespace tessera::dist
