// The progress line's smoothing: the bias-corrected moving average against values worked
// out by hand, and a line that names the smoothed tokens/s (samples/s for a classifier) and an ETA.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "tessera/train/progress.h"

using tessera::train::MovingAverage;
using tessera::train::Progress;

TEST(Progress, MovingAverageIsBiasCorrected) {
  MovingAverage avg(0.9);
  EXPECT_TRUE(std::isnan(avg.value()));
  avg.add(10);
  EXPECT_DOUBLE_EQ(avg.value(), 10);  // no pull toward zero at the start
  avg.add(20);
  EXPECT_DOUBLE_EQ(avg.value(), (0.9 * 0.1 * 10 + 0.1 * 20) / (0.9 * 0.1 + 0.1));
  // A steady 1000 then one step at 50,000 (the jump the issue saw) moves it by a tenth.
  MovingAverage steady(0.9);
  for (int i = 0; i < 200; ++i) steady.add(1000);
  steady.add(50000);
  EXPECT_NEAR(steady.value(), 1000 + 0.1 * 49000, 1e-6 * 5900);
}

TEST(Progress, LineShowsSmoothedTokensPerSecondAndEta) {
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    Progress progress(4, 0, out);
    progress.update(1, 2.5, 1000, 1e-3);
    progress.update(2, 2.4, 3000, 1e-3);  // smoothed: (0.09 * 1000 + 0.1 * 3000) / 0.19
    progress.finish();
  }
  std::rewind(out);
  std::string text(4096, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), out));
  std::fclose(out);
  EXPECT_NE(text.find("step 1/4 | loss 2.5000 | lr 1.000e-03 | 1000 tok/s | ETA "),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("step 2/4 | loss 2.4000 | lr 1.000e-03 | 2053 tok/s | ETA "),
            std::string::npos)
      << text;
}

// A classifier's rate is samples per second, and the line says so.
TEST(Progress, ClassifierLineCountsSamples) {
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    Progress progress(2, 0, out);
    progress.update(1, 0.7, 96, 5e-4, "samples");
    progress.finish();
  }
  std::rewind(out);
  std::string text(4096, '\0');
  text.resize(std::fread(text.data(), 1, text.size(), out));
  std::fclose(out);
  EXPECT_NE(text.find("step 1/2 | loss 0.7000 | lr 5.000e-04 | 96 samples/s | ETA "), std::string::npos) << text;
  EXPECT_EQ(text.find("tok/s"), std::string::npos) << text;
}
