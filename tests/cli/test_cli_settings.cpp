// `tessera env` and docs/settings.md against the settings table of core/settings.h: every
// setting printed with its value and source, a refused value named, and the page holding the
// table row for row.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "tessera/core/settings.h"
#include "tests/cli/cli_harness.h"

using namespace tessera_cli_test;

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

TEST(CliSettings, EnvPrintsEverySettingWithItsValueAndSource) {
  const RunResult r = run("env", "env -u TESSERA_WATCHDOG_ACTION TESSERA_ATTENTION=CuDNN "
                                 "TESSERA_FUSED_MLP=0 TESSERA_NCCL_CTA_POLICY=");
  ASSERT_EQ(r.rc, 0) << r.output;
  for (const tessera::SettingInfo& info : tessera::setting_table())
    EXPECT_NE(r.output.find(std::string("\t") + info.name + "="), std::string::npos) << info.name;
  for (const char* line : {"\tTESSERA_ATTENTION=cudnn (environment)\n",
                           "\tTESSERA_FUSED_MLP=0 (environment)\n",
                           "\tTESSERA_WATCHDOG_ACTION=end (default)\n",
                           "\tTESSERA_NCCL_CTA_POLICY=(unset) (default)\n"})
    EXPECT_NE(r.output.find(line), std::string::npos) << line << r.output;
}

TEST(CliSettings, EnvRefusesABadValueNamingTheVariableAndItsValues) {
  const RunResult r = run("env", "TESSERA_GELU_EPILOGUES=backward TESSERA_ZERO_STAGE=4");
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("TESSERA_GELU_EPILOGUES='backward' is not one of 1, forward, 0"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("TESSERA_ZERO_STAGE=4 is out of range: it must be an integer in [0, 3]"),
            std::string::npos)
      << r.output;
}

TEST(CliSettings, DocsSettingsPageHoldsEveryRowOfTheTable) {
  std::ifstream page(std::string(TESSERA_SOURCE_DIR) + "/docs/settings.md");
  ASSERT_TRUE(page.good());
  const std::string doc{std::istreambuf_iterator<char>(page), std::istreambuf_iterator<char>()};
  const RunResult table = run("env --markdown");
  ASSERT_EQ(table.rc, 0) << table.output;
  const std::vector<std::string> rows = lines_of(table.output);
  ASSERT_EQ(rows.size(), tessera::kSettingCount + 2);  // the heading, the rule, one row each
  for (const std::string& row : rows)
    EXPECT_NE(doc.find("\n" + row + "\n"), std::string::npos)
        << "docs/settings.md lacks (or differs in) the row\n" << row;
  for (const tessera::SettingInfo& info : tessera::setting_table())
    EXPECT_NE(doc.find(std::string("| `") + info.name + "` |"), std::string::npos) << info.name;
}

}  // namespace
