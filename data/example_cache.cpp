#include "tessera/data/example_cache.h"

#include <cstring>
#include <nlohmann/json.hpp>

#include "tessera/core/file_io.h"

namespace tessera::data {
namespace {

constexpr char kMagic[8] = {'T', 'S', 'R', 'D', 'S', 'E', 'T', '1'};
constexpr char kTrailerMagic[4] = {'T', 'S', 'R', '1'};
constexpr size_t kHeaderWords = 7;  // after the magic
constexpr size_t kTrailerBytes = 8;

size_t padded(size_t bytes) { return (bytes + 7) / 8 * 8; }

class ImageWriter {
 public:
  void bytes(const void* data, size_t size) {
    const auto* p = static_cast<const std::byte*>(data);
    out_.insert(out_.end(), p, p + size);
    out_.resize(padded(out_.size()));
  }
  template <class T>
  void values(const std::vector<T>& v) {
    bytes(v.data(), v.size() * sizeof(T));
  }
  std::vector<std::byte> finish() {
    const uint32_t crc = crc32(std::span<const std::byte>(out_));
    const auto* p = reinterpret_cast<const std::byte*>(&crc);
    out_.insert(out_.end(), p, p + 4);
    const auto* m = reinterpret_cast<const std::byte*>(kTrailerMagic);
    out_.insert(out_.end(), m, m + 4);
    return std::move(out_);
  }

 private:
  std::vector<std::byte> out_;
};

// Reads sections one after the other, refusing to step past the end.
class ImageReader {
 public:
  ImageReader(const std::byte* data, size_t size) : data_(data), size_(size) {}
  // The next `count` values of `width` bytes (nullptr when they do not fit).
  const std::byte* take(uint64_t count, size_t width) {
    if (count > (size_ - pos_) / width) return nullptr;
    const std::byte* p = data_ + pos_;
    pos_ += padded(static_cast<size_t>(count) * width);
    if (pos_ > size_) return nullptr;
    return p;
  }
  size_t position() const { return pos_; }

 private:
  const std::byte* data_;
  size_t size_, pos_ = 0;
};

}  // namespace

std::vector<std::byte> cache_image(const ExampleColumns& c, const std::string& key) {
  const std::string names = nlohmann::json(c.label_names).dump();
  const uint64_t header[kHeaderWords] = {key.size(),
                                         c.lines.size(),
                                         c.input_ids.size(),
                                         c.has_token_types ? 1u : 0u,
                                         static_cast<uint64_t>(c.label_kind),
                                         static_cast<uint64_t>(c.num_labels),
                                         names.size()};
  ImageWriter w;
  w.bytes(kMagic, sizeof(kMagic));
  w.bytes(header, sizeof(header));
  w.bytes(key.data(), key.size());
  w.bytes(names.data(), names.size());
  w.values(c.offsets);
  w.values(c.lines);
  if (c.label_kind == LabelKind::Class) w.values(c.class_labels);
  if (c.label_kind == LabelKind::Regression) w.values(c.regression_labels);
  w.values(c.input_ids);
  if (c.has_token_types) w.values(c.token_type_ids);
  return w.finish();
}

std::string read_cache_image(const std::byte* data, size_t size, const std::string& key,
                             ExampleImage& image) {
  if (size < sizeof(kMagic) + kHeaderWords * 8 + kTrailerBytes) return "shorter than its header";
  if (std::memcmp(data, kMagic, sizeof(kMagic)) != 0) return "not a Tessera dataset cache";
  if (std::memcmp(data + size - 4, kTrailerMagic, 4) != 0) return "truncated (no trailer)";
  uint32_t stored_crc;
  std::memcpy(&stored_crc, data + size - kTrailerBytes, 4);
  const size_t body = size - kTrailerBytes;
  if (crc32(std::span<const std::byte>(data, body)) != stored_crc) return "CRC-32 mismatch";

  uint64_t h[kHeaderWords];
  std::memcpy(h, data + sizeof(kMagic), sizeof(h));
  const uint64_t key_bytes = h[0], count = h[1], tokens = h[2], names_bytes = h[6];
  const bool has_types = h[3] == 1;
  if (h[3] > 1 || h[4] > static_cast<uint64_t>(LabelKind::Regression)) return "bad header";
  const auto kind = static_cast<LabelKind>(h[4]);
  ImageReader r(data, body);
  r.take(sizeof(kMagic) + sizeof(h), 1);
  const std::byte* key_text = r.take(key_bytes, 1);
  if (!key_text || std::string_view(reinterpret_cast<const char*>(key_text), key_bytes) != key)
    return "built for another source, tokenizer or options";
  const std::byte* names = r.take(names_bytes, 1);
  const std::byte* offsets = count < UINT64_MAX ? r.take(count + 1, 8) : nullptr;
  const std::byte* lines = r.take(count, 8);
  const std::byte* labels = kind == LabelKind::None ? data : r.take(count, 8);
  const std::byte* ids = r.take(tokens, 4);
  const std::byte* types = has_types ? r.take(tokens, 4) : data;
  if (!names || !offsets || !lines || !labels || !ids || !types || r.position() != body)
    return "section sizes do not add up to the file's";

  image.count = static_cast<int64_t>(count);
  image.offsets = reinterpret_cast<const uint64_t*>(offsets);
  for (uint64_t i = 0; i < count; ++i)
    if (image.offsets[i] > image.offsets[i + 1]) return "token offsets out of order";
  if (image.offsets[0] != 0 || image.offsets[count] != tokens) return "token offsets out of range";
  try {
    image.label_names = nlohmann::json::parse(std::string_view(
                                                  reinterpret_cast<const char*>(names), names_bytes))
                            .get<std::vector<std::string>>();
  } catch (const nlohmann::json::exception&) {
    return "unreadable label names";
  }
  image.lines = reinterpret_cast<const int64_t*>(lines);
  image.input_ids = reinterpret_cast<const uint32_t*>(ids);
  image.token_type_ids = has_types ? reinterpret_cast<const uint32_t*>(types) : nullptr;
  image.label_kind = kind;
  image.class_labels = kind == LabelKind::Class ? reinterpret_cast<const int64_t*>(labels) : nullptr;
  image.regression_labels =
      kind == LabelKind::Regression ? reinterpret_cast<const double*>(labels) : nullptr;
  image.num_labels = static_cast<int64_t>(h[5]);
  return "";
}

}  // namespace tessera::data
