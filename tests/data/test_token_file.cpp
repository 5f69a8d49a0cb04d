// Token files: the bytes on disk are checked word by word against llm.c's layout, and
// damaged files are refused with the file and offset named.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "tessera/core/error.h"
#include "tessera/core/file_io.h"
#include "tessera/data/dataloader.h"
#include "tessera/data/token_file.h"

using namespace tessera;
using namespace tessera::data;

namespace {

std::filesystem::path temp_path(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / ("tessera_test_token_file_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir / name;
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void dump(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary) << bytes;
}

int32_t le_int32(const std::string& bytes, size_t offset) {
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data() + offset);
  return static_cast<int32_t>(b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24));
}

void expect_error_mentions(const std::filesystem::path& p, const std::vector<std::string>& fragments) {
  try {
    TokenFile f(p);
    ADD_FAILURE() << "accepted damaged file " << p;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    for (const auto& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << msg;
  }
}

// Removes this process's temporary folder when the tests are done.
class TempCleanup : public ::testing::Environment {
 public:
  void TearDown() override {
    std::filesystem::remove_all(std::filesystem::temp_directory_path() /
                                ("tessera_test_token_file_" + std::to_string(::getpid())));
  }
};
const auto* const kCleanup = ::testing::AddGlobalTestEnvironment(new TempCleanup);

}  // namespace

TEST(TokenFile, Version1LayoutIsLlmC) {
  std::mt19937 rng(1);
  std::vector<uint32_t> tokens(257);
  for (auto& t : tokens) t = rng() % 65536;
  const auto path = temp_path("v1.bin");
  write_token_file(path, tokens, 50257);
  const std::string bytes = slurp(path);
  ASSERT_EQ(bytes.size(), 1024 + 2 * tokens.size());
  EXPECT_EQ(le_int32(bytes, 0), 20240520);
  EXPECT_EQ(le_int32(bytes, 4), 1);
  EXPECT_EQ(le_int32(bytes, 8), 257);
  for (size_t w = 3; w < 256; ++w) EXPECT_EQ(le_int32(bytes, 4 * w), 0);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const auto* b = reinterpret_cast<const unsigned char*>(bytes.data() + 1024 + 2 * i);
    EXPECT_EQ(b[0] | (b[1] << 8), static_cast<int>(tokens[i]));
  }
  TokenFile f(path);
  EXPECT_EQ(f.version(), 1);
  ASSERT_EQ(f.size(), 257);
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(f[i], tokens[i]);
  EXPECT_EQ(f.max_token(), *std::max_element(tokens.begin(), tokens.end()));
  EXPECT_THROW(f[257], Error);
  EXPECT_THROW(f[-1], Error);
}

TEST(TokenFile, Version2ForLargeVocabularies) {
  std::vector<uint32_t> tokens = {0, 70000, 65535, 65536, 3, 100000};
  const auto path = temp_path("v2.bin");
  write_token_file(path, tokens);
  const std::string bytes = slurp(path);
  EXPECT_EQ(le_int32(bytes, 4), 2);
  ASSERT_EQ(bytes.size(), 1024 + 4 * tokens.size());
  TokenFile f(path);
  EXPECT_EQ(f.version(), 2);
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(static_cast<uint32_t>(le_int32(bytes, 1024 + 4 * i)), tokens[i]);
    EXPECT_EQ(f[i], tokens[i]);
  }
  // A vocabulary over 65,536 gets version 2 even when these tokens would fit uint16.
  write_token_file(temp_path("v2small.bin"), std::vector<uint32_t>{1, 2, 3}, 70000);
  EXPECT_EQ(TokenFile(temp_path("v2small.bin")).version(), 2);
  // Empty files are valid.
  write_token_file(temp_path("empty.bin"), std::vector<uint32_t>{});
  EXPECT_EQ(TokenFile(temp_path("empty.bin")).size(), 0);
}

TEST(TokenFile, RefusesDamagedFilesNamingFileAndOffset) {
  const std::vector<uint32_t> tokens = {5, 6, 7, 8, 9, 10, 11};
  const auto good = temp_path("good.bin");
  write_token_file(good, tokens);
  const std::string bytes = slurp(good);

  const auto short_header = temp_path("short_header.bin");
  dump(short_header, bytes.substr(0, 100));
  expect_error_mentions(short_header, {"header", "offset 100"});

  std::string bad_magic = bytes;
  bad_magic[0] = 1;
  dump(temp_path("bad_magic.bin"), bad_magic);
  expect_error_mentions(temp_path("bad_magic.bin"), {"magic", "offset 0"});

  std::string bad_version = bytes;
  bad_version[4] = 3;
  dump(temp_path("bad_version.bin"), bad_version);
  expect_error_mentions(temp_path("bad_version.bin"), {"version 3", "offset 4"});

  dump(temp_path("truncated.bin"), bytes.substr(0, bytes.size() - 3));
  expect_error_mentions(temp_path("truncated.bin"), {"truncated", "offset 8", "offset 1035"});

  dump(temp_path("extra.bin"), bytes + "xx");
  expect_error_mentions(temp_path("extra.bin"), {"extra bytes", "offset 1038"});

  std::string negative = bytes;
  negative[11] = static_cast<char>(0x80);
  dump(temp_path("negative.bin"), negative);
  expect_error_mentions(temp_path("negative.bin"), {"negative", "offset 8"});

  expect_error_mentions(temp_path("missing.bin"), {"cannot open"});
}

TEST(FileIo, AtomicWriteReplacesAndChecksumsMatchKnownValues) {
  const auto path = temp_path("atomic.txt");
  write_file_atomically(path, std::string("first"));
  write_file_atomically(path, std::string("second version"));
  EXPECT_EQ(read_file(path), "second version");
  for (const auto& entry : std::filesystem::directory_iterator(path.parent_path()))
    EXPECT_EQ(entry.path().string().find(".tmp."), std::string::npos) << entry.path();
  // Published check values of CRC-32/ISO-HDLC and Adler-32.
  EXPECT_EQ(crc32(std::string("123456789")), 0xCBF43926u);
  const std::string wiki = "Wikipedia";
  EXPECT_EQ(adler32(std::as_bytes(std::span<const char>(wiki.data(), wiki.size()))), 0x11E60398u);
  // Continuing a CRC over two halves equals one pass.
  EXPECT_EQ(crc32(std::string("6789"), crc32(std::string("12345"))), 0xCBF43926u);
}

// Issue 14, defect 8: a directory is named as one (mmap used to say "No such device").
TEST(TokenFile, ADirectoryIsRefusedAsOne) {
  const auto dir = temp_path("a_folder");
  std::filesystem::create_directories(dir);
  expect_error_mentions(dir, {"is a directory"});
}

// Issue 14, defect 3: the checksums that guard exported model folders.
TEST(FileIo, FolderChecksumsCatchDamageNamingTheFile) {
  const auto dir = temp_path("checked_folder");
  std::filesystem::create_directories(dir);
  std::mt19937 rng(3);
  std::string weights(10007, '\0');
  for (char& c : weights) c = static_cast<char>(rng());
  dump(dir / "weights.bin", weights);
  dump(dir / "config.json", "{\"n\": 1}");
  write_folder_checksums(dir);
  const auto sums = read_file(dir / "checksums.json");
  EXPECT_NE(sums.find(std::to_string(crc32(weights))), std::string::npos) << sums;
  EXPECT_NO_THROW(verify_folder_checksums(dir, {"weights.bin", "config.json"}));
  auto expect_refused = [&](const std::vector<std::string>& fragments, std::vector<std::string> required = {}) {
    try {
      verify_folder_checksums(dir, required);
      ADD_FAILURE() << "damage not caught";
    } catch (const Error& e) {
      for (const auto& f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
    }
  };
  std::string flipped = weights;
  flipped[5000] ^= 0x08;
  dump(dir / "weights.bin", flipped);
  expect_refused({(dir / "weights.bin").string(), "damaged", "CRC-32"});
  dump(dir / "weights.bin", weights.substr(0, 9000));
  expect_refused({"weights.bin", "damaged", "9000 bytes", "10007"});
  dump(dir / "weights.bin", weights);
  EXPECT_NO_THROW(verify_folder_checksums(dir));
  expect_refused({"tokenizer.json", "not listed"}, {"tokenizer.json"});
  std::filesystem::remove(dir / "config.json");
  expect_refused({"config.json", "missing"});
  dump(dir / "checksums.json", "{\"files\": 3");
  expect_refused({"checksums.json", "damaged"});
}

// Issue 38 item 5: a token file truncated while it is read (memory-mapped) ended the process
// with SIGBUS and no message; the next batch read now fails naming the file and both sizes.
TEST(TokenFile, AFileThatShrinksWhileInUseIsAnErrorNamingItsSizes) {
  const auto path = temp_path("shrinks.bin");
  std::vector<uint32_t> tokens(4096);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 200);
  write_token_file(path, tokens);
  const TokenFile file(path);
  DataLoader loader(file, {.batch = 2, .seq = 16});
  loader.next();
  const auto full_bytes = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, 1024);  // another program truncates it in place
  try {
    loader.set_position(100);  // rows far past the new end of the map
    loader.next();
    FAIL() << "read a shrunk file";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(path.string()), std::string::npos) << what;
    EXPECT_NE(what.find("shrank"), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(full_bytes)), std::string::npos) << what;
    EXPECT_NE(what.find("1024"), std::string::npos) << what;
  }
}
