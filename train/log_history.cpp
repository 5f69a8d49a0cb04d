#include "tessera/train/log_history.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "tessera/core/error.h"

namespace tessera::train {

namespace {
// Read-back piece: small enough to stay below the allocator's mmap threshold, so reading a
// long history never grows the heap.
constexpr size_t kChunkBytes = size_t(64) << 10;
}  // namespace

LogHistory::LogHistory(const LogHistory& other) { *this = other; }

LogHistory& LogHistory::operator=(const LogHistory& other) {
  if (this == &other) return *this;
  file_.reset();
  size_ = 0;
  last_ = nullptr;
  other.for_each_line([&](std::string_view line) {
    append(line);
    append("\n");
  });
  size_ = other.size_;
  last_ = other.last_;
  return *this;
}

void LogHistory::open_file() {
  file_.reset(std::tmpfile());
  TESSERA_CHECK(file_ != nullptr,
                "log history: cannot create a temporary file: ", std::strerror(errno));
}

void LogHistory::append(std::string_view bytes) {
  if (!file_) open_file();
  TESSERA_CHECK(std::fwrite(bytes.data(), 1, bytes.size(), file_.get()) == bytes.size(),
                "log history: writing the temporary file failed: ", std::strerror(errno));
}

void LogHistory::push_back(const nlohmann::json& entry) {
  append(entry.dump() + "\n");  // compact JSON holds no raw newline
  last_ = entry;
  ++size_;
}

const nlohmann::json& LogHistory::back() const {
  TESSERA_CHECK(size_ > 0, "log history: back() of an empty history");
  return last_;
}

void LogHistory::for_each_line(const std::function<void(std::string_view)>& visit) const {
  if (!file_) return;
  std::FILE* f = file_.get();
  TESSERA_CHECK(std::fflush(f) == 0 && std::fseek(f, 0, SEEK_SET) == 0,
                "log history: the temporary file cannot be read: ", std::strerror(errno));
  std::vector<char> chunk(kChunkBytes);
  std::string partial;  // a line cut by the end of a chunk
  for (size_t got; (got = std::fread(chunk.data(), 1, chunk.size(), f)) > 0;) {
    std::string_view bytes(chunk.data(), got);
    for (size_t end; (end = bytes.find('\n')) != std::string_view::npos;) {
      if (partial.empty()) {
        visit(bytes.substr(0, end));
      } else {
        partial.append(bytes.substr(0, end));
        visit(partial);
        partial.clear();
      }
      bytes.remove_prefix(end + 1);
    }
    partial.append(bytes);
  }
  const bool failed = std::ferror(f) != 0;
  std::fseek(f, 0, SEEK_END);  // appends continue at the end
  TESSERA_CHECK(!failed && partial.empty(), "log history: reading the temporary file failed");
}

void LogHistory::for_each(const std::function<void(const nlohmann::json&)>& visit) const {
  for_each_line([&](std::string_view line) { visit(nlohmann::json::parse(line)); });
}

void LogHistory::write_array(std::ostream& out, int indent) const {
  if (size_ == 0) {
    out << "[]";
    return;
  }
  const std::string pad(static_cast<size_t>(std::max(indent, 0)), ' ');
  size_t written = 0;
  out << "[\n";
  for_each_line(
      [&](std::string_view line) { out << pad << line << (++written < size_ ? ",\n" : "\n"); });
  out << std::string(static_cast<size_t>(std::max(indent - 2, 0)), ' ') << "]";
}

}  // namespace tessera::train
