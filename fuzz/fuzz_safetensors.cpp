// libFuzzer target: the safetensors reader (core/safetensors), both through a memory map
// and read into memory. A clear tessera::Error is the expected answer to a bad file;
// anything else (a crash, a sanitizer report, another exception, a huge allocation)
// is a finding. Every tensor handed out is read end to end, so a view past the file's
// bytes is caught by AddressSanitizer.
#include "tessera/core/error.h"
#include "tessera/core/safetensors.h"
#include "fuzz/fuzz_input.h"

namespace {

// Touches every byte of a loaded tensor (CPU, contiguous as loaded).
void read_all(const tessera::Tensor& t) {
  const size_t bytes = t.nbytes();
  if (bytes == 0) return;
  const auto* p = static_cast<const unsigned char*>(t.raw_data());
  volatile unsigned sum = 0;
  for (size_t i = 0; i < bytes; ++i) sum = sum + p[i];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = tessera::fuzz::write_input("input.safetensors", data, size);
  for (bool memory_map : {true, false}) {
    tessera::fuzz::expect_clean_error([&] {
      const tessera::SafetensorsContents file =
          tessera::load_safetensors(path.string(), {.memory_map = memory_map});
      for (const auto& [name, tensor] : file.tensors) read_all(tensor);
    });
  }
  return 0;
}
