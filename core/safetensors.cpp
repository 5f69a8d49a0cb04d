#include "tessera/core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

namespace tessera {

namespace {

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::f32, "F32"}, {DType::f16, "F16"}, {DType::bf16, "BF16"}, {DType::f64, "F64"},
    {DType::i32, "I32"}, {DType::i64, "I64"}, {DType::u8, "U8"},     {DType::boolean, "BOOL"},
};

std::string errno_text() { return std::strerror(errno); }

// A whole file in memory: either mapped or read. Shared by the tensors that view it.
class FileBytes {
 public:
  FileBytes(const std::string& path, bool memory_map) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    TESSERA_CHECK(fd >= 0, "load_safetensors: cannot open '", path, "': ", errno_text());
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      std::string why = errno_text();
      ::close(fd);
      TESSERA_FAIL("load_safetensors: cannot stat '", path, "': ", why);
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ == 0) {
      ::close(fd);
      return;
    }
    if (memory_map) {
      // Private + writable: copy-on-write pages, so a loaded tensor may be modified in place.
      void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
      if (p != MAP_FAILED) {
        data_ = static_cast<uint8_t*>(p);
        mapped_ = true;
      }
    }
    if (!mapped_) {
      owned_.resize(size_);
      size_t done = 0;
      while (done < size_) {
        ssize_t n = ::read(fd, owned_.data() + done, size_ - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          std::string why = n == 0 ? "unexpected end of file" : errno_text();
          ::close(fd);
          TESSERA_FAIL("load_safetensors: reading '", path, "' failed at byte ", done, ": ", why);
        }
        done += static_cast<size_t>(n);
      }
      data_ = owned_.data();
    }
    ::close(fd);
  }
  ~FileBytes() {
    if (mapped_) ::munmap(data_, size_);
  }
  FileBytes(const FileBytes&) = delete;
  FileBytes& operator=(const FileBytes&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  bool mapped_ = false;
  std::vector<uint8_t> owned_;
};

struct EntryInfo {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

EntryInfo parse_entry(const std::string& path, const std::string& name, const nlohmann::json& j,
                      uint64_t buffer_size) {
  auto where = [&] { return detail::concat("load_safetensors: '", path, "', tensor '", name, "'"); };
  TESSERA_CHECK(j.is_object(), where(), ": entry is not a JSON object");
  TESSERA_CHECK(j.contains("dtype") && j["dtype"].is_string(), where(), ": missing \"dtype\"");
  TESSERA_CHECK(j.contains("shape") && j["shape"].is_array(), where(), ": missing \"shape\"");
  TESSERA_CHECK(j.contains("data_offsets") && j["data_offsets"].is_array() &&
                    j["data_offsets"].size() == 2,
                where(), ": missing or malformed \"data_offsets\" (need [begin, end])");
  EntryInfo e;
  e.name = name;
  e.dtype = safetensors_dtype_from_name(j["dtype"].get<std::string>(), where());
  for (const auto& d : j["shape"]) {
    TESSERA_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
                  where(), ": shape entries must be non-negative integers, got ", j["shape"].dump());
    const uint64_t size = d.get<uint64_t>();
    TESSERA_CHECK(size <= static_cast<uint64_t>(INT64_MAX), where(), ": shape ", j["shape"].dump(), ": size ",
                  size, " overflows int64");
    e.shape.push_back(static_cast<int64_t>(size));
  }
  // Checked products: a shape whose count or byte size wraps around 64 bits would
  // otherwise pass as a small (even 0-byte) tensor.
  uint64_t numel = 1;
  const bool has_zero = std::find(e.shape.begin(), e.shape.end(), int64_t{0}) != e.shape.end();
  for (int64_t d : e.shape)
    TESSERA_CHECK(has_zero || !__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel), where(),
                  ": shape ", shape_str(e.shape), ": the element count overflows");
  if (has_zero) numel = 0;
  TESSERA_CHECK(numel <= static_cast<uint64_t>(INT64_MAX), where(), ": shape ", shape_str(e.shape),
                ": the element count ", numel, " overflows int64");
  uint64_t expected = 0;
  TESSERA_CHECK(!__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(e.dtype)), &expected), where(),
                ": shape ", shape_str(e.shape), " of ", j["dtype"].get<std::string>(),
                ": the byte count overflows");
  for (const auto& o : j["data_offsets"]) {
    TESSERA_CHECK(o.is_number_unsigned() || (o.is_number_integer() && o.get<int64_t>() >= 0),
                  where(), ": data_offsets must be non-negative integers, got ",
                  j["data_offsets"].dump());
  }
  e.begin = j["data_offsets"][0].get<uint64_t>();
  e.end = j["data_offsets"][1].get<uint64_t>();
  TESSERA_CHECK(e.begin <= e.end, where(), ": data_offsets [", e.begin, ", ", e.end,
                "] end before begin");
  TESSERA_CHECK(e.end <= buffer_size, where(), ": data_offsets [", e.begin, ", ", e.end,
                "] run past the data buffer of ", buffer_size, " bytes (file truncated?)");
  TESSERA_CHECK(e.end - e.begin == expected, where(), ": shape ", shape_str(e.shape), " of ",
                j["dtype"].get<std::string>(), " needs ", expected, " bytes but data_offsets [",
                e.begin, ", ", e.end, "] hold ", e.end - e.begin);
  return e;
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& d : kDTypeNames)
    if (d.dtype == dtype) return d.name;
  TESSERA_FAIL("safetensors: no safetensors name for dtype ", dtype_name(dtype));
}

DType safetensors_dtype_from_name(const std::string& name, const std::string& context) {
  for (const auto& d : kDTypeNames)
    if (name == d.name) return d.dtype;
  TESSERA_FAIL(context, ": unknown dtype \"", name,
               "\" (supported: F32, F16, BF16, F64, I32, I64, U8, BOOL)");
}

const Tensor& SafetensorsContents::at(const std::string& name) const {
  auto it = tensors.find(name);
  TESSERA_CHECK(it != tensors.end(), "safetensors: no tensor '", name, "' in '", path, "'");
  return it->second;
}

SafetensorsContents load_safetensors(const std::string& path, SafetensorsLoadOptions opts) {
  auto file = std::make_shared<FileBytes>(path, opts.memory_map);
  const size_t size = file->size();
  TESSERA_CHECK(size >= 8, "load_safetensors: '", path, "' is ", size,
                " bytes, too short for the 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | file->data()[i];
  TESSERA_CHECK(header_len <= size - 8, "load_safetensors: '", path, "': header length ",
                header_len, " (at offset 0) runs past the end of the ", size, "-byte file");

  nlohmann::json header;
  try {
    header = nlohmann::json::parse(file->data() + 8, file->data() + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL("load_safetensors: '", path, "': header (bytes 8..", 8 + header_len,
                 ") is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(header.is_object(), "load_safetensors: '", path, "': header is not a JSON object");

  const uint64_t data_start = 8 + header_len;
  const uint64_t buffer_size = size - data_start;
  SafetensorsContents out;
  out.path = path;
  std::vector<EntryInfo> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      TESSERA_CHECK(it->is_object(), "load_safetensors: '", path,
                    "': __metadata__ must be an object of strings");
      for (auto m = it->begin(); m != it->end(); ++m) {
        TESSERA_CHECK(m->is_string(), "load_safetensors: '", path, "': __metadata__ value of '",
                      m.key(), "' is not a string");
        out.metadata[m.key()] = m->get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(path, it.key(), *it, buffer_size));
  }

  // No two tensors may share bytes.
  std::vector<const EntryInfo*> by_offset;
  for (const auto& e : entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const EntryInfo* a, const EntryInfo* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const EntryInfo& prev = *by_offset[i - 1];
    const EntryInfo& cur = *by_offset[i];
    TESSERA_CHECK(cur.begin >= prev.end || cur.begin == cur.end || prev.begin == prev.end,
                  "load_safetensors: '", path, "': tensor '", cur.name, "' at data offset ",
                  cur.begin, " overlaps tensor '", prev.name, "' [", prev.begin, ", ", prev.end,
                  ")");
  }

  for (const auto& e : entries) {
    uint8_t* p = file->data() + data_start + e.begin;
    Tensor t;
    if (reinterpret_cast<uintptr_t>(p) % dtype_size(e.dtype) == 0) {
      t = from_blob(p, e.shape, e.dtype, Device::cpu(), file);
    } else {  // misaligned for its type (a foreign writer's choice): copy out
      t = empty(e.shape, {.dtype = e.dtype});
      if (e.end > e.begin) std::memcpy(t.raw_data(), p, e.end - e.begin);  // an empty tensor has no buffer
    }
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

namespace {

uint64_t entry_bytes(const SafetensorsEntry& entry) {
  uint64_t n = dtype_size(entry.dtype);
  for (int64_t d : entry.shape) n *= static_cast<uint64_t>(d);
  return n;
}

// The 8-byte length and the JSON header of tensors laid out in the given order.
std::string safetensors_header(const std::vector<SafetensorsEntry>& entries,
                               const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = m;
  }
  uint64_t offset = 0;
  for (const SafetensorsEntry& entry : entries) {
    nlohmann::ordered_json e;
    e["dtype"] = safetensors_dtype_name(entry.dtype);
    e["shape"] = entry.shape;
    e["data_offsets"] = {offset, offset + entry_bytes(entry)};
    offset += entry_bytes(entry);
    header[entry.name] = e;
  }
  std::string json = header.dump();
  // Pad with spaces so the buffer starts 8-byte aligned (as the reference writer does).
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return prefix + json;
}

}  // namespace

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::vector<std::pair<std::string, Tensor>> sorted;
  for (const auto& [name, t] : tensors) {
    TESSERA_CHECK(name != "__metadata__", "save_safetensors: '", path,
                  "': a tensor may not be called __metadata__");
    TESSERA_CHECK(t.defined(), "save_safetensors: '", path, "': tensor '", name,
                  "' is undefined");
    // Host, contiguous copy (a no-op view for contiguous CPU tensors).
    sorted.emplace_back(name, raw::contiguous(raw::to(t, Device::cpu(), t.dtype())));
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < sorted.size(); ++i)
    TESSERA_CHECK(sorted[i].first != sorted[i - 1].first, "save_safetensors: '", path,
                  "': tensor name '", sorted[i].first, "' given twice");

  std::vector<SafetensorsEntry> entries;
  for (const auto& [name, t] : sorted) entries.push_back({name, t.dtype(), t.shape()});
  const std::string header = safetensors_header(entries, metadata);
  std::vector<ByteSpan> pieces{{header.data(), header.size()}};
  for (const auto& [name, t] : sorted) pieces.push_back({t.raw_data(), t.nbytes()});
  write_file_atomic(path, pieces);
}

void save_safetensors_streamed(const std::string& path, std::vector<SafetensorsEntry> entries,
                               const std::function<void(const SafetensorsEntry&, const ByteWriter&)>& write_data,
                               const std::map<std::string, std::string>& metadata) {
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  for (size_t i = 1; i < entries.size(); ++i)
    TESSERA_CHECK(entries[i].name != entries[i - 1].name, "save_safetensors: '", path, "': tensor name '",
                  entries[i].name, "' given twice");
  const std::string header = safetensors_header(entries, metadata);
  write_file_atomic_streamed(path, [&](const ByteWriter& write) {
    write({header.data(), header.size()});
    for (const SafetensorsEntry& entry : entries) {
      uint64_t written = 0;
      write_data(entry, [&](const ByteSpan& piece) {
        written += piece.size;
        write(piece);
      });
      TESSERA_CHECK(written == entry_bytes(entry), "save_safetensors: '", path, "': tensor '", entry.name,
                    "' got ", written, " bytes, its dtype and shape take ", entry_bytes(entry));
    }
  });
}

void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& pieces) {
  write_file_atomic_streamed(path, [&](const ByteWriter& write) {
    for (const auto& piece : pieces) write(piece);
  });
}

void write_file_atomic_streamed(const std::string& path, const std::function<void(const ByteWriter&)>& produce) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  TESSERA_CHECK(fd >= 0, "write_file_atomic: cannot create '", tmp, "': ", errno_text());
  auto fail = [&](const char* what) {
    std::string why = errno_text();
    ::close(fd);
    fd = -1;
    ::unlink(tmp.c_str());
    TESSERA_FAIL("write_file_atomic: ", what, " '", tmp, "' (for '", path, "') failed: ", why);
  };
  try {
    produce([&](const ByteSpan& piece) {
      const char* p = static_cast<const char*>(piece.data);
      size_t left = piece.size;
      while (left > 0) {
        ssize_t n = ::write(fd, p, left);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fail("writing");
        p += n;
        left -= static_cast<size_t>(n);
      }
    });
  } catch (...) {
    // A failed write already closed and removed the file (fail); a failing producer did not.
    if (fd >= 0) {
      ::close(fd);
      ::unlink(tmp.c_str());
    }
    throw;
  }
  if (::fsync(fd) != 0) fail("fsync of");
  if (::close(fd) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    TESSERA_FAIL("write_file_atomic: closing '", tmp, "' failed: ", why);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    TESSERA_FAIL("write_file_atomic: renaming '", tmp, "' to '", path, "' failed: ", why);
  }
  // Make the rename itself durable.
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace tessera
