// libFuzzer target: the token-file reader (data/token_file). A bad header or length must
// be a tessera::Error; for a file that opens, every token is read through the checked and
// the unchecked accessors and max_token(), so a count larger than the mapping is caught.
#include "tessera/core/error.h"
#include "tessera/data/token_file.h"
#include "fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = tessera::fuzz::write_input("input.bin", data, size);
  tessera::fuzz::expect_clean_error([&] {
    const tessera::data::TokenFile file(path);
    uint64_t sum = file.max_token();
    for (int64_t i = 0; i < file.size(); ++i) sum += file[i] ^ file.at_unchecked(i);
    volatile uint64_t keep = sum;
    (void)keep;
    try {
      (void)file[file.size()];  // one past the end must be refused
      __builtin_trap();
    } catch (const tessera::Error&) {
    }
  });
  return 0;
}
