// Reading and writing the safetensors format (the Hugging Face weight file).
//
// Layout: 8-byte little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"key": "value"}}
// then the byte buffer; offsets are relative to the buffer's start.
//
// Loading validates everything before any tensor is handed out: a damaged file
// is refused with an error naming the file, the tensor and the offset, never
// half-loaded. Writing is atomic: a temporary file next to the target is
// written, fsync'ed and renamed over it.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera {

// "F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL".
const char* safetensors_dtype_name(DType dtype);
// The DType of a safetensors dtype string; error naming `context` for unknown ones.
DType safetensors_dtype_from_name(const std::string& name, const std::string& context);

struct SafetensorsContents {
  std::map<std::string, Tensor> tensors;  // CPU tensors, sorted by name
  std::map<std::string, std::string> metadata;

  bool contains(const std::string& name) const { return tensors.count(name) != 0; }
  // The tensor called `name`, or an error naming it and the file.
  const Tensor& at(const std::string& name) const;
  std::string path;  // where it was read from (for messages)
};

struct SafetensorsLoadOptions {
  // Map the file and let the tensors view the mapping (copy-on-write, so writes
  // to a loaded tensor never reach the file). Otherwise read it into memory.
  bool memory_map = true;
};

SafetensorsContents load_safetensors(const std::string& path, SafetensorsLoadOptions opts = {});

// Writes `tensors` (any device, any strides; written contiguous, little-endian)
// in name order. Names must be unique and not "__metadata__".
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The same file written one tensor at a time, never holding them all: the header comes from
// `entries` (dtype and shape; written in name order), then write_data(entry, write) is called
// for each entry in that order and must pass its bytes (little-endian, contiguous) to `write`
// in one or more pieces, exactly as many as the dtype and shape take.
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
};
struct ByteSpan;
using ByteWriter = std::function<void(const ByteSpan&)>;
void save_safetensors_streamed(const std::string& path, std::vector<SafetensorsEntry> entries,
                               const std::function<void(const SafetensorsEntry&, const ByteWriter&)>& write_data,
                               const std::map<std::string, std::string>& metadata = {});

// Writes `bytes` to `path` atomically: temporary file in the same folder,
// fsync, rename, fsync of the folder. Used for every file Tessera saves.
struct ByteSpan {
  const void* data;
  size_t size;
};
void write_file_atomic(const std::string& path, const std::vector<ByteSpan>& pieces);
inline void write_file_atomic(const std::string& path, const std::string& bytes) {
  write_file_atomic(path, {ByteSpan{bytes.data(), bytes.size()}});
}
// The same with the bytes produced by `produce`, which passes them to its writer piece by piece.
void write_file_atomic_streamed(const std::string& path, const std::function<void(const ByteWriter&)>& produce);

}  // namespace tessera
