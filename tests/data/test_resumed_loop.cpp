// A library training loop (the template of examples/train_template.cpp: `for (auto& [x, y] : loader)` over a
// loader prepared by the Accelerator) stopped after a save_state and resumed after a
// load_state takes the batches not yet done, and only those, in every sampling mode.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>

#include "tessera/data/dataloader.h"
#include "tessera/dist/accelerator.h"

using namespace tessera;
using namespace tessera::data;

namespace {

std::filesystem::path scratch() {
  return std::filesystem::temp_directory_path() / ("tessera_test_resumed_loop_" + std::to_string(::getpid()));
}

std::filesystem::path random_token_file(size_t n) {
  std::filesystem::create_directories(scratch());
  std::mt19937 rng(17);
  std::vector<uint32_t> tokens(n);
  for (auto& t : tokens) t = rng() % 500;
  const auto path = scratch() / "tokens.bin";
  write_token_file(path, tokens);
  return path;
}

}  // namespace

TEST(ResumedLibraryLoop, TakesOnlyTheBatchesNotYetDone) {
  const auto path = random_token_file(900);
  for (auto [sampling, shuffle] : std::vector<std::pair<Sampling, bool>>{
           {Sampling::windows, false}, {Sampling::windows, true}, {Sampling::random, false}}) {
    const DataLoaderOptions opts{.batch = 2, .seq = 8, .sampling = sampling, .shuffle = shuffle, .seed = 9,
                                 .max_batches = 10};
    const std::string what = std::string(sampling_name(sampling)) + (shuffle ? " (shuffled)" : "");
    std::vector<std::vector<int64_t>> uninterrupted;
    {
      DataLoader loader(TokenFile(path), opts);
      for (auto& [x, y] : loader) uninterrupted.push_back(y.to_vector<int64_t>());
    }
    ASSERT_EQ(uninterrupted.size(), 10u) << what;

    const std::string state_dir = (scratch() / "state").string();
    {
      dist::Accelerator acc({.cpu = true});
      DataLoader loader(TokenFile(path), opts);
      acc.prepare(loader);
      int64_t done = 0;
      for (auto& [x, y] : loader) {
        ASSERT_EQ(y.to_vector<int64_t>(), uninterrupted[done]) << what;
        if (++done == 4) {
          acc.save_state(state_dir);
          break;  // the job stops here
        }
      }
      acc.end_training();
    }
    dist::Accelerator acc({.cpu = true});
    DataLoader loader(TokenFile(path), opts);
    acc.prepare(loader);
    acc.load_state(state_dir);
    std::vector<std::vector<int64_t>> resumed;
    for (auto& [x, y] : loader) resumed.push_back(y.to_vector<int64_t>());
    acc.end_training();
    ASSERT_EQ(resumed.size(), 6u) << what << ": the resumed loop must not replay or overrun";
    for (size_t i = 0; i < resumed.size(); ++i) EXPECT_EQ(resumed[i], uninterrupted[4 + i]) << what << ", batch " << 4 + i;
  }
  std::filesystem::remove_all(scratch());
}
