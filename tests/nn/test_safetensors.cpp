// core/safetensors: round trips of every dtype and refusal of damaged files.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "tessera/core/random.h"
#include "tessera/core/safetensors.h"
#include "tessera/kernels/ops.h"

using namespace tessera;

namespace {

std::filesystem::path scratch(const std::string& name) {
  auto dir = std::filesystem::path(TESSERA_BINARY_DIR) / "test_scratch" / "safetensors";
  std::filesystem::create_directories(dir);
  return dir / name;
}

// A hand-made file: header JSON + `data_bytes` bytes of payload.
std::string write_raw(const std::string& name, const std::string& header, size_t data_bytes,
                      int64_t header_len_override = -1) {
  const auto path = scratch(name).string();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  uint64_t n = header_len_override >= 0 ? uint64_t(header_len_override) : header.size();
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = char((n >> (8 * i)) & 0xff);
  out.write(len, 8);
  out.write(header.data(), std::streamsize(header.size()));
  std::string data(data_bytes, '\x01');
  out.write(data.data(), std::streamsize(data.size()));
  return path;
}

void expect_refused(const std::string& path, const std::vector<std::string>& fragments) {
  try {
    load_safetensors(path);
    FAIL() << "loading " << path << " should have failed";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    for (const auto& f : fragments)
      EXPECT_NE(msg.find(f), std::string::npos) << "'" << f << "' not in: " << msg;
  }
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDType) {
  Generator gen(7);
  std::vector<std::pair<std::string, Tensor>> tensors;
  const std::vector<DType> dtypes{DType::f32, DType::f16, DType::bf16, DType::f64,
                                  DType::i32, DType::i64, DType::u8,   DType::boolean};
  for (size_t i = 0; i < dtypes.size(); ++i) {
    Tensor base = randint(0, 2 + int64_t(i) * 10, {7, 33}, {.dtype = DType::i64}, &gen);
    if (is_floating(dtypes[i])) base = normal({7, 33}, 0, 3, {.dtype = DType::f64}, &gen);
    tensors.emplace_back("t" + std::to_string(i), ops::to(base, Device::cpu(), dtypes[i]));
  }
  // A non-contiguous view and a scalar and an empty tensor.
  Tensor m = normal({5, 9}, 0, 1, {}, &gen);
  tensors.emplace_back("transposed", ops::transpose(m, 0, 1));
  tensors.emplace_back("scalar", full({}, 2.5));
  tensors.emplace_back("empty", zeros({0, 3}));
  const auto path = scratch("roundtrip.safetensors").string();
  save_safetensors(path, tensors, {{"format", "pt"}, {"note", "hello"}});
  for (bool mapped : {true, false}) {
    const auto loaded = load_safetensors(path, {.memory_map = mapped});
    EXPECT_EQ(loaded.metadata.at("note"), "hello");
    ASSERT_EQ(loaded.tensors.size(), tensors.size());
    for (const auto& [name, t] : tensors) {
      const Tensor& got = loaded.at(name);
      EXPECT_EQ(got.dtype(), t.dtype()) << name;
      EXPECT_EQ(got.shape(), t.shape()) << name;
      if (t.numel() > 0)
        EXPECT_EQ(ops::max_rel_error(ops::to(got, Device::cpu(), DType::f64),
                                     ops::to(t, Device::cpu(), DType::f64)),
                  0.0)
            << name;
    }
    // Writable without touching the file (copy-on-write mapping).
    ops::fill_(loaded.at("t0"), 0.0);
  }
  EXPECT_NE(load_safetensors(path).at("t0").to_vector<float>()[0], 0.0f);
  // The atomic write leaves no temporary file behind.
  for (const auto& e : std::filesystem::directory_iterator(scratch("")))
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
}

TEST(Safetensors, HeaderLayoutIsTheReferenceOne) {
  const auto path = scratch("layout.safetensors").string();
  save_safetensors(path, {{"b", ones({3})}, {"a", zeros({2}, {.dtype = DType::i32})}});
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const std::string header = bytes.substr(8, n);
  EXPECT_NE(header.find("\"a\":{\"dtype\":\"I32\",\"shape\":[2],\"data_offsets\":[0,8]}"),
            std::string::npos)
      << header;
  EXPECT_NE(header.find("\"b\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[8,20]}"),
            std::string::npos)
      << header;
  EXPECT_EQ(bytes.size(), 8 + n + 20);
}

TEST(Safetensors, RefusesDamagedFiles) {
  const std::string ok = R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  EXPECT_NO_THROW(load_safetensors(write_raw("ok.safetensors", ok, 16)));
  expect_refused(write_raw("hdr.safetensors", ok, 16, 1 << 20), {"header length", "offset 0"});
  expect_refused(write_raw("short.safetensors", ok, 8), {"'w'", "[0, 16]", "past"});
  expect_refused(
      write_raw("dtype.safetensors", R"({"w":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", 2),
      {"'w'", "unknown dtype", "F8"});
  expect_refused(write_raw("shape.safetensors",
                           R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
                 {"'w'", "needs 12 bytes", "[0, 8]"});
  expect_refused(write_raw("overlap.safetensors",
                           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                           R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                           12),
                 {"'b'", "offset 4", "overlaps", "'a'"});
  expect_refused(write_raw("json.safetensors", "{not json", 0), {"not valid JSON"});
  expect_refused(write_raw("tiny.safetensors", "", 0, 0), {"not valid JSON"});
  {
    const auto path = scratch("three_bytes.safetensors").string();
    std::ofstream(path, std::ios::binary) << "abc";
    expect_refused(path, {"too short"});
  }
  EXPECT_THROW(load_safetensors(scratch("missing.safetensors").string()), Error);
}

TEST(Safetensors, WriterRejectsBadInput) {
  const auto path = scratch("bad.safetensors").string();
  EXPECT_THROW(save_safetensors(path, {{"x", ones({2})}, {"x", ones({3})}}), Error);
  EXPECT_THROW(save_safetensors(path, {{"__metadata__", ones({2})}}), Error);
  EXPECT_THROW(save_safetensors(path, {{"u", Tensor()}}), Error);
}

// Issue 14, defect 5: shape products and byte counts that overflow 64 bits are refused
// (they used to wrap to 0 and pass as 0-byte tensors).
TEST(Safetensors, RefusesShapesWhoseSizeOverflows) {
  auto entry = [](const std::string& dtype, const std::string& shape) {
    return R"({"t":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":[0,0]}})";
  };
  expect_refused(write_raw("ovf_2d.safetensors", entry("F32", "[4294967296,4294967296]"), 0),
                 {"'t'", "[4294967296, 4294967296]", "overflow"});
  expect_refused(write_raw("ovf_bytes.safetensors", entry("F32", "[4611686018427387904]"), 0),
                 {"'t'", "4611686018427387904", "overflow"});
  expect_refused(write_raw("ovf_f64.safetensors", entry("F64", "[2305843009213693952]"), 0),
                 {"'t'", "overflow"});
  expect_refused(write_raw("ovf_dim.safetensors", entry("U8", "[9223372036854775808,2]"), 0),
                 {"'t'", "9223372036854775808", "overflow"});
  expect_refused(write_raw("ovf_u64.safetensors", entry("U8", "[18446744073709551615]"), 0),
                 {"'t'", "overflow"});
}

// A 0-byte tensor at a misaligned offset (copied out, not viewed) loads as an empty
// tensor; this once passed a null pointer to memcpy (UBSan).
TEST(Safetensors, LoadsZeroByteTensorsAtAnyOffset) {
  std::string header = R"({"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
                       R"("e":{"dtype":"F32","shape":[0,5],"data_offsets":[3,3]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const SafetensorsContents c = load_safetensors(write_raw("zero.safetensors", header, 3));
  EXPECT_EQ(c.at("e").shape(), (Shape{0, 5}));
  EXPECT_EQ(c.at("e").numel(), 0);
  EXPECT_EQ(c.at("a").to_vector<uint8_t>(), (std::vector<uint8_t>{1, 1, 1}));
}

// The streamed writer (one tensor's bytes at a time, in pieces) writes what save_safetensors
// writes, byte for byte; a tensor given too few bytes is refused naming it, leaving no file.
TEST(Safetensors, StreamedWriterMatchesTheWholeWriterAndRefusesShortTensors) {
  Generator gen(3);
  const Tensor a = randn({5, 3}, {}, &gen), b = randn({7}, {.dtype = DType::f64}, &gen);
  const auto whole = scratch("whole.safetensors").string(),
             streamed = scratch("streamed.safetensors").string();
  save_safetensors(whole, {{"b", b}, {"a", a}}, {{"format", "pt"}});
  const std::map<std::string, Tensor> by_name{{"a", a}, {"b", b}};
  save_safetensors_streamed(streamed, {{"b", DType::f64, {7}}, {"a", DType::f32, {5, 3}}},
                            [&](const SafetensorsEntry& e, const ByteWriter& write) {
                              const auto* bytes =
                                  static_cast<const char*>(by_name.at(e.name).raw_data());
                              const size_t n = by_name.at(e.name).nbytes();
                              write({bytes, n / 2});  // in two pieces
                              write({bytes + n / 2, n - n / 2});
                            },
                            {{"format", "pt"}});
  auto slurp = [](const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(slurp(streamed), slurp(whole));
  const auto short_file = scratch("short.safetensors").string();
  std::filesystem::remove(short_file);
  try {
    save_safetensors_streamed(short_file, {{"a", DType::f32, {5, 3}}},
                              [&](const SafetensorsEntry&, const ByteWriter& write) {
                                write({a.raw_data(), 8});
                              });
    FAIL() << "a short tensor was written";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'a' got 8 bytes"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(std::filesystem::exists(short_file));
  for (const auto& entry : std::filesystem::directory_iterator(scratch("")))
    EXPECT_EQ(entry.path().filename().string().find("short.safetensors.tmp"), std::string::npos);
}
