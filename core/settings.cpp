#include "tessera/core/settings.h"

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <mutex>

#include "tessera/core/error.h"

namespace tessera {

std::optional<std::string> environment_variable(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

namespace {

using K = SettingKind;
constexpr double kForever = 1e9;  // seconds: the largest timeout a setting takes

// In the order of the Setting enum (checked below), bottom layer first.
constexpr std::array<SettingInfo, kSettingCount> kTable{{
    {Setting::Deterministic, "TESSERA_DETERMINISTIC", K::Switch, "0", "", 0, 0, false, "kernels",
     "1: CUDA kernels that could add with atomics add in a fixed order (also set_deterministic)"},
    {Setting::GraphCopyKernels, "TESSERA_GRAPH_COPY_KERNELS", K::Switch, "1", "", 0, 0, false,
     "core", "1: a captured CUDA graph's copy and memset nodes become kernel nodes; 0 keeps them"},
    {Setting::GemmAutotune, "TESSERA_GEMM_AUTOTUNE", K::Switch, "1", "", 0, 0, false, "kernels",
     "1: cuBLASLt GEMM plans are timed among their bit-identical candidates; 0: the first one"},
    {Setting::GemmAutotuneLog, "TESSERA_GEMM_AUTOTUNE_LOG", K::Switch, "0", "", 0, 0, false,
     "kernels", "1: print each GEMM plan the autotuner changes"},
    {Setting::GeluEpilogues, "TESSERA_GELU_EPILOGUES", K::Choice, "1", "1,forward,0", 0, 0, false,
     "kernels", "cuBLASLt GELU epilogues: 1 both ways, forward only, 0 none"},
    {Setting::AttentionSm90, "TESSERA_ATTENTION_SM90", K::Switch, "1", "", 0, 0, false, "kernels",
     "1: the flash attention forward takes the sm_90 (wgmma) kernels on Hopper; 0: mma.sync"},
    {Setting::AttentionSm90Backward, "TESSERA_ATTENTION_SM90_BWD", K::Switch, "1", "", 0, 0,
     false, "kernels",
     "1: the flash attention backward takes the sm_90 (wgmma) kernels on Hopper; 0: mma.sync"},
    {Setting::Attention, "TESSERA_ATTENTION", K::Choice, "flash", "flash,cudnn", 0, 0, true,
     "kernels",
     "the fused attention backend on CUDA, causal or masked (also set_attention_backend)"},
    {Setting::DeferredBiases, "TESSERA_DEFERRED_BIASES", K::Switch, "1", "", 0, 0, false, "nn",
     "1: GPT adds each block's output biases inside the next LayerNorm; 0: in the Linear"},
    {Setting::FusedQkvProjection, "TESSERA_FUSED_QKV_PROJECTION", K::Switch, "1", "", 0, 0, false,
     "nn", "1: attention's QKV projection and head split are one fused op; 0: Linear then split"},
    {Setting::FusedMlp, "TESSERA_FUSED_MLP", K::Switch, "1", "", 0, 0, false, "nn",
     "1: the GPT MLP (Linear, GELU, Linear) is one fused op; 0: three modules"},
    {Setting::CollectiveTimeout, "TESSERA_COLLECTIVE_TIMEOUT", K::Number, "1800", "", 0, kForever,
     false, "dist", "seconds one collective may take before it is an error"},
    {Setting::DebugCollectives, "TESSERA_DEBUG_COLLECTIVES", K::Flag, "0", "", 0, 0, false, "dist",
     "1: every collective first checks that all ranks call the same one (TORCH_DISTRIBUTED_DEBUG)"},
    {Setting::RendezvousTimeout, "TESSERA_RENDEZVOUS_TIMEOUT", K::Number, "600", "", 0, kForever,
     false, "dist", "seconds init_process_group waits for every rank to join (must be positive)"},
    {Setting::WatchdogTimeout, "TESSERA_WATCHDOG_TIMEOUT", K::Number, "60", "", 0, kForever, false,
     "dist", "seconds in one collective before the watchdog reports a hang; 0: off"},
    {Setting::WatchdogAction, "TESSERA_WATCHDOG_ACTION", K::Choice, "end", "end,report", 0, 0,
     false, "dist", "what the watchdog does about a hang: end the job, or report and keep waiting"},
    {Setting::NcclCtaPolicy, "TESSERA_NCCL_CTA_POLICY", K::Choice, "", "default,efficiency,zero", 0,
     0, false, "dist", "the NCCL communicators' CTA policy (NCCL 2.27+); unset: NCCL's own choice"},
    {Setting::NcclSymmetric, "TESSERA_NCCL_SYMMETRIC", K::Switch, "0", "", 0, 0, false, "dist",
     "1: DDP's gradient buckets are NCCL symmetric windows (NCCL 2.27+)"},
    {Setting::PeerAllReduce, "TESSERA_PEER_ALLREDUCE", K::Switch, "1", "", 0, 0, false, "dist",
     "1: two ranks on one host all-reduce DDP buckets through the copy engines; 0: NCCL"},
    {Setting::MixedPrecision, "TESSERA_MIXED_PRECISION", K::Choice, "no", "no,fp16,bf16", 0, 0,
     false, "dist", "the Accelerator's mixed precision (tessera launch --mixed_precision)"},
    {Setting::ReduceDtype, "TESSERA_REDUCE_DTYPE", K::Choice, "", "fp32,fp16,bf16", 0, 0, false,
     "dist", "the dtype gradients are averaged in; unset: the mixed-precision policy's own"},
    {Setting::ZeroStage, "TESSERA_ZERO_STAGE", K::Integer, "0", "", 0, 3, false, "dist",
     "the Accelerator's ZeRO stage: 0 DDP, 1, 2 or 3 (tessera launch --zero_stage)"},
    {Setting::DeepSpeedConfig, "TESSERA_DEEPSPEED_CONFIG", K::Text, "", "a DeepSpeed JSON file", 0,
     0, false, "dist", "the Accelerator's DeepSpeed config (tessera launch --deepspeed_config_file)"},
    {Setting::FsdpShardingStrategy, "TESSERA_FSDP_SHARDING_STRATEGY", K::Choice, "",
     "FULL_SHARD,SHARD_GRAD_OP,HYBRID_SHARD,_HYBRID_SHARD_ZERO2,NO_SHARD", 0, 0, true, "dist",
     "the Accelerator's FSDP sharding strategy (tessera launch --fsdp_sharding_strategy)"},
    {Setting::GradientAccumulationSteps, "TESSERA_GRADIENT_ACCUMULATION_STEPS", K::Integer, "1", "",
     1, 1000000, false, "dist", "the Accelerator's gradient accumulation steps"},
    {Setting::TpSize, "TESSERA_TP_SIZE", K::Integer, "1", "", 1, 65536, false, "dist",
     "the Accelerator's device mesh: ranks per tensor-parallel group (tessera launch --tp-size)"},
    {Setting::PpSize, "TESSERA_PP_SIZE", K::Integer, "1", "", 1, 65536, false, "dist",
     "the Accelerator's device mesh: pipeline stages (tessera launch --pp-size)"},
    {Setting::UseCpu, "TESSERA_USE_CPU", K::Flag, "0", "", 0, 0, false, "dist",
     "1: the Accelerator stays on the CPU even where a GPU is visible (tessera launch --cpu)"},
    {Setting::SparseEmbeddingGradients, "TESSERA_SPARSE_EMBEDDING_GRADIENTS", K::Switch, "1", "", 0,
     0, false, "dist", "1: DDP syncs embedding gradients sparsely where that moves fewer bytes; 0: densely"},
    {Setting::ZeroTrace, "TESSERA_ZERO_TRACE", K::Text, "", "a file to write", 0, 0, false, "dist",
     "writes a Chrome trace of ZeRO's communication to this file; unset: no trace"},
    {Setting::ZeroTraceSteps, "TESSERA_ZERO_TRACE_STEPS", K::Integer, "3", "", 1, 1000000, false,
     "dist", "how many steps TESSERA_ZERO_TRACE records"},
    {Setting::OffloadThreads, "TESSERA_OFFLOAD_THREADS", K::Integer, "0", "", 0, 4096, false,
     "dist",
     "threads of each rank's ZeRO-Offload host AdamW; 0: one per core of the rank's share"},
    {Setting::CudaGraphs, "TESSERA_CUDA_GRAPHS", K::Switch, "1", "", 0, 0, false, "train",
     "1: the Trainer captures a CUDA step into a CUDA graph where it can; 0: never"},
    {Setting::Gpt2Dir, "TESSERA_GPT2_DIR", K::Text, "", "a folder", 0, 0, false, "cli",
     "the folder of GPT-2's encoder.json and vocab.bpe for tessera prepare; unset: .deps/gpt2"},
}};

constexpr bool table_in_enum_order() {
  for (size_t i = 0; i < kTable.size(); ++i)
    if (static_cast<size_t>(kTable[i].id) != i) return false;
  return true;
}
static_assert(table_in_enum_order(), "kTable must list the settings in Setting's order");

std::vector<std::string> split_values(const char* values) {
  std::vector<std::string> out;
  std::string current;
  for (const char* c = values; *c; ++c) {
    if (*c == ',') {
      out.push_back(current);
      current.clear();
    } else {
      current += *c;
    }
  }
  if (!current.empty()) out.push_back(current);
  return out;
}

// Any case, and '-' for '_' (full-shard for FULL_SHARD, Flash for flash).
std::string folded(std::string text) {
  for (char& c : text) c = c == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

// "TESSERA_X='text' <why> <what it accepts>": the variable, its value and its accepted values.
[[noreturn]] void refuse(const SettingInfo& info, const std::string& text, const char* why) {
  TESSERA_FAIL(info.name, "='", text, "' ", why, " ", accepted_values(info),
               " (docs/settings.md)");
}

void check_range(const SettingInfo& info, const std::string& text, bool in_range) {
  TESSERA_CHECK(in_range, info.name, "=", text, " is out of range: it must be ",
                accepted_values(info), " (docs/settings.md)");
}

// `text` checked against `info`; a Choice or Flag comes back in its canonical spelling.
std::string validated(const SettingInfo& info, const std::string& text) {
  switch (info.kind) {
    case K::Switch:
      if (text != "0" && text != "1") refuse(info, text, "must be");
      return text;
    case K::Flag: {
      const std::string f = folded(text);
      if (f == "1" || f == "true" || f == "yes" || f == "on") return "1";
      if (f == "0" || f == "false" || f == "no" || f == "off") return "0";
      refuse(info, text, "must be");
    }
    case K::Choice:
      for (const std::string& choice : split_values(info.values))
        if (text == choice || (info.loose && folded(text) == folded(choice))) return choice;
      refuse(info, text, "is not one of");
    case K::Integer: {
      char* end = nullptr;
      errno = 0;
      const long long value = std::strtoll(text.c_str(), &end, 10);
      if (end == text.c_str() || *end != '\0') refuse(info, text, "is not");
      check_range(info, text, errno != ERANGE && value >= info.min && value <= info.max);
      return text;
    }
    case K::Number: {
      char* end = nullptr;
      const double value = std::strtod(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0') refuse(info, text, "is not");
      check_range(info, text, value >= info.min && value <= info.max);
      return text;
    }
    case K::Text:
      return text;
  }
  return text;
}

struct Options {
  std::mutex mutex;
  std::array<std::optional<std::string>, kSettingCount> values;
};
Options& options() {
  static Options* o = new Options();  // never destroyed: read by threads that outlive main
  return *o;
}

std::optional<std::string> option_of(Setting setting) {
  Options& o = options();
  std::lock_guard lock(o.mutex);
  return o.values[static_cast<size_t>(setting)];
}

// A bound as a reader writes it: 1000000000, not 1e+09.
std::string number_text(double value) {
  if (value == static_cast<double>(static_cast<long long>(value)))
    return std::to_string(static_cast<long long>(value));
  return detail::concat(value);
}

}  // namespace

const char* setting_source_name(SettingSource source) {
  switch (source) {
    case SettingSource::Default: return "default";
    case SettingSource::Environment: return "environment";
    case SettingSource::Option: return "option";
  }
  return "?";
}

std::span<const SettingInfo> setting_table() { return kTable; }

const SettingInfo& setting_info(Setting setting) {
  TESSERA_CHECK(setting < Setting::Count, "setting_info: no setting #", static_cast<int>(setting));
  return kTable[static_cast<size_t>(setting)];
}

const SettingInfo* find_setting(std::string_view name) {
  for (const SettingInfo& info : kTable)
    if (name == info.name) return &info;
  return nullptr;
}

std::string accepted_values(const SettingInfo& info) {
  switch (info.kind) {
    case K::Switch: return "0 or 1";
    case K::Flag: return "1, true, yes, on or 0, false, no, off";
    case K::Choice: {
      std::string out;
      const std::vector<std::string> choices = split_values(info.values);
      for (size_t i = 0; i < choices.size(); ++i) out += (i ? ", " : "") + choices[i];
      return out + (info.loose ? " (any case)" : "");
    }
    case K::Integer:
    case K::Number:
      return detail::concat(info.kind == K::Integer ? "an integer" : "a number", " in [",
                            number_text(info.min), ", ", number_text(info.max), "]");
    case K::Text: return info.values;
  }
  return "";
}

SettingValue setting_value(Setting setting) {
  if (std::optional<std::string> option = option_of(setting))
    return {*option, SettingSource::Option};
  return setting_value_from_environment(setting);
}

SettingValue setting_value_from_environment(Setting setting) {
  const SettingInfo& info = setting_info(setting);
  const std::optional<std::string> env = environment_variable(info.name);
  if (env && !env->empty()) return {validated(info, *env), SettingSource::Environment};
  return {info.default_value, SettingSource::Default};
}

std::string setting_text(Setting setting) { return setting_value(setting).text; }

bool setting_enabled(Setting setting) {
  const SettingInfo& info = setting_info(setting);
  TESSERA_CHECK(info.kind == K::Switch || info.kind == K::Flag, "setting_enabled: ", info.name,
                " is not a 0/1 switch");
  return setting_text(setting) == "1";
}

long long setting_integer(Setting setting) {
  TESSERA_CHECK(setting_info(setting).kind == K::Integer, "setting_integer: ",
                setting_info(setting).name, " is not an integer setting");
  return std::strtoll(setting_text(setting).c_str(), nullptr, 10);
}

double setting_number(Setting setting) {
  TESSERA_CHECK(setting_info(setting).kind == K::Number, "setting_number: ",
                setting_info(setting).name, " is not a number setting");
  return std::strtod(setting_text(setting).c_str(), nullptr);
}

void set_setting_option(Setting setting, const std::string& value) {
  const std::string checked = validated(setting_info(setting), value);
  Options& o = options();
  std::lock_guard lock(o.mutex);
  o.values[static_cast<size_t>(setting)] = checked;
}

void clear_setting_option(Setting setting) {
  Options& o = options();
  std::lock_guard lock(o.mutex);
  o.values[static_cast<size_t>(setting)].reset();
}

std::vector<SettingReport> current_settings() {
  std::vector<SettingReport> out;
  for (const SettingInfo& info : kTable) {
    SettingReport report{&info, {}, {}};
    try {
      report.value = setting_value(info.id);
    } catch (const Error& e) {
      report.value = {environment_variable(info.name).value_or(""), SettingSource::Environment};
      report.error = e.what();
    }
    out.push_back(std::move(report));
  }
  return out;
}

}  // namespace tessera
