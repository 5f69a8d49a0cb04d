#include "tessera/dist/deepspeed_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "tessera/core/error.h"
#include "tessera/data/file_io.h"
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
  check_keys(block, {"device", "pin_memory"}, prefix, source);
  if (block.contains("pin_memory")) boolean(block["pin_memory"], prefix + ".pin_memory", source);
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

void read_zero_optimization(DeepSpeedConfig& c, const Json& z) {
  const std::string p = "zero_optimization";
  check_keys(
      z,
      {"stage", "offload_optimizer", "offload_param", "reduce_bucket_size",
       "stage3_prefetch_bucket_size", "overlap_comm", "contiguous_gradients", "reduce_scatter",
       "allgather_partitions", "stage3_gather_16bit_weights_on_model_save"},
      p, c.source);
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
  if (z.contains("reduce_bucket_size"))
    c.reduce_bucket_size = integer(z["reduce_bucket_size"], p + ".reduce_bucket_size", c.source, 1);
  if (z.contains("stage3_prefetch_bucket_size"))
    c.stage3_prefetch_bucket_size =
        integer(z["stage3_prefetch_bucket_size"], p + ".stage3_prefetch_bucket_size", c.source, 0);
  // overlap_comm: whether a bucket's reduction overlaps the next bucket's gradients.
  if (z.contains("overlap_comm")) c.overlap_comm = boolean(z["overlap_comm"], p + ".overlap_comm", c.source);
  // What Tessera always does: true is accepted, false would be a promise it cannot keep.
  for (const char* always : {"contiguous_gradients", "reduce_scatter", "allgather_partitions",
                             "stage3_gather_16bit_weights_on_model_save"}) {
    if (!z.contains(always)) continue;
    const auto on = boolean(z[always], p + "." + always, c.source);
    TESSERA_CHECK(!on || *on, c.source, ": \"", p, ".", always,
                  "\": false is not supported (Tessera always does this)");
  }
}

// bf16.enabled / fp16.enabled.
std::optional<bool> precision_enabled(const Json& config, const char* name,
                                      const std::string& source) {
  if (!config.contains(name)) return std::nullopt;
  const Json& block = config[name];
  if (std::string(name) == "fp16")
    check_keys(block,
               {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                "min_loss_scale"},
               name, source);
  else
    check_keys(block, {"enabled"}, name, source);
  if (std::string(name) == "fp16" && block.contains("loss_scale")) {
    const Json& scale = block["loss_scale"];
    TESSERA_CHECK(
        scale.is_number() && scale.get<double>() == 0, source,
        ": \"fp16.loss_scale\" must be 0 (dynamic loss scaling, the only kind Tessera has), got ",
        scale.dump());
  }
  return block.contains("enabled")
             ? boolean(block["enabled"], std::string(name) + ".enabled", source)
             : std::nullopt;
}

std::string normalised(std::string name) {
  for (char& ch : name)
    ch = ch == '-' ? '_' : static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  return name;
}

}  // namespace

int fsdp_sharding_stage(const std::string& name) {
  const std::string n = normalised(name);
  if (n == "FULL_SHARD") return 3;
  if (n == "SHARD_GRAD_OP") return 2;
  if (n == "NO_SHARD") return 0;
  TESSERA_FAIL("FSDP sharding strategy must be FULL_SHARD (ZeRO-3), SHARD_GRAD_OP (ZeRO-2) or ",
               "NO_SHARD (DDP); got '", name, "'",
               n == "HYBRID_SHARD" || n == "_HYBRID_SHARD_ZERO2"
                   ? " (hybrid sharding is not supported)"
                   : "");
}

DeepSpeedConfig DeepSpeedConfig::from_json(const Json& config, const std::string& source) {
  DeepSpeedConfig c;
  c.source = source;
  check_keys(config,
             {"zero_optimization", "gradient_accumulation_steps", "gradient_clipping", "bf16",
              "fp16", "train_micro_batch_size_per_gpu", "train_batch_size"},
             "", source);
  if (config.contains("zero_optimization")) read_zero_optimization(c, config["zero_optimization"]);
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
  const auto bf16 = precision_enabled(config, "bf16", source);
  const auto fp16 = precision_enabled(config, "fp16", source);
  TESSERA_CHECK(!(bf16.value_or(false) && fp16.value_or(false)), source,
                ": \"bf16.enabled\" and \"fp16.enabled\" are both true; choose one");
  if (bf16.value_or(false))
    c.mixed_precision = "bf16";
  else if (fp16.value_or(false))
    c.mixed_precision = "fp16";
  else if (bf16 || fp16)
    c.mixed_precision = "no";
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
    text = data::read_file(path);
  } catch (const Error& e) {
    TESSERA_FAIL("DeepSpeed config '", path, "': cannot read it: ", e.what());
  }
  Json config;
  try {
    config = Json::parse(text);
  } catch (const Json::parse_error& e) {
    TESSERA_FAIL("DeepSpeed config '", path, "': not valid JSON at byte ", e.byte, ": ", e.what());
  }
  return from_json(config, "DeepSpeed config '" + path + "'");
}

void DeepSpeedConfig::apply_to(AcceleratorOptions& o) const {
  auto agree = [&](bool explicit_value, bool same, const std::string& key,
                   const std::string& option, const std::string& theirs, const std::string& ours) {
    TESSERA_CHECK(!explicit_value || same, source, ": \"", key, "\" is ", theirs, " but ", option,
                  " is ", ours, "; they contradict each other");
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
    const size_t default_bytes = AcceleratorOptions{}.bucket_bytes;
    agree(o.bucket_bytes != default_bytes, o.bucket_bytes == bytes,
          "zero_optimization.reduce_bucket_size", "bucket_bytes",
          std::to_string(*reduce_bucket_size) + " elements (" + std::to_string(bytes) + " bytes)",
          std::to_string(o.bucket_bytes) + " bytes");
    o.bucket_bytes = bytes;
  }
  if (stage3_prefetch_bucket_size) o.stage3_prefetch_bucket_size = *stage3_prefetch_bucket_size;
  // DeepSpeed double-buffers its buckets under overlap_comm: one filling, one being reduced.
  if (overlap_comm) {
    const size_t buckets = *overlap_comm ? 2 : 1;
    const size_t default_buckets = AcceleratorOptions{}.max_buckets_in_flight;
    agree(o.max_buckets_in_flight != default_buckets, o.max_buckets_in_flight == buckets,
          "zero_optimization.overlap_comm", "max_buckets_in_flight",
          std::string(*overlap_comm ? "true" : "false") + " (" + std::to_string(buckets) +
              " bucket(s) in flight)",
          std::to_string(o.max_buckets_in_flight));
    o.max_buckets_in_flight = buckets;
  }
}

}  // namespace tessera::dist
