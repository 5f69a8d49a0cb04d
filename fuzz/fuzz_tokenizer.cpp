// libFuzzer target: the tokenizer-file reader (data/tokenizer). The input is read as a
// tokenizer.json file; a tokenizer that loads must round-trip text exactly (every byte
// string encodes and decodes to itself), decode every id of its vocabulary, and refuse
// an id past it with a tessera::Error.
#include <string>

#include "tessera/core/error.h"
#include "tessera/data/tokenizer.h"
#include "fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = tessera::fuzz::write_input("tokenizer.json", data, size);
  std::unique_ptr<tessera::data::Tokenizer> tokenizer;
  tessera::fuzz::expect_clean_error([&] { tokenizer = tessera::data::load_tokenizer(path); });
  if (!tokenizer) return 0;
  // The input's own bytes make a text that is not valid UTF-8 as often as it is.
  const std::string text(reinterpret_cast<const char*>(data), std::min<size_t>(size, 256));
  const std::vector<uint32_t> ids = tokenizer->encode(text);
  if (tokenizer->decode(ids) != text) __builtin_trap();
  const int64_t vocab = tokenizer->vocab_size();
  if (vocab <= 0) __builtin_trap();
  for (int64_t id = 0; id < std::min<int64_t>(vocab, 4096); ++id)
    (void)tokenizer->token_bytes(static_cast<uint32_t>(id));
  try {
    (void)tokenizer->decode({static_cast<uint32_t>(vocab)});
    __builtin_trap();
  } catch (const tessera::Error&) {
  }
  return 0;
}
