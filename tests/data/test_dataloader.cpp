// DataLoader against the data-order contract of DESIGN.md, computed independently here:
// micro-batch k of rank r in world W reads tokens [(k·W + r)·B·T, … + B·T + 1) modulo n.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <set>

#include "tessera/core/error.h"
#include "tessera/data/dataloader.h"

using namespace tessera;
using namespace tessera::data;

namespace {

std::filesystem::path write_tokens(const std::string& name, const std::vector<uint32_t>& tokens) {
  auto dir = std::filesystem::temp_directory_path() / ("tessera_test_dataloader_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  write_token_file(dir / name, tokens);
  return dir / name;
}

std::vector<uint32_t> random_tokens(size_t n, uint32_t vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<uint32_t> t(n);
  for (auto& v : t) v = rng() % vocab;
  return t;
}

// The contract, element by element.
void expect_contract(const Batch& batch, const std::vector<uint32_t>& tokens, int64_t k, int64_t r,
                     int64_t W, int64_t B, int64_t T) {
  ASSERT_EQ(batch.x.shape(), (Shape{B, T}));
  ASSERT_EQ(batch.y.shape(), (Shape{B, T}));
  const auto x = batch.x.to_vector<int64_t>(), y = batch.y.to_vector<int64_t>();
  const int64_t n = static_cast<int64_t>(tokens.size());
  const int64_t start = (k * W + r) * B * T;
  for (int64_t i = 0; i < B * T; ++i) {
    ASSERT_EQ(x[i], tokens[(start + i) % n]) << "k=" << k << " r=" << r << " i=" << i;
    ASSERT_EQ(y[i], tokens[(start + i + 1) % n]) << "k=" << k << " r=" << r << " i=" << i;
  }
}

// Removes this process's temporary folder when the tests are done.
class TempCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::filesystem::remove_all(std::filesystem::temp_directory_path() /
                                ("tessera_test_dataloader_" + std::to_string(::getpid())));
  }
};
const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new TempCleanup);

}  // namespace

TEST(DataLoader, SequentialFollowsTheContractWithWrapping) {
  const auto tokens = random_tokens(1000, 50000, 1);
  const auto path = write_tokens("seq.bin", tokens);
  for (auto [B, T, W] : std::vector<std::tuple<int64_t, int64_t, int>>{{1, 1, 1}, {4, 7, 1}, {3, 33, 2}, {2, 257, 3}, {5, 7, 4}}) {
    for (int r = 0; r < W; ++r) {
      DataLoader loader(TokenFile(path), {.batch = B, .seq = T, .rank = r, .world_size = W});
      for (int64_t k = 0; k < 12; ++k) {  // enough steps to wrap for the larger shapes
        expect_contract(loader.next(), tokens, k, r, W, B, T);
      }
      EXPECT_EQ(loader.position(), 12u);
    }
  }
}

TEST(DataLoader, WorldOfRanksSeesWhatOneProcessWithMoreRowsSees) {
  const auto tokens = random_tokens(777, 300, 2);
  const auto path = write_tokens("ranks.bin", tokens);
  const int W = 3;
  const int64_t B = 2, T = 7;
  DataLoader single(TokenFile(path), {.batch = W * B, .seq = T});
  std::vector<DataLoader> ranks;
  for (int r = 0; r < W; ++r) ranks.emplace_back(TokenFile(path), DataLoaderOptions{.batch = B, .seq = T, .rank = r, .world_size = W});
  for (int k = 0; k < 20; ++k) {
    const auto all = single.next().x.to_vector<int64_t>();
    std::vector<int64_t> joined;
    for (auto& rank : ranks) {
      const auto part = rank.next().x.to_vector<int64_t>();
      joined.insert(joined.end(), part.begin(), part.end());
    }
    EXPECT_EQ(joined, all) << "micro-batch " << k;
  }
}

TEST(DataLoader, ShuffledVisitsEveryWindowOncePerEpochReproducibly) {
  const auto tokens = random_tokens(301, 1000, 3);
  const auto path = write_tokens("shuffle.bin", tokens);
  const int64_t B = 3, T = 10;  // 30 windows of 11 tokens, 10 micro-batches per epoch
  DataLoader a(TokenFile(path), {.batch = B, .seq = T, .shuffle = true, .seed = 7});
  DataLoader b(TokenFile(path), {.batch = B, .seq = T, .shuffle = true, .seed = 7});
  DataLoader other(TokenFile(path), {.batch = B, .seq = T, .shuffle = true, .seed = 8});
  std::vector<int64_t> epoch0, epoch1;
  bool differs_from_other_seed = false;
  for (int64_t k = 0; k < 20; ++k) {
    const auto starts = a.row_starts(k);
    (k < 10 ? epoch0 : epoch1).insert((k < 10 ? epoch0 : epoch1).end(), starts.begin(), starts.end());
    if (starts != other.row_starts(k)) differs_from_other_seed = true;
    const Batch batch = a.next(), again = b.next();
    EXPECT_EQ(batch.x.to_vector<int64_t>(), again.x.to_vector<int64_t>());
    // Each row is the window at its start: x = tokens[s, s+T), y = tokens[s+1, s+T+1).
    const auto x = batch.x.to_vector<int64_t>(), y = batch.y.to_vector<int64_t>();
    for (int64_t row = 0; row < B; ++row)
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(x[row * T + t], tokens[starts[row] + t]);
        ASSERT_EQ(y[row * T + t], tokens[starts[row] + t + 1]);
      }
  }
  EXPECT_TRUE(differs_from_other_seed);
  EXPECT_NE(epoch0, epoch1) << "each epoch should have its own order";
  for (auto* epoch : {&epoch0, &epoch1}) {
    std::set<int64_t> seen(epoch->begin(), epoch->end());
    ASSERT_EQ(seen.size(), 30u);
    for (int64_t s : seen) EXPECT_EQ(s % T, 0);
    EXPECT_EQ(*seen.rbegin(), 29 * T);
  }
  // Ranks split the same global row order in shuffled mode too.
  DataLoader r0(TokenFile(path), {.batch = 1, .seq = T, .rank = 0, .world_size = 3, .shuffle = true, .seed = 7});
  DataLoader r2(TokenFile(path), {.batch = 1, .seq = T, .rank = 2, .world_size = 3, .shuffle = true, .seed = 7});
  EXPECT_EQ(r0.row_starts(1)[0], a.row_starts(1)[0]);  // global row 3
  EXPECT_EQ(r2.row_starts(1)[0], a.row_starts(1)[2]);  // global row 5
}

TEST(DataLoader, PositionRestoresTheStream) {
  const auto tokens = random_tokens(500, 100, 4);
  const auto path = write_tokens("resume.bin", tokens);
  for (bool shuffle : {false, true}) {
    DataLoaderOptions opts{.batch = 2, .seq = 9, .shuffle = shuffle, .seed = 11};
    DataLoader straight(TokenFile(path), opts);
    for (int i = 0; i < 13; ++i) straight.next();
    DataLoader resumed(TokenFile(path), opts);
    resumed.set_position(13);
    for (int i = 0; i < 40; ++i)
      EXPECT_EQ(straight.next().y.to_vector<int64_t>(), resumed.next().y.to_vector<int64_t>());
  }
}

TEST(DataLoader, IteratesWithStructuredBindingsAndOptionalLimit) {
  const auto tokens = random_tokens(200, 100, 5);
  const auto path = write_tokens("iter.bin", tokens);
  DataLoader loader(TokenFile(path), {.batch = 2, .seq = 5, .dtype = DType::i32, .max_batches = 6});
  int64_t k = 0;
  for (auto& [x, y] : loader) {
    EXPECT_EQ(x.dtype(), DType::i32);
    const auto xv = x.to_vector<int32_t>(), yv = y.to_vector<int32_t>();
    for (int64_t i = 0; i < 10; ++i) {
      EXPECT_EQ(xv[i], static_cast<int32_t>(tokens[(k * 10 + i) % 200]));
      EXPECT_EQ(yv[i], static_cast<int32_t>(tokens[(k * 10 + i + 1) % 200]));
    }
    ++k;
  }
  EXPECT_EQ(k, 6);
  EXPECT_EQ(loader.position(), 6u);

  DataLoader endless(TokenFile(path), {.batch = 1, .seq = 3});
  int64_t taken = 0;
  for (auto& [x, y] : endless) {
    if (++taken == 500) break;  // wraps around the 200-token file several times
  }
  EXPECT_EQ(endless.position(), 500u);
}

TEST(DataLoader, RejectsBadOptions) {
  const auto path = write_tokens("small.bin", {1, 2, 3, 4, 5});
  EXPECT_THROW(DataLoader(TokenFile(path), {.batch = 0, .seq = 2}), Error);
  EXPECT_THROW(DataLoader(TokenFile(path), {.batch = 1, .seq = 2, .rank = 2, .world_size = 2}), Error);
  EXPECT_THROW(DataLoader(TokenFile(path), {.batch = 1, .seq = 5, .shuffle = true}), Error);
  const auto tiny = write_tokens("one.bin", {1});
  EXPECT_THROW(DataLoader(TokenFile(tiny), {.batch = 1, .seq = 1}), Error);
}
