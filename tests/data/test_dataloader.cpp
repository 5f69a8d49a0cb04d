// DataLoader against the data-order contract of docs/architecture.md, computed independently here:
// micro-batch k of rank r in world W reads tokens [(k·W + r)·B·T, … + B·T + 1) modulo n.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
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
  for (auto [sampling, shuffle] : std::vector<std::pair<Sampling, bool>>{
           {Sampling::windows, false}, {Sampling::windows, true}, {Sampling::random, false}}) {
    DataLoaderOptions opts{.batch = 2, .seq = 9, .sampling = sampling, .shuffle = shuffle, .seed = 11};
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

TEST(DataLoader, LoopAfterSkipFirstBatchesTakesOnlyTheRemainingBatches) {
  const auto tokens = random_tokens(400, 100, 6);
  const auto path = write_tokens("skip.bin", tokens);
  for (Sampling sampling : {Sampling::windows, Sampling::random}) {
    const DataLoaderOptions opts{.batch = 3, .seq = 6, .sampling = sampling, .seed = 5, .max_batches = 10};
    DataLoader uninterrupted(TokenFile(path), opts);
    std::vector<std::vector<int64_t>> all;
    for (auto& [x, y] : uninterrupted) all.push_back(x.to_vector<int64_t>());
    ASSERT_EQ(all.size(), 10u);

    // A run stopped after 4 batches; its resumed loop must take batches 4..9 and no more.
    DataLoader resumed(TokenFile(path), opts);
    std::vector<std::vector<int64_t>> rest;
    for (auto& [x, y] : resumed.skip_first_batches(4)) rest.push_back(x.to_vector<int64_t>());
    ASSERT_EQ(rest.size(), 6u) << sampling_name(sampling);
    for (size_t i = 0; i < rest.size(); ++i) EXPECT_EQ(rest[i], all[4 + i]) << "batch " << 4 + i;
    EXPECT_EQ(resumed.position(), 10u);
    // Everything done: a further loop takes nothing.
    int64_t extra = 0;
    for ([[maybe_unused]] auto& batch : resumed) ++extra;
    EXPECT_EQ(extra, 0);
  }
}

// Random sampling, checked from its definition: row g of the global batch order starts at a
// uniform offset in [0, n - T - 1] that depends on (seed, g) only.
TEST(DataLoader, RandomSamplingIsTheSameAtAnyWorldSize) {
  const auto tokens = random_tokens(1237, 5000, 7);
  const auto path = write_tokens("random_world.bin", tokens);
  const int64_t B = 3, T = 17;
  for (int W : {2, 3}) {
    DataLoader single(TokenFile(path), {.batch = W * B, .seq = T, .sampling = Sampling::random, .seed = 21});
    std::vector<DataLoader> ranks;
    for (int r = 0; r < W; ++r)
      ranks.emplace_back(TokenFile(path), DataLoaderOptions{.batch = B, .seq = T, .rank = r, .world_size = W,
                                                            .sampling = Sampling::random, .seed = 21});
    for (int k = 0; k < 15; ++k) {
      const Batch whole = single.next();
      const auto wx = whole.x.to_vector<int64_t>(), wy = whole.y.to_vector<int64_t>();
      for (int r = 0; r < W; ++r) {
        const Batch part = ranks[r].next();
        const auto px = part.x.to_vector<int64_t>(), py = part.y.to_vector<int64_t>();
        for (int64_t b = 0; b < B; ++b) {
          const auto row = [&](const std::vector<int64_t>& v, int64_t i) {
            return std::vector<int64_t>(v.begin() + i * T, v.begin() + (i + 1) * T);
          };
          ASSERT_EQ(row(px, b), row(wx, r * B + b)) << "W=" << W << " k=" << k << " r=" << r << " b=" << b;
          ASSERT_EQ(row(py, b), row(wy, r * B + b)) << "W=" << W << " k=" << k << " r=" << r << " b=" << b;
        }
      }
    }
  }
}

TEST(DataLoader, RandomSamplingOffsetsAreInRangeUniformAndSeeded) {
  const auto tokens = random_tokens(1003, 5000, 8);
  const auto path = write_tokens("random_range.bin", tokens);
  const int64_t B = 7, T = 33, n = 1003, starts_count = n - T;  // offsets 0 .. n - T - 1
  DataLoader loader(TokenFile(path), {.batch = B, .seq = T, .sampling = Sampling::random, .seed = 3});
  DataLoader same(TokenFile(path), {.batch = B, .seq = T, .sampling = Sampling::random, .seed = 3});
  DataLoader other(TokenFile(path), {.batch = B, .seq = T, .sampling = Sampling::random, .seed = 4});
  const int64_t steps = 1000, draws = steps * B;
  constexpr int kBuckets = 10;
  std::vector<int64_t> bucket(kBuckets, 0);
  std::set<int64_t> distinct;
  int64_t lowest = n, highest = -1, equal_to_other = 0;
  for (int64_t k = 0; k < steps; ++k) {
    const auto starts = loader.row_starts(k), theirs = other.row_starts(k);
    ASSERT_EQ(starts, same.row_starts(k));
    for (int64_t b = 0; b < B; ++b) {
      const int64_t s = starts[b];
      ASSERT_GE(s, 0);
      ASSERT_LE(s, n - T - 1) << "row " << b << " of step " << k << " would run past the file";
      lowest = std::min(lowest, s);
      highest = std::max(highest, s);
      distinct.insert(s);
      ++bucket[s * kBuckets / starts_count];
      equal_to_other += s == theirs[b];
    }
  }
  // Uniform over 970 offsets: 7000 draws reach both ends and most offsets, and each tenth
  // of the range holds 700 ± 5 binomial standard deviations.
  EXPECT_LE(lowest, 5);
  EXPECT_GE(highest, n - T - 6);
  EXPECT_GT(distinct.size(), 900u);
  const double expected = static_cast<double>(draws) / kBuckets;
  const double sigma = std::sqrt(draws * 0.1 * 0.9);
  for (int i = 0; i < kBuckets; ++i) EXPECT_NEAR(bucket[i], expected, 5 * sigma) << "bucket " << i;
  EXPECT_LT(equal_to_other, draws / 50) << "another seed should draw other offsets";

  // The batch holds the windows at those offsets: x = tokens[s, s+T), y = tokens[s+1, s+T+1).
  for (int64_t k : {0, 17, 999}) {
    const Batch batch = loader.batch_at(k);
    const auto x = batch.x.to_vector<int64_t>(), y = batch.y.to_vector<int64_t>();
    const auto starts = loader.row_starts(k);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < T; ++t) {
        ASSERT_EQ(x[b * T + t], tokens[starts[b] + t]);
        ASSERT_EQ(y[b * T + t], tokens[starts[b] + t + 1]);
      }
  }
  // A file of exactly T + 1 tokens has one window.
  const auto exact = write_tokens("random_exact.bin", random_tokens(T + 1, 50, 9));
  DataLoader one(TokenFile(exact), {.batch = 4, .seq = T, .sampling = Sampling::random, .seed = 1});
  for (int64_t k = 0; k < 5; ++k) EXPECT_EQ(one.row_starts(k), std::vector<int64_t>(4, 0));
}

TEST(DataLoader, RejectsBadOptions) {
  const auto path = write_tokens("small.bin", {1, 2, 3, 4, 5});
  EXPECT_THROW(DataLoader(TokenFile(path), {.batch = 0, .seq = 2}), Error);
  EXPECT_THROW(DataLoader(TokenFile(path), {.batch = 1, .seq = 2, .rank = 2, .world_size = 2}), Error);
  EXPECT_THROW(DataLoader(TokenFile(path), {.batch = 1, .seq = 5, .shuffle = true}), Error);
  EXPECT_THROW(DataLoader(TokenFile(path), {.batch = 1, .seq = 5, .sampling = Sampling::random}), Error);
  EXPECT_THROW(DataLoader(TokenFile(path), {.batch = 1, .seq = 2, .sampling = Sampling::random, .shuffle = true}),
               Error);
  EXPECT_EQ(parse_sampling("random"), Sampling::random);
  EXPECT_EQ(parse_sampling("windows"), Sampling::windows);
  try {
    parse_sampling("shuffled");
    ADD_FAILURE() << "an unknown sampling mode was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'shuffled'"), std::string::npos) << e.what();
  }
  const auto tiny = write_tokens("one.bin", {1});
  EXPECT_THROW(DataLoader(TokenFile(tiny), {.batch = 1, .seq = 1}), Error);
}

// Issue 14 (training states with wrong contents): a position restored from a file whose token
// offsets overflow 64 bits (row·T) is refused instead of reading before the token map. The
// largest position allowed still follows the contract: offsets taken modulo the file size.
TEST(DataLoader, PositionsPastTheAddressableRangeAreRefused) {
  const auto tokens = random_tokens(997, 300, 4);
  const auto path = write_tokens("far.bin", tokens);
  for (auto [B, T, r, W] : std::vector<std::tuple<int64_t, int64_t, int, int>>{{4, 16, 0, 1}, {3, 7, 2, 3}}) {
    DataLoader loader(TokenFile(path), {.batch = B, .seq = T, .rank = r, .world_size = W});
    const uint64_t most = loader.max_position();
    // (most·W + r + 1)·B rows of T tokens fit in int64, one more micro-batch does not.
    const unsigned __int128 end_row = (static_cast<unsigned __int128>(most) * W + r + 1) * B;
    EXPECT_LE(end_row * T, static_cast<unsigned __int128>(INT64_MAX));
    EXPECT_GT((end_row + static_cast<unsigned __int128>(W * B)) * T, static_cast<unsigned __int128>(INT64_MAX));
    loader.set_position(most);
    const Batch batch = loader.next();
    const auto x = batch.x.to_vector<int64_t>();
    const auto starts = loader.row_starts(most);
    for (int64_t b = 0; b < B; ++b) {
      ASSERT_GE(starts[b], 0);
      EXPECT_EQ(x[b * T], tokens[starts[b] % static_cast<int64_t>(tokens.size())]) << b;
    }
    for (const uint64_t bad : {most + 1, uint64_t{1} << 62, ~uint64_t{0}}) {
      try {
        loader.set_position(bad);
        ADD_FAILURE() << "position " << bad << " was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
      }
      EXPECT_THROW(loader.skip_first_batches(bad), Error);
    }
    EXPECT_EQ(loader.position(), most + 1);  // unchanged by the refused ones
  }
}
