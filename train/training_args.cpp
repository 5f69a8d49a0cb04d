#include "tessera/train/training_args.h"

#include <cmath>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "tessera/core/device.h"
#include "tessera/core/error.h"
#include "tessera/dist/deepspeed_config.h"
#include "tessera/dist/env.h"
#include "tessera/optim/transformers_schedules.h"
#include "tessera/train/preemption.h"
#include "tessera/train/yaml_file.h"

namespace tessera::train {

namespace {

using Json = nlohmann::json;
using Args = TrainingArguments;

// TextOrFlag: resume_from_checkpoint (a path, or true = the newest); Object: a JSON object
// (or its text, as transformers accepts for lr_scheduler_kwargs).
enum class Kind { Int, Real, Text, Flag, List, TextOrFlag, Object };

struct Field {
  Kind kind;
  std::function<void(Args&, const Json&)> set;
  std::function<Json(const Args&)> get;
};

template <class T>
Field field(Kind kind, T Args::*member) {
  return {kind, [member](Args& a, const Json& v) { a.*member = v.get<T>(); },
          [member](const Args& a) { return Json(a.*member); }};
}

// transformers' default for greater_is_better: true unless the metric is a loss (a
// perplexity too, here).
bool higher_is_better(const std::string& metric) {
  return !(metric.ends_with("loss") || metric.ends_with("perplexity"));
}

// Accelerate's ParallelismConfig {tp_size, dp_replicate_size, dp_shard_size, cp_size}: tp_size
// is Tessera's; dp_replicate_size is the dp axis (DDP, or zero_stage 1/2 on it). FSDP sharding
// of that axis (dp_shard_size > 1) is Tessera's zero_stage/fsdp, and context parallelism does
// not exist here: both are refused rather than read as something else.
void apply_parallelism_config(Args& a, const Json& v) {
  const std::string where = a.describe("parallelism_config");
  int64_t replicate = -1, shard = 1;
  for (const auto& [key, value] : v.items()) {
    TESSERA_CHECK(value.is_number_integer() && value.get<int64_t>() >= 1, where, ": \"", key,
                  "\" must be a whole number >= 1, got ", value.dump());
    const int64_t n = value.get<int64_t>();
    if (key == "tp_size") {
      a.tp_size = n;
    } else if (key == "dp_replicate_size") {
      replicate = n;
    } else if (key == "dp_shard_size") {
      shard = n;
    } else if (key == "cp_size") {
      TESSERA_CHECK(n == 1, where, ": cp_size ", n,
                    " asks for context parallelism, which Tessera does not have (cp_size must be "
                    "1)");
    } else {
      TESSERA_FAIL(where, ": unknown key \"", key,
                   "\" (Accelerate's ParallelismConfig: tp_size, dp_replicate_size, "
                   "dp_shard_size, cp_size; pipeline stages are Tessera's pp_size)");
    }
  }
  TESSERA_CHECK(shard == 1, where, ": dp_shard_size ", shard,
                " asks for FSDP sharding of the dp axis; Tessera's dp axis runs DDP or ZeRO: give "
                "dp_replicate_size for its size and zero_stage (or fsdp) for the sharding");
  a.dp_size = replicate;
}

const std::map<std::string, Field>& fields() {
  static const std::map<std::string, Field> all = {
      {"output_dir", field(Kind::Text, &Args::output_dir)},
      {"per_device_train_batch_size", field(Kind::Int, &Args::per_device_train_batch_size)},
      {"per_device_eval_batch_size", field(Kind::Int, &Args::per_device_eval_batch_size)},
      {"gradient_accumulation_steps", field(Kind::Int, &Args::gradient_accumulation_steps)},
      {"max_steps", field(Kind::Int, &Args::max_steps)},
      {"num_train_epochs", field(Kind::Real, &Args::num_train_epochs)},
      {"learning_rate", field(Kind::Real, &Args::learning_rate)},
      {"weight_decay", field(Kind::Real, &Args::weight_decay)},
      {"adam_beta1", field(Kind::Real, &Args::adam_beta1)},
      {"adam_beta2", field(Kind::Real, &Args::adam_beta2)},
      {"adam_epsilon", field(Kind::Real, &Args::adam_epsilon)},
      {"max_grad_norm", field(Kind::Real, &Args::max_grad_norm)},
      {"lr_scheduler_type", field(Kind::Text, &Args::lr_scheduler_type)},
      {"lr_scheduler_kwargs", field(Kind::Object, &Args::lr_scheduler_kwargs)},
      {"schedule", field(Kind::Text, &Args::schedule)},
      {"logging_strategy", field(Kind::Text, &Args::logging_strategy)},
      {"logging_dir", field(Kind::Text, &Args::logging_dir)},
      {"save_only_model", field(Kind::Flag, &Args::save_only_model)},
      {"dataloader_num_workers", field(Kind::Int, &Args::dataloader_num_workers)},
      {"push_to_hub",
       {Kind::Flag,
        [](Args& a, const Json& v) {
          TESSERA_CHECK(!v.get<bool>(), a.describe("push_to_hub"),
                        " is true, but Tessera does not reach the network (no Hugging Face Hub "
                        "uploads); train with push_to_hub false and upload the model folder "
                        "yourself (e.g. huggingface-cli upload)");
          a.push_to_hub = false;
        },
        [](const Args& a) { return Json(a.push_to_hub); }}},
      {"warmup_steps", field(Kind::Int, &Args::warmup_steps)},
      {"warmup_ratio", field(Kind::Real, &Args::warmup_ratio)},
      {"logging_steps", field(Kind::Int, &Args::logging_steps)},
      {"eval_strategy", field(Kind::Text, &Args::eval_strategy)},
      {"eval_steps", field(Kind::Int, &Args::eval_steps)},
      {"save_strategy", field(Kind::Text, &Args::save_strategy)},
      {"save_steps", field(Kind::Int, &Args::save_steps)},
      {"save_total_limit", field(Kind::Int, &Args::save_total_limit)},
      {"load_best_model_at_end", field(Kind::Flag, &Args::load_best_model_at_end)},
      {"metric_for_best_model",
       {Kind::Text,
        [](Args& a, const Json& v) {
          a.metric_for_best_model = evaluation_metric_name(v.get<std::string>());
        },
        [](const Args& a) { return Json(a.metric_for_best_model); }}},
      {"greater_is_better", field(Kind::Flag, &Args::greater_is_better)},
      {"seed", field(Kind::Int, &Args::seed)},
      {"bf16", field(Kind::Flag, &Args::bf16)},
      {"fp16", field(Kind::Flag, &Args::fp16)},
      {"gradient_checkpointing", field(Kind::Flag, &Args::gradient_checkpointing)},
      {"gradient_checkpointing_kwargs", field(Kind::Object, &Args::gradient_checkpointing_kwargs)},
      {"resume_from_checkpoint",
       {Kind::TextOrFlag,
        [](Args& a, const Json& v) {
          a.resume_from_checkpoint = v.is_boolean() ? (v.get<bool>() ? "latest" : "") : v.get<std::string>();
        },
        [](const Args& a) { return Json(a.resume_from_checkpoint); }}},
      {"report_to",
       {Kind::List,
        [](Args& a, const Json& v) {
          a.report_to.clear();
          for (const Json& name : v) {
            if (name == "all") {  // transformers: every integration installed
              a.report_to.insert(a.report_to.end(), {"jsonl", "tensorboard", "csv", "mlflow"});
              continue;
            }
            a.report_to.push_back(name.get<std::string>());
          }
        },
        [](const Args& a) { return Json(a.report_to); }}},
      {"overwrite_output_dir", field(Kind::Flag, &Args::overwrite_output_dir)},
      {"preempt_signals", field(Kind::List, &Args::preempt_signals)},
      {"preempt_grace", field(Kind::Real, &Args::preempt_grace)},
      {"data", field(Kind::Text, &Args::data)},
      {"val_data", field(Kind::Text, &Args::val_data)},
      {"init", field(Kind::Text, &Args::init)},
      {"arch", field(Kind::Text, &Args::arch)},
      {"n_layer", field(Kind::Int, &Args::n_layer)},
      {"n_kv_head", field(Kind::Int, &Args::n_kv_head)},
      {"intermediate_size", field(Kind::Int, &Args::intermediate_size)},
      {"rope_theta", field(Kind::Real, &Args::rope_theta)},
      {"tie_word_embeddings", field(Kind::Flag, &Args::tie_word_embeddings)},
      {"n_head", field(Kind::Int, &Args::n_head)},
      {"n_embd", field(Kind::Int, &Args::n_embd)},
      {"block_size", field(Kind::Int, &Args::block_size)},
      {"vocab_size", field(Kind::Int, &Args::vocab_size)},
      {"seq", field(Kind::Int, &Args::seq)},
      {"shuffle", field(Kind::Flag, &Args::shuffle)},
      {"sampling", field(Kind::Text, &Args::sampling)},
      {"dropout", field(Kind::Real, &Args::dropout)},
      {"min_lr", field(Kind::Real, &Args::min_lr)},
      {"eval_batches", field(Kind::Int, &Args::eval_batches)},
      {"sample_every", field(Kind::Int, &Args::sample_every)},
      {"early_stopping_patience", field(Kind::Int, &Args::early_stopping_patience)},
      {"early_stopping_threshold", field(Kind::Real, &Args::early_stopping_threshold)},
      {"device", field(Kind::Text, &Args::device)},
      {"zero_stage", field(Kind::Int, &Args::zero_stage)},
      {"offload", field(Kind::Text, &Args::offload)},
      {"zero_accumulation", field(Kind::Text, &Args::zero_accumulation)},
      {"deepspeed", field(Kind::Text, &Args::deepspeed)},
      {"fsdp", field(Kind::Text, &Args::fsdp)},
      {"hybrid_shard_size", field(Kind::Int, &Args::hybrid_shard_size)},
      {"memory_report", field(Kind::Flag, &Args::memory_report)},
      {"dp_size", field(Kind::Int, &Args::dp_size)},
      {"tp_size", field(Kind::Int, &Args::tp_size)},
      {"pp_size", field(Kind::Int, &Args::pp_size)},
      {"pipeline_micro_batches", field(Kind::Int, &Args::pipeline_micro_batches)},
      {"pipeline_schedule", field(Kind::Text, &Args::pipeline_schedule)},
      // Accelerate's ParallelismConfig as a nested mapping: the same fields as tp_size and
      // dp_size, not a setting of its own (to_json writes those).
      {"parallelism_config",
       {Kind::Object, apply_parallelism_config,
        [](const Args& a) {
          return Json{{"tp_size", a.tp_size}, {"dp_replicate_size", a.dp_size}};
        }}},
      {"reduce_dtype", field(Kind::Text, &Args::reduce_dtype)},
      // fp32 | bf16 | fp16: the `--dtype` flag, stored as Hugging Face's bf16/fp16 switches.
      {"dtype",
       {Kind::Text,
        [](Args& a, const Json& v) {
          const std::string d = v.get<std::string>();
          TESSERA_CHECK(d == "fp32" || d == "bf16" || d == "fp16", a.describe("dtype"),
                        " must be fp32, bf16 or fp16 (got \"", d, "\")");
          a.bf16 = d == "bf16";
          a.fp16 = d == "fp16";
        },
        [](const Args& a) { return Json(a.dtype()); }}},
  };
  return all;
}

// The `tessera train` flag names (and nanoGPT-style short names) of Hugging Face settings.
const std::map<std::string, std::string>& aliases() {
  static const std::map<std::string, std::string> all = {
      {"out", "output_dir"},
      {"batch", "per_device_train_batch_size"},
      {"eval_batch", "per_device_eval_batch_size"},
      {"grad_accum", "gradient_accumulation_steps"},
      {"steps", "max_steps"},
      {"lr", "learning_rate"},
      {"beta1", "adam_beta1"},
      {"beta2", "adam_beta2"},
      {"eps", "adam_epsilon"},
      {"grad_clip", "max_grad_norm"},
      {"warmup", "warmup_steps"},
      {"eval_every", "eval_steps"},
      {"save_every", "save_steps"},
      {"keep_last", "save_total_limit"},
      {"resume", "resume_from_checkpoint"},
      {"evaluation_strategy", "eval_strategy"},
      {"model_type", "arch"},
      {"num_key_value_heads", "n_kv_head"},
      {"tie", "tie_word_embeddings"},
      {"micro_batches", "pipeline_micro_batches"},
  };
  return all;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Int:
      return "an integer";
    case Kind::Real:
      return "a finite number";
    case Kind::Text:
      return "a string";
    case Kind::Flag:
      return "true or false";
    case Kind::List:
      return "a list of strings";
    case Kind::TextOrFlag:
      return "a string or true/false";
    case Kind::Object:
      return "a JSON object";
  }
  return "?";
}

std::string underscored(std::string key) {
  for (char& c : key)
    if (c == '-') c = '_';
  return key;
}

// Checks a value against the key's type: a number in quotes is text, not a number (flags
// arrive typed from CLI11; YAML scalars are typed by train/yaml_file.h).
Json typed_value(const std::string& what, Kind kind, const Json& value) {
  auto fail = [&]() -> Json {
    TESSERA_FAIL(what, " must be ", kind_name(kind), ", got ", value.dump());
  };
  switch (kind) {
    case Kind::Int:
      // An unsigned number above int64's range would wrap to a negative one in get<int64_t>().
      if (value.is_number_unsigned() && value.get<uint64_t>() > uint64_t(INT64_MAX))
        TESSERA_FAIL(what, " is ", value.dump(), ", out of range (at most ", INT64_MAX, ")");
      if (value.is_number_integer()) return value;
      if (value.is_number_float()) {
        const double d = value.get<double>();
        if (std::isfinite(d) && std::fabs(d) < 9e15 && d == std::floor(d))
          return static_cast<int64_t>(d);
      }
      return fail();
    case Kind::Real:
      if (value.is_number() && std::isfinite(value.get<double>())) return value.get<double>();
      return fail();
    case Kind::Text:
      return value.is_string() ? value : fail();
    case Kind::Flag:
      return value.is_boolean() ? value : fail();
    case Kind::TextOrFlag:
      return value.is_string() || value.is_boolean() ? value : fail();
    case Kind::Object: {
      if (value.is_object()) return value;
      if (!value.is_string()) return fail();
      const Json parsed = Json::parse(value.get<std::string>(), nullptr, false);
      return parsed.is_object() ? parsed : fail();
    }
    case Kind::List: {
      if (value.is_string()) {  // "jsonl,tensorboard" from a flag or YAML
        Json list = Json::array();
        std::stringstream in(value.get<std::string>());
        std::string item;
        while (std::getline(in, item, ','))
          if (!item.empty()) list.push_back(item);
        return list;
      }
      if (!value.is_array()) return fail();
      for (const Json& item : value)
        if (!item.is_string()) return fail();
      return value;
    }
  }
  return fail();
}

// Strict JSON: a key given twice in the settings object is an error (nlohmann would keep
// the last), and so is a number beyond double range (named with its key).
Json parse_strict_json(const std::string& text, const std::string& path) {
  std::set<std::string> seen;
  std::string last_key;
  auto on_event = [&](int depth, Json::parse_event_t event, Json& parsed) {
    if (event == Json::parse_event_t::key && depth == 1) {
      last_key = parsed.get<std::string>();
      TESSERA_CHECK(seen.insert(last_key).second, "config '", path, "': key \"", last_key,
                    "\" is given twice");
    }
    return true;
  };
  try {
    return Json::parse(text, on_event);
  } catch (const Json::parse_error& e) {
    TESSERA_FAIL("config '", path, "': not valid JSON at byte ", e.byte, ": ", e.what());
  } catch (const Json::out_of_range& e) {
    TESSERA_FAIL("config '", path, "': key \"", last_key, "\": a number is out of range (",
                 e.what(), ")");
  }
}

}  // namespace

// transformers' rule: a name without "eval_" gets it (metric_for_best_model "accuracy" is
// the evaluation's eval_accuracy). Tessera's old names (val_loss, val_perplexity,
// val_token_accuracy, token_accuracy) still read as their eval_ counterparts.
std::string evaluation_metric_name(const std::string& name) {
  std::string bare = name.starts_with("val_") ? name.substr(4) : name;
  if (bare == "token_accuracy") bare = "accuracy";
  return bare.starts_with("eval_") ? bare : "eval_" + bare;
}


const std::vector<std::string>& training_argument_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const auto& [name, f] : fields())
      if (name != "dtype" && name != "parallelism_config") k.push_back(name);
    return k;
  }();
  return keys;
}

std::string canonical_key(const std::string& key) {
  const std::string k = underscored(key);
  if (auto it = aliases().find(k); it != aliases().end()) return it->second;
  return fields().count(k) ? k : std::string();
}

const std::vector<std::string>& model_shape_keys() {
  static const std::vector<std::string> keys = {
      "arch",       "n_layer",    "n_head",     "n_embd", "n_kv_head",          "intermediate_size",
      "rope_theta", "block_size", "vocab_size", "init",   "tie_word_embeddings"};
  return keys;
}

Json TrainingArguments::to_json() const {
  Json j = Json::object();
  for (const std::string& key : training_argument_keys()) j[key] = fields().at(key).get(*this);
  return j;
}

Json TrainingArguments::value(const std::string& key) const {
  const std::string canonical = canonical_key(key);
  TESSERA_CHECK(!canonical.empty(), "TrainingArguments: no setting is called \"", key, "\"");
  return fields().at(canonical).get(*this);
}

std::string TrainingArguments::describe(const std::string& canonical) const {
  auto it = given.find(canonical);
  if (it == given.end()) return "config: key \"" + canonical + "\"";
  const auto& [name, source] = it->second;
  return source + ": key \"" + name + "\"" + (name == canonical ? "" : " (" + canonical + ")");
}

Json read_config_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), "config '", path, "': cannot open");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const bool yaml = path.ends_with(".yaml") || path.ends_with(".yml");
  Json j = yaml ? parse_yaml(text, path) : parse_strict_json(text, path);
  TESSERA_CHECK(j.is_object(), "config '", path, "': expected ", yaml ? "a YAML mapping" : "a JSON object",
                " of settings");
  return j;
}

void apply_config_values(TrainingArguments& args, const Json& values, const std::string& source) {
  std::map<std::string, std::string> seen;  // canonical -> name used in this source
  for (const auto& [raw_key, value] : values.items()) {
    const std::string key = canonical_key(raw_key);
    if (key.empty()) {
      std::string known;
      for (const auto& k : training_argument_keys()) known += (known.empty() ? "" : ", ") + k;
      TESSERA_FAIL(source, ": unknown key \"", raw_key, "\" (known keys: ", known,
                   "; and the flag names: --steps, --lr, --batch, ...)");
    }
    // "dtype" sets both precision switches, so it clashes with either of them.
    auto earlier = [&](const std::string& k) { return seen.count(k) ? seen[k] : std::string(); };
    std::string prior = earlier(key);
    if (prior.empty() && key == "dtype")
      prior = earlier("bf16").empty() ? earlier("fp16") : earlier("bf16");
    if (prior.empty() && (key == "bf16" || key == "fp16")) prior = earlier("dtype");
    // parallelism_config sets tp_size and dp_size.
    for (const char* mesh_key : {"tp_size", "dp_size"}) {
      if (prior.empty() && key == "parallelism_config") prior = earlier(mesh_key);
      if (prior.empty() && key == mesh_key) prior = earlier("parallelism_config");
    }
    TESSERA_CHECK(prior.empty(), source, ": key \"", raw_key, "\" and \"", prior,
                  "\" set the same setting (", key, ")");
    seen[key] = raw_key;
    const std::string what = source + ": key \"" + raw_key + "\"";
    args.given[key] = {raw_key, source};
    const Field& f = fields().at(key);
    f.set(args, typed_value(what, f.kind, value));
  }
  if (seen.count("metric_for_best_model") && !args.given.count("greater_is_better"))
    args.greater_is_better = higher_is_better(args.metric_for_best_model);
}

namespace {

optim::SchedulerKwargs scheduler_kwargs(const TrainingArguments& a) {
  optim::SchedulerKwargs k;
  for (const auto& [key, value] : a.lr_scheduler_kwargs.items()) {
    const bool number = value.is_number() && std::isfinite(value.get<double>());
    TESSERA_CHECK(number, a.describe("lr_scheduler_kwargs"), ": \"", key, "\" must be a number, got ",
                  value.dump());
    const double v = value.get<double>();
    if (key == "num_cycles") k.num_cycles = v;
    else if (key == "min_lr") k.min_lr = v;
    else if (key == "min_lr_rate") k.min_lr_rate = v;
    else if (key == "lr_end") k.lr_end = v;
    else if (key == "power") k.power = v;
    else if (key == "timescale" && v == std::floor(v)) k.timescale = static_cast<int64_t>(v);
    else
      TESSERA_FAIL(a.describe("lr_scheduler_kwargs"), ": \"", key, "\" is not a keyword of any "
                   "supported schedule (num_cycles, min_lr, min_lr_rate, lr_end, power, timescale "
                   "as a whole number)");
  }
  return k;
}

// Tessera's `schedule` or transformers' lr_scheduler_type, not a mixture of their settings.
template <class Require>
void validate_schedule(const TrainingArguments& a, Require& require) {
  require(a.schedule == "constant" || a.schedule == "cosine" || a.schedule == "linear", "schedule",
          "must be constant, cosine or linear", a.schedule);
  const std::string& type = a.lr_scheduler_type;
  if (type.empty()) {
    require(a.lr_scheduler_kwargs.empty(), "lr_scheduler_kwargs",
            "needs lr_scheduler_type (transformers' schedules take them; --schedule does not)",
            a.lr_scheduler_kwargs);
    return;
  }
  try {
    optim::check_scheduler(type, scheduler_kwargs(a));
  } catch (const Error& e) {
    require(false, "lr_scheduler_type", e.what(), type);
  }
  require(!a.given.count("schedule"), "schedule",
          "is Tessera's own schedule, but lr_scheduler_type (transformers') is set too; give one",
          a.schedule);
  require(!a.given.count("min_lr"), "min_lr",
          "is the floor of Tessera's --schedule; with lr_scheduler_type use cosine_with_min_lr and "
          "lr_scheduler_kwargs {\"min_lr\": ...}",
          a.min_lr);
  require(type != "constant" || (a.warmup_steps == 0 && a.warmup_ratio == 0), "lr_scheduler_type",
          "is constant, which has no warmup (transformers ignores warmup_steps/warmup_ratio for it); "
          "use constant_with_warmup",
          type);
}

// The architecture and its own settings: Llama's are refused for GPT-2 (which has no such
// knob) rather than silently ignored.
template <class Require>
void validate_architecture(const TrainingArguments& a, Require& require) {
  require(a.arch == "gpt2" || a.arch == "llama", "arch", "must be gpt2 or llama", a.arch);
  require(!a.given.count("intermediate_size") || a.intermediate_size > 0, "intermediate_size",
          "must be positive (leave it out for the default, 8/3 n_embd rounded up to a multiple of "
          "64)",
          a.intermediate_size);
  require(a.n_kv_head >= 0 && a.intermediate_size >= 0,
          a.n_kv_head < 0 ? "n_kv_head" : "intermediate_size", "must not be negative",
          a.n_kv_head < 0 ? a.n_kv_head : a.intermediate_size);
  require(std::isfinite(a.rope_theta) && a.rope_theta > 0, "rope_theta", "must be positive",
          a.rope_theta);
  if (a.arch == "gpt2") {
    for (const char* key : {"n_kv_head", "intermediate_size", "rope_theta"})
      require(!a.given.count(key), key, "is a Llama setting; add --arch llama",
              fields().at(key).get(a));
    return;
  }
  if (a.n_kv_head > 0)
    require(a.n_head % a.n_kv_head == 0, "n_kv_head",
            "must divide n_head = " + std::to_string(a.n_head) + " (grouped-query attention)",
            a.n_kv_head);
  require((a.n_embd / a.n_head) % 2 == 0, "n_head",
          "must leave an even head size n_embd / n_head for rotary embeddings", a.n_head);
  require(a.dropout == 0, "dropout", "must be 0 for Llama (it has no dropout)", a.dropout);
}
// Whole numbers a schedule counts in doubles, and the most tokens one step may take: the
// products a run computes from its sizes must fit, so that no loop or message works with a
// wrapped number.
constexpr int64_t kMaxCount = int64_t(1) << 53;
constexpr int64_t kMaxTokensPerStep = int64_t(1) << 40;

template <class Require>
void validate_sizes(const TrainingArguments& a, Require& require) {
  const int64_t batch = a.per_device_train_batch_size, accum = a.gradient_accumulation_steps;
  if (batch <= 0 || a.seq <= 0 || accum <= 0) return;  // refused by their own checks
  int64_t tokens = 0;
  const bool overflow = __builtin_mul_overflow(batch, a.seq, &tokens) ||
                        __builtin_mul_overflow(tokens, accum, &tokens);
  require(!overflow && tokens <= kMaxTokensPerStep, "per_device_train_batch_size",
          "times seq = " + std::to_string(a.seq) + " times gradient_accumulation_steps = " +
              std::to_string(accum) + " is more than the 2^40 tokens a step may take",
          batch);
  require(a.eval_batch_size() <= kMaxTokensPerStep / a.seq, "per_device_eval_batch_size",
          "times seq = " + std::to_string(a.seq) + " is more than 2^40 tokens",
          a.eval_batch_size());
}

}  // namespace

int64_t TrainingArguments::total_steps(int64_t steps_per_epoch) const {
  if (max_steps > 0) return max_steps;
  if (num_train_epochs > 0) {
    const double steps = std::ceil(num_train_epochs * static_cast<double>(steps_per_epoch));
    TESSERA_CHECK(steps <= static_cast<double>(kMaxCount), describe("num_train_epochs"), " is ",
                  num_train_epochs, ", which makes ", steps, " steps of ", steps_per_epoch,
                  " per epoch, more than 2^53");
    return static_cast<int64_t>(steps);
  }
  return kDefaultMaxSteps;
}

nn::CheckpointPolicy gradient_checkpointing_policy(const TrainingArguments& a) {
  nn::CheckpointPolicy policy;
  try {  // read even when off, so a bad policy is refused wherever it is written
    policy = nn::CheckpointPolicy::from_kwargs(a.gradient_checkpointing_kwargs);
  } catch (const Error& e) {
    TESSERA_FAIL(a.describe("gradient_checkpointing_kwargs"), ": ", e.what());
  }
  return a.gradient_checkpointing ? policy : nn::CheckpointPolicy();
}

void validate(const TrainingArguments& a, bool needs_token_file) {
  auto require = [&](bool ok, const std::string& key, const std::string& what, const Json& got) {
    TESSERA_CHECK(ok, a.describe(key), " ", what, " (got ", got.dump(), ")");
  };
  require(!needs_token_file || !a.data.empty(), "data", "must name the training token file (--data)", a.data);
  for (auto [key, value] : {std::pair{"per_device_train_batch_size", a.per_device_train_batch_size},
                            {"seq", a.seq},
                            {"gradient_accumulation_steps", a.gradient_accumulation_steps},
                            {"eval_batches", a.eval_batches},
                            {"logging_steps", a.logging_steps},
                            {"save_total_limit", a.save_total_limit}})
    require(value > 0, key, "must be positive", value);
  for (auto [key, value] : {std::pair{"warmup_steps", a.warmup_steps},
                            {"eval_steps", a.eval_steps},
                            {"sample_every", a.sample_every},
                            {"save_steps", a.save_steps},
                            {"vocab_size", a.vocab_size},
                            {"block_size", a.block_size},
                            {"seed", a.seed},
                            {"per_device_eval_batch_size", a.per_device_eval_batch_size},
                            {"early_stopping_patience", a.early_stopping_patience}})
    require(value >= 0, key, "must not be negative", value);
  require(a.max_steps != 0 && a.max_steps >= -1, "max_steps",
          "must be positive (or -1: use num_train_epochs)", a.max_steps);
  // Schedules count their steps in doubles (whole numbers up to 2^53).
  require(a.max_steps <= kMaxCount, "max_steps", "must be at most 2^53", a.max_steps);
  require(!(a.given.count("max_steps") && a.max_steps == -1 && a.num_train_epochs <= 0),
          "max_steps",
          "is -1, which means \"train for num_train_epochs\", but num_train_epochs is not set",
          a.max_steps);
  validate_sizes(a, require);
  require(a.num_train_epochs >= 0, "num_train_epochs", "must not be negative", a.num_train_epochs);
  require(a.warmup_ratio >= 0 && a.warmup_ratio < 1, "warmup_ratio", "must be in [0, 1)",
          a.warmup_ratio);
  if (a.init.empty()) {
    for (auto [key, value] :
         {std::pair{"n_layer", a.n_layer}, {"n_head", a.n_head}, {"n_embd", a.n_embd}})
      require(value > 0, key, "must be positive", value);
    require(a.n_embd % a.n_head == 0, "n_head",
            "must divide n_embd = " + std::to_string(a.n_embd) + " into equal heads", a.n_head);
    const int64_t context = a.block_size > 0 ? a.block_size : a.seq;
    require(a.seq <= context, "seq",
            "is longer than the model context block_size = " + std::to_string(context), a.seq);
    validate_architecture(a, require);
  }
  require(a.learning_rate > 0, "learning_rate", "must be positive", a.learning_rate);
  require(a.min_lr <= a.learning_rate, "min_lr", "must not exceed learning_rate", a.min_lr);
  require(a.weight_decay >= 0, "weight_decay", "must not be negative", a.weight_decay);
  require(a.adam_beta1 >= 0 && a.adam_beta1 < 1, "adam_beta1", "must be in [0, 1)", a.adam_beta1);
  require(a.adam_beta2 >= 0 && a.adam_beta2 < 1, "adam_beta2", "must be in [0, 1)", a.adam_beta2);
  require(a.adam_epsilon > 0, "adam_epsilon", "must be positive", a.adam_epsilon);
  require(a.max_grad_norm >= 0, "max_grad_norm", "must not be negative (0 = no clipping)",
          a.max_grad_norm);
  require(a.early_stopping_threshold >= 0, "early_stopping_threshold", "must not be negative",
          a.early_stopping_threshold);
  validate_schedule(a, require);
  if (schedule_uses_total(a) && a.max_steps > 0)
    require(a.warmup_steps < a.max_steps, "warmup_steps",
            "must be shorter than max_steps = " + std::to_string(a.max_steps) +
                " for a decaying schedule",
            a.warmup_steps);
  for (const char* key : {"eval_strategy", "save_strategy", "logging_strategy"}) {
    const std::string v = fields().at(key).get(a).get<std::string>();
    require(v == "no" || v == "steps" || v == "epoch", key, "must be no, steps or epoch", v);
  }
  require(a.dataloader_num_workers >= 0, "dataloader_num_workers", "must not be negative",
          a.dataloader_num_workers);
  require(!(a.bf16 && a.fp16), "fp16", "cannot be set together with bf16", a.fp16);
  require(a.reduce_dtype.empty() || a.reduce_dtype == "fp32" || a.reduce_dtype == a.dtype(),
          "reduce_dtype", "must be fp32 or the training dtype (" + a.dtype() + ")", a.reduce_dtype);
  for (const std::string& r : a.report_to)
    require(r == "jsonl" || r == "tensorboard" || r == "csv" || r == "mlflow" || r == "none",
            "report_to",
            "names \"" + r + "\", which is not supported (Tessera writes its trackers' files "
            "itself and reaches no tracking service; supported: jsonl, tensorboard, csv, mlflow "
            "(a file store in output_dir/mlruns), all = every one, none)",
            a.report_to);
  require(!a.load_best_model_at_end || a.eval_strategy != "no", "load_best_model_at_end",
          "needs evaluations (eval_strategy steps or epoch)", a.load_best_model_at_end);
  require(std::isfinite(a.preempt_grace) && a.preempt_grace >= 0, "preempt_grace",
          "must be a number of seconds >= 0 (0 = no bound)", a.preempt_grace);
  for (const std::string& name : a.preempt_signals) {
    if (name == "none") continue;
    try {
      preemption_signal_number(name);
    } catch (const Error& e) {
      require(false, "preempt_signals", std::string("must list signal names: ") + e.what(),
              a.preempt_signals);
    }
  }
  require(a.sampling == "windows" || a.sampling == "random", "sampling",
          "must be windows or random", a.sampling);
  require(a.dropout >= 0 && a.dropout < 1, "dropout", "must be in [0, 1)", a.dropout);
  // The checkpointing policy, before any work: its name, and for a fresh model its blocks (a
  // model from `init` is checked against its own when the run enables it on it).
  const nn::CheckpointPolicy policy = gradient_checkpointing_policy(a);
  require(a.gradient_checkpointing || !a.gradient_checkpointing_kwargs.contains("policy"),
          "gradient_checkpointing_kwargs",
          "names a policy, but gradient_checkpointing is false (turn it on: "
          "--gradient-checkpointing POLICY)",
          a.gradient_checkpointing_kwargs);
  if (a.init.empty() && a.n_layer > 0) {
    try {
      policy.check_model(a.n_layer);
    } catch (const Error& e) {
      TESSERA_FAIL(a.describe("gradient_checkpointing_kwargs"), ": ", e.what());
    }
  }
  require(a.zero_stage >= -1 && a.zero_stage <= 3, "zero_stage", "must be 0 (DDP), 1, 2 or 3", a.zero_stage);
  require(a.offload == "none" || a.offload == "optimizer" || a.offload == "param", "offload",
          "must be none, optimizer or param", a.offload);
  require(a.offload == "none" || a.zero_stage >= 1, "offload",
          "needs a ZeRO stage (zero_stage 1, 2 or 3; param: 3)", a.offload);
  require(a.offload != "param" || a.zero_stage == 3, "offload", "param needs zero_stage 3", a.offload);
  require(a.hybrid_shard_size == -1 || a.hybrid_shard_size >= 1, "hybrid_shard_size",
          "must be at least 1 (ranks per shard group)", a.hybrid_shard_size);
  require(
      a.hybrid_shard_size < 1 || a.zero_stage == 2 || a.zero_stage == 3, "hybrid_shard_size",
      "needs zero_stage 2 or 3 (--fsdp hybrid_shard or _hybrid_shard_zero2), but zero_stage is " +
          std::to_string(a.zero_stage),
      a.hybrid_shard_size);
  require(a.hybrid_shard_size < 1 || a.offload == "none", "hybrid_shard_size",
          "does not support offload (offload is " + a.offload + ")", a.hybrid_shard_size);
  for (auto [key, value] : {std::pair{"tp_size", a.tp_size},
                            {"pp_size", a.pp_size},
                            {"pipeline_micro_batches", a.pipeline_micro_batches}})
    require(value >= 1 && value <= 65536, key, "must be from 1 to 65536", value);
  require(a.dp_size == -1 || (a.dp_size >= 1 && a.dp_size <= 65536), "dp_size",
          "must be -1 (the world over tp_size x pp_size) or from 1 to 65536", a.dp_size);
  require(a.pipeline_schedule == "1f1b" || a.pipeline_schedule == "afab", "pipeline_schedule",
          "must be 1f1b or afab", a.pipeline_schedule);
  require(a.zero_accumulation == "reduce_every_micro_batch" || a.zero_accumulation == "no_sync",
          "zero_accumulation", "must be reduce_every_micro_batch or no_sync", a.zero_accumulation);
  try {
    Device::parse(a.device);
  } catch (const Error&) {
    require(false, "device", "must be cpu, cuda or cuda:N", a.device);
  }
}

namespace {

// Sets `key` to the value a sharding source gives, unless the user set it otherwise.
void take_setting(TrainingArguments& a, const std::string& key, const Json& value, const std::string& from) {
  const Json current = fields().at(key).get(a);
  // bf16/fp16 are also set through "dtype".
  const std::string set_as = !a.given.count(key) && (key == "bf16" || key == "fp16") ? "dtype" : key;
  dist::refuse_contradiction(!a.given.count(set_as) || current == value, from, value.dump(),
                             a.describe(set_as), fields().at(set_as).get(a).dump());
  fields().at(key).set(a, value);
}

// Hugging Face's `fsdp` string: one sharding strategy and the options "offload", "auto_wrap".
void apply_fsdp_words(TrainingArguments& a) {
  std::istringstream words(a.fsdp);
  std::string word;
  int stage = -1;
  bool offload = false, hybrid = false;
  while (words >> word) {
    if (word == "offload") {
      offload = true;
    } else if (word == "auto_wrap") {
      // Tessera's stage 3 always shards per transformer block (its ModuleList children).
    } else {
      try {
        stage = dist::fsdp_sharding_stage(word);
        hybrid = dist::fsdp_sharding_is_hybrid(word);
      } catch (const Error& e) {
        TESSERA_FAIL(a.describe("fsdp"), ": ", e.what(), " (options: offload, auto_wrap)");
      }
    }
  }
  TESSERA_CHECK(stage >= 0 || a.fsdp.empty(), a.describe("fsdp"), " names no sharding strategy (got \"", a.fsdp,
                "\")");
  if (stage >= 0) take_setting(a, "zero_stage", stage, a.describe("fsdp") + " (" + a.fsdp + ")");
  // FSDP's hybrid strategies shard within a node unless told the group size.
  TESSERA_CHECK(hybrid || a.hybrid_shard_size == -1, a.describe("fsdp"), " (", a.fsdp,
                ") shards over every rank, but ", a.describe("hybrid_shard_size"), " is ",
                a.hybrid_shard_size, "; use hybrid_shard or _hybrid_shard_zero2");
  if (hybrid && a.hybrid_shard_size == -1)
    a.hybrid_shard_size = dist::read_dist_env().local_world_size;
  // FSDP's CPUOffload moves the parameters (and so their optimizer state) to the host.
  if (offload) take_setting(a, "offload", "param", a.describe("fsdp") + " (offload)");
}

}  // namespace

void apply_sharding_config(TrainingArguments& a) {
  // Accelerate refuses a DeepSpeed and an FSDP plugin together: each is a whole sharding plan.
  TESSERA_CHECK(a.fsdp.empty() || a.deepspeed.empty(), a.describe("deepspeed"), " (", a.deepspeed,
                ") and ", a.describe("fsdp"), " (", a.fsdp,
                ") are two sharding configs; give one of them");
  if (!a.fsdp.empty()) apply_fsdp_words(a);
  if (a.deepspeed.empty()) {
    a.deepspeed_config.reset();
    return;
  }
  if (!a.deepspeed_config || a.deepspeed_config->path != a.deepspeed)
    a.deepspeed_config = dist::DeepSpeedConfig::read(a.deepspeed);
  const dist::DeepSpeedConfig& ds = *a.deepspeed_config;
  const std::string in = ds.source + ": \"";
  if (ds.zero_stage) take_setting(a, "zero_stage", *ds.zero_stage, in + "zero_optimization.stage\"");
  if (ds.hybrid_shard_size)
    take_setting(a, "hybrid_shard_size", *ds.hybrid_shard_size,
                 in + "zero_optimization.mics_shard_size\"");
  if (ds.offload_param.value_or(false) || ds.offload_optimizer.value_or(false))
    take_setting(a, "offload", ds.offload_param.value_or(false) ? "param" : "optimizer",
                 in + "zero_optimization.offload_" + (ds.offload_param.value_or(false) ? "param" : "optimizer") +
                     ".device\"");
  if (ds.gradient_accumulation_steps)
    take_setting(a, "gradient_accumulation_steps", *ds.gradient_accumulation_steps,
                 in + "gradient_accumulation_steps\"");
  if (ds.gradient_clipping) take_setting(a, "max_grad_norm", *ds.gradient_clipping, in + "gradient_clipping\"");
  if (ds.mixed_precision) {
    take_setting(a, "bf16", *ds.mixed_precision == "bf16", in + "bf16.enabled\"");
    take_setting(a, "fp16", *ds.mixed_precision == "fp16", in + "fp16.enabled\"");
  }
  if (ds.train_micro_batch_size_per_gpu)
    take_setting(a, "per_device_train_batch_size", *ds.train_micro_batch_size_per_gpu,
                 in + "train_micro_batch_size_per_gpu\"");
  if (ds.communication_data_type)
    take_setting(a, "reduce_dtype", *ds.communication_data_type, in + "communication_data_type\"");
  const std::pair<const std::optional<double>*, const char*> optimizer_params[] = {
      {&ds.optimizer_lr, "learning_rate"},      {&ds.optimizer_beta1, "adam_beta1"},
      {&ds.optimizer_beta2, "adam_beta2"},      {&ds.optimizer_eps, "adam_epsilon"},
      {&ds.optimizer_weight_decay, "weight_decay"}};
  for (const auto& [value, key] : optimizer_params)
    if (*value) take_setting(a, key, **value, in + "optimizer.params\" (" + key + ")");
}

int64_t warmup_steps_for(const TrainingArguments& a, int64_t total) {
  return a.warmup_steps > 0 ? a.warmup_steps
                            : static_cast<int64_t>(std::ceil(a.warmup_ratio * static_cast<double>(total)));
}

bool schedule_uses_total(const TrainingArguments& a) {
  return a.lr_scheduler_type.empty() ? a.schedule != "constant"
                                     : optim::scheduler_uses_training_steps(a.lr_scheduler_type);
}

std::string schedule_name(const TrainingArguments& a) {
  return a.lr_scheduler_type.empty() ? "--schedule " + a.schedule
                                     : "lr_scheduler_type " + a.lr_scheduler_type;
}

std::unique_ptr<optim::LRSchedule> make_lr_schedule(const TrainingArguments& a, optim::Optimizer& optimizer,
                                                    int64_t total) {
  const int64_t warmup = warmup_steps_for(a, total);
  if (!a.lr_scheduler_type.empty())
    return optim::get_scheduler(a.lr_scheduler_type, optimizer, warmup, total, scheduler_kwargs(a));
  const optim::DecayShape shape = a.schedule == "constant" ? optim::DecayShape::Constant
                                  : a.schedule == "linear" ? optim::DecayShape::Linear
                                                           : optim::DecayShape::Cosine;
  return std::make_unique<optim::LRSchedule>(
      optimizer, shape,
      optim::ScheduleOptions{.warmup = warmup,
                             .total = total,
                             .min_lr = a.min_lr >= 0 ? a.min_lr : a.learning_rate / 10});
}

}  // namespace tessera::train
