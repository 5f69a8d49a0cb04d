// The settings table (core/settings.h): every entry is well formed, values resolve option >
// environment > default with their source, and a refused value names the variable, the value
// and what the setting accepts.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <optional>
#include <random>
#include <set>
#include <string>

#include "tessera/core/error.h"
#include "tessera/core/settings.h"

namespace tessera {
namespace {

// Sets (or unsets) one variable for a test's lifetime and restores what was there.
class ScopedVariable {
 public:
  ScopedVariable(const char* name, std::optional<std::string> value)
      : name_(name), saved_(environment_variable(name)) {
    set(value);
  }
  ~ScopedVariable() { set(saved_); }
  void set(const std::optional<std::string>& value) {
    if (value)
      ::setenv(name_, value->c_str(), 1);
    else
      ::unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

std::string error_of(Setting setting) {
  try {
    setting_value(setting);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Settings, TableIsWellFormed) {
  std::set<std::string> names;
  for (const SettingInfo& info : setting_table()) {
    const std::string name = info.name;
    EXPECT_EQ(name.rfind("TESSERA_", 0), 0u) << name;
    EXPECT_TRUE(names.insert(name).second) << name << " is listed twice";
    EXPECT_EQ(find_setting(name), &info) << name;
    EXPECT_EQ(&setting_info(info.id), &info) << name;
    EXPECT_STRNE(info.description, "") << name;
    EXPECT_STRNE(info.layer, "") << name;
    EXPECT_FALSE(accepted_values(info).empty()) << name;
    // The default is a value the setting accepts (or unset).
    if (*info.default_value) {
      ScopedVariable option_free(info.name, std::nullopt);
      EXPECT_NO_THROW(set_setting_option(info.id, info.default_value)) << name;
      clear_setting_option(info.id);
    }
  }
  EXPECT_EQ(names.size(), kSettingCount);
  EXPECT_EQ(find_setting("TESSERA_NO_SUCH_SETTING"), nullptr);
}

TEST(Settings, SourceIsDefaultEnvironmentOrOption) {
  ScopedVariable v("TESSERA_WATCHDOG_TIMEOUT", std::nullopt);
  SettingValue value = setting_value(Setting::WatchdogTimeout);
  EXPECT_EQ(value.text, "60");
  EXPECT_EQ(value.source, SettingSource::Default);
  EXPECT_EQ(setting_number(Setting::WatchdogTimeout), 60);
  v.set("");  // an empty variable counts as unset
  EXPECT_EQ(setting_value(Setting::WatchdogTimeout).source, SettingSource::Default);
  v.set("12.5");
  value = setting_value(Setting::WatchdogTimeout);
  EXPECT_EQ(value.source, SettingSource::Environment);
  EXPECT_EQ(setting_number(Setting::WatchdogTimeout), 12.5);
  set_setting_option(Setting::WatchdogTimeout, "3");  // an option wins over the environment
  value = setting_value(Setting::WatchdogTimeout);
  EXPECT_EQ(value.text, "3");
  EXPECT_EQ(value.source, SettingSource::Option);
  EXPECT_EQ(setting_value_from_environment(Setting::WatchdogTimeout).text, "12.5");
  clear_setting_option(Setting::WatchdogTimeout);
  EXPECT_EQ(setting_value(Setting::WatchdogTimeout).source, SettingSource::Environment);
  EXPECT_STREQ(setting_source_name(SettingSource::Option), "option");
}

TEST(Settings, SwitchAcceptsOnlyZeroOrOne) {
  ScopedVariable v("TESSERA_FUSED_MLP", std::nullopt);
  EXPECT_TRUE(setting_enabled(Setting::FusedMlp));  // default 1
  v.set("0");
  EXPECT_FALSE(setting_enabled(Setting::FusedMlp));
  v.set("1");
  EXPECT_TRUE(setting_enabled(Setting::FusedMlp));
  for (const char* bad : {"yes", "2", " 1", "01", "true"}) {
    v.set(bad);
    const std::string message = error_of(Setting::FusedMlp);
    EXPECT_NE(message.find(std::string("TESSERA_FUSED_MLP='") + bad + "' must be 0 or 1"),
              std::string::npos)
        << message;
  }
}

TEST(Settings, FlagAcceptsTheUsualSpellingsInAnyCase) {
  ScopedVariable v("TESSERA_USE_CPU", std::nullopt);
  EXPECT_FALSE(setting_enabled(Setting::UseCpu));
  for (const char* on : {"1", "true", "TRUE", "Yes", "on"}) {
    v.set(on);
    EXPECT_TRUE(setting_enabled(Setting::UseCpu)) << on;
  }
  for (const char* off : {"0", "false", "No", "OFF"}) {
    v.set(off);
    EXPECT_FALSE(setting_enabled(Setting::UseCpu)) << off;
  }
  v.set("maybe");
  EXPECT_NE(error_of(Setting::UseCpu).find("TESSERA_USE_CPU='maybe' must be 1, true"),
            std::string::npos);
}

TEST(Settings, ChoiceIsCanonicalAndLooseOnlyWhereTheTableSaysSo) {
  ScopedVariable attention("TESSERA_ATTENTION", "CuDNN");
  EXPECT_EQ(setting_text(Setting::Attention), "cudnn");
  ScopedVariable fsdp("TESSERA_FSDP_SHARDING_STRATEGY", "shard-grad-op");
  EXPECT_EQ(setting_text(Setting::FsdpShardingStrategy), "SHARD_GRAD_OP");
  ScopedVariable cta("TESSERA_NCCL_CTA_POLICY", "Efficiency");  // strict: lower case only
  const std::string message = error_of(Setting::NcclCtaPolicy);
  EXPECT_NE(message.find("TESSERA_NCCL_CTA_POLICY='Efficiency' is not one of default, "
                         "efficiency, zero"),
            std::string::npos)
      << message;
  cta.set(std::nullopt);
  EXPECT_EQ(setting_value(Setting::NcclCtaPolicy).text, "");  // unset by default
}

TEST(Settings, IntegerIsRangeCheckedAndNeverWraps) {
  ScopedVariable v("TESSERA_GRADIENT_ACCUMULATION_STEPS", std::nullopt);
  std::mt19937 rng(37);
  for (int i = 0; i < 20; ++i) {
    const long long steps = std::uniform_int_distribution<long long>(1, 1000000)(rng);
    v.set(std::to_string(steps));
    EXPECT_EQ(setting_integer(Setting::GradientAccumulationSteps), steps);
  }
  v.set("0");
  EXPECT_NE(error_of(Setting::GradientAccumulationSteps)
                .find("TESSERA_GRADIENT_ACCUMULATION_STEPS=0 is out of range: it must be an "
                      "integer in [1, 1000000]"),
            std::string::npos);
  v.set("99999999999999999999");  // beyond long long: out of range, not wrapped
  EXPECT_NE(error_of(Setting::GradientAccumulationSteps).find("is out of range"),
            std::string::npos);
  v.set("4x");
  EXPECT_NE(error_of(Setting::GradientAccumulationSteps)
                .find("TESSERA_GRADIENT_ACCUMULATION_STEPS='4x' is not an integer in"),
            std::string::npos);
}

TEST(Settings, NumberIsRangeChecked) {
  ScopedVariable v("TESSERA_COLLECTIVE_TIMEOUT", "1e3");
  EXPECT_EQ(setting_number(Setting::CollectiveTimeout), 1000);
  v.set("-1");
  EXPECT_NE(error_of(Setting::CollectiveTimeout)
                .find("TESSERA_COLLECTIVE_TIMEOUT=-1 is out of range: it must be a number in [0, "
                      "1000000000]"),
            std::string::npos);
  v.set("ten");
  EXPECT_NE(error_of(Setting::CollectiveTimeout).find("TESSERA_COLLECTIVE_TIMEOUT='ten' is not"),
            std::string::npos);
}

TEST(Settings, RefusedOptionKeepsThePreviousValue) {
  ScopedVariable v("TESSERA_ZERO_STAGE", std::nullopt);
  set_setting_option(Setting::ZeroStage, "2");
  try {
    set_setting_option(Setting::ZeroStage, "5");
    ADD_FAILURE() << "TESSERA_ZERO_STAGE=5 was accepted as an option";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("TESSERA_ZERO_STAGE=5 is out of range"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(setting_integer(Setting::ZeroStage), 2);
  clear_setting_option(Setting::ZeroStage);
  EXPECT_EQ(setting_integer(Setting::ZeroStage), 0);
}

TEST(Settings, ReportListsEverySettingAndNeverThrows) {
  ScopedVariable bad("TESSERA_GELU_EPILOGUES", "backward");
  ScopedVariable good("TESSERA_DEFERRED_BIASES", "0");
  std::vector<SettingReport> report;
  ASSERT_NO_THROW(report = current_settings());
  ASSERT_EQ(report.size(), kSettingCount);
  for (const SettingReport& r : report) {
    if (r.info->id == Setting::GeluEpilogues) {
      EXPECT_EQ(r.value.text, "backward");
      EXPECT_NE(r.error.find("TESSERA_GELU_EPILOGUES='backward' is not one of 1, forward, 0"),
                std::string::npos)
          << r.error;
    } else if (r.info->id == Setting::DeferredBiases) {
      EXPECT_EQ(r.value.text, "0");
      EXPECT_EQ(r.value.source, SettingSource::Environment);
      EXPECT_TRUE(r.error.empty());
    }
  }
}

TEST(Settings, EnvironmentVariableTellsUnsetFromEmpty) {
  ScopedVariable v("TESSERA_SETTINGS_TEST_VARIABLE", std::nullopt);
  EXPECT_EQ(environment_variable("TESSERA_SETTINGS_TEST_VARIABLE"), std::nullopt);
  v.set("");
  EXPECT_EQ(environment_variable("TESSERA_SETTINGS_TEST_VARIABLE"), std::string());
  v.set("a b");
  EXPECT_EQ(environment_variable("TESSERA_SETTINGS_TEST_VARIABLE"), std::string("a b"));
}

}  // namespace
}  // namespace tessera
