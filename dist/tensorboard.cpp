#include "tessera/dist/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>

#include "tessera/core/error.h"

namespace tessera::dist {

namespace {

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t n = 0; n < 256; ++n) {
    uint32_t c = n;
    for (int k = 0; k < 8; ++k)
      c = (c & 1) ? 0x82F63B78u ^ (c >> 1) : c >> 1;  // reflected Castagnoli
    table[n] = c;
  }
  return table;
}

// TFRecord stores CRCs rotated and offset so that a CRC of data holding CRCs stays strong.
uint32_t masked_crc32c(const std::string& bytes) {
  const uint32_t crc = crc32c(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())));
  return ((crc >> 15) | (crc << 17)) + 0xA282EAD8u;
}

// ---- the protobuf wire format, only what Event needs ----
enum WireType { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7F) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}
void put_key(std::string& out, int field, WireType type) {
  put_varint(out, (uint64_t(field) << 3) | type);
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}
template <class T>
void put_fixed(std::string& out, int field, T value) {  // little-endian, as protobuf stores them
  static_assert(sizeof(T) == 4 || sizeof(T) == 8);
  put_key(out, field, sizeof(T) == 8 ? kFixed64 : kFixed32);
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.append(raw, sizeof(T));
}

// Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
std::string event(double wall_time, int64_t step, const std::string& summary) {
  std::string e;
  put_fixed<double>(e, 1, wall_time);
  put_key(e, 2, kVarint);
  put_varint(e, static_cast<uint64_t>(step));
  put_bytes(e, 5, summary);
  return e;
}

}  // namespace

uint32_t crc32c(std::span<const std::byte> bytes, uint32_t previous) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  uint32_t c = previous ^ 0xFFFFFFFFu;
  for (std::byte b : bytes) c = table[(c ^ static_cast<uint32_t>(b)) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

double unix_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

TensorBoardWriter::TensorBoardWriter(const std::filesystem::path& log_dir) {
  std::filesystem::create_directories(log_dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  const double now = unix_time_now();
  path_ =
      log_dir / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host);
  file_ = std::fopen(path_.c_str(), "ab");
  TESSERA_CHECK(file_ != nullptr, "TensorBoardWriter: cannot create '", path_.string(),
                "': ", std::strerror(errno));
  std::string first;  // Event { wall_time, file_version: "brain.Event:2" } opens every file
  put_fixed<double>(first, 1, now);
  put_bytes(first, 3, "brain.Event:2");
  write_event(first);
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(const std::string& tag, double value, int64_t step,
                                   double wall_time) {
  // Summary { repeated Value value = 1; }  Value { string tag = 1; float simple_value = 2; }
  std::string value_msg;
  put_bytes(value_msg, 1, tag);
  put_fixed<float>(value_msg, 2, static_cast<float>(value));
  std::string summary;
  put_bytes(summary, 1, value_msg);
  write_event(event(wall_time, step, summary));
}

void TensorBoardWriter::add_text(const std::string& tag, const std::string& text, int64_t step,
                                 double wall_time) {
  // Value { tag = 1; metadata = 9 { plugin_data = 1 { plugin_name = 1: "text" } };
  //         tensor = 8 { dtype = 1: DT_STRING (7); tensor_shape = 2: {} (a scalar); string_val = 8
  //         } }
  std::string plugin, metadata, tensor, value_msg, summary;
  put_bytes(plugin, 1, "text");
  put_bytes(metadata, 1, plugin);
  put_key(tensor, 1, kVarint);
  put_varint(tensor, 7);
  put_bytes(tensor, 2, "");
  put_bytes(tensor, 8, text);
  put_bytes(value_msg, 1, tag);
  put_bytes(value_msg, 8, tensor);
  put_bytes(value_msg, 9, metadata);
  put_bytes(summary, 1, value_msg);
  write_event(event(wall_time, step, summary));
}

void TensorBoardWriter::add_metrics_row(const nlohmann::json& row) {
  TESSERA_CHECK(row.is_object() && row.contains("step") && row["step"].is_number_integer(),
                "TensorBoardWriter: metrics row ", row.dump().substr(0, 120),
                " has no integer \"step\"");
  const int64_t step = row["step"].get<int64_t>();
  const double wall_time =
      row.contains("time") && row["time"].is_number() ? row["time"].get<double>() : unix_time_now();
  for (const auto& [key, value] : row.items())
    if (key != "step" && key != "time" && value.is_number())
      add_scalar(key, value.get<double>(), step, wall_time);
}

void TensorBoardWriter::write_event(const std::string& data) {
  // TFRecord: uint64 length, masked CRC-32C of the length, data, masked CRC-32C of the data.
  std::string length(8, '\0');
  const uint64_t n = data.size();
  std::memcpy(length.data(), &n, 8);
  std::string record = length;
  const uint32_t length_crc = masked_crc32c(length), data_crc = masked_crc32c(data);
  record.append(reinterpret_cast<const char*>(&length_crc), 4);
  record += data;
  record.append(reinterpret_cast<const char*>(&data_crc), 4);
  TESSERA_CHECK(std::fwrite(record.data(), 1, record.size(), file_) == record.size(),
                "TensorBoardWriter: error writing '", path_.string(), "': ", std::strerror(errno));
}

void TensorBoardWriter::flush() {
  TESSERA_CHECK(std::fflush(file_) == 0, "TensorBoardWriter: error flushing '", path_.string(),
                "': ", std::strerror(errno));
}

}  // namespace tessera::dist
