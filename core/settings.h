// Every TESSERA_* tuning switch of the library, in one table (docs/settings.md lists it and
// `tessera env` prints it). Each setting has a default, the values it accepts, a one-line
// description and, once read, where its value came from: the default, the environment or an
// option (an API call or a command-line flag that sets it for this process).
//
// Values are resolved when they are read, not cached here: a program or test that changes its
// own environment sees the change, and a reader that must not change mid-run (a kernel's
// atomics, a static) keeps its own copy, as before. A value the setting does not accept is an
// error naming the variable, the value and what it accepts, raised where it is read and by
// `tessera env`.
//
// This file's environment_variable() is the library's one call of getenv: dist/env.h's
// readers of the launch environment (RANK, MASTER_ADDR, ...) go through it too.
#pragma once
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessera {

// The value of environment variable `name`, or nullopt when it is unset. The only getenv of
// the library (tools, benchmarks and tests may read their own variables).
std::optional<std::string> environment_variable(const char* name);

enum class Setting : uint8_t {
  // core / kernels (the CUDA backend)
  Deterministic,
  GraphCopyKernels,
  GemmAutotune,
  GemmAutotuneLog,
  GeluEpilogues,
  AttentionSm90,
  AttentionSm90Backward,
  Attention,  // the fused-op table's attention backend (kernels/fused_table.h)
  // nn
  DeferredBiases,
  FusedQkvProjection,
  FusedMlp,
  // dist
  CollectiveTimeout,
  DebugCollectives,
  RendezvousTimeout,
  WatchdogTimeout,
  WatchdogAction,
  NcclCtaPolicy,
  NcclSymmetric,
  PeerAllReduce,
  MixedPrecision,
  ReduceDtype,
  ZeroStage,
  DeepSpeedConfig,
  FsdpShardingStrategy,
  GradientAccumulationSteps,
  TpSize,
  PpSize,
  UseCpu,
  SparseEmbeddingGradients,
  ZeroTrace,
  ZeroTraceSteps,
  OffloadThreads,
  // train, cli
  CudaGraphs,
  Gpt2Dir,
  Count
};
inline constexpr size_t kSettingCount = static_cast<size_t>(Setting::Count);

enum class SettingKind : uint8_t {
  Switch,   // 0 | 1
  Flag,     // 1, true, yes, on | 0, false, no, off (any case)
  Choice,   // one of `values` (comma-separated)
  Integer,  // an integer in [min, max]
  Number,   // a number in [min, max]
  Text,     // free text (a path); `values` says what it names
};

enum class SettingSource : uint8_t { Default, Environment, Option };
const char* setting_source_name(SettingSource source);

struct SettingInfo {
  Setting id;
  const char* name;           // the environment variable
  SettingKind kind;
  const char* default_value;  // "" = unset (the description says what unset means)
  const char* values;         // Choice: "a,b,c"; Text: what the text names
  double min = 0, max = 0;    // Integer, Number
  bool loose = false;         // Choice: any case, '-' for '_' (FULL-SHARD, Flash)
  const char* layer = "";     // the layer that reads it
  const char* description = "";
};

std::span<const SettingInfo> setting_table();
const SettingInfo& setting_info(Setting setting);
const SettingInfo* find_setting(std::string_view name);  // null for a name not in the table
// What `info` accepts, in words: "0 | 1", "flash | cudnn", "an integer in [1, 1000000]".
std::string accepted_values(const SettingInfo& info);

struct SettingValue {
  std::string text;  // validated; a Choice in its canonical spelling; "" = unset
  SettingSource source = SettingSource::Default;
};

// Option, else environment (an empty variable counts as unset), else default. A value the
// setting does not accept is an error naming the variable and its accepted values.
SettingValue setting_value(Setting setting);
// The same without the option: what the environment (or the default) says.
SettingValue setting_value_from_environment(Setting setting);
std::string setting_text(Setting setting);
bool setting_enabled(Setting setting);  // Switch and Flag
long long setting_integer(Setting setting);
double setting_number(Setting setting);

// Sets `setting` for this process (source: option), validated as an environment value is.
// An API call (set_attention_backend) or a command-line flag uses it.
void set_setting_option(Setting setting, const std::string& value);
void clear_setting_option(Setting setting);

// Every setting with its value and source, or the error its value raises: what `tessera env`
// prints. Reading it never throws.
struct SettingReport {
  const SettingInfo* info;
  SettingValue value;
  std::string error;  // non-empty: the value is refused and this says why
};
std::vector<SettingReport> current_settings();

}  // namespace tessera
