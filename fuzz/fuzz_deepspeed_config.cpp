// libFuzzer target: the sharding configs users bring (dist/deepspeed_config.h): a DeepSpeed
// JSON file read and applied to the Accelerator's options, as `--deepspeed FILE` and
// `TrainingArguments::deepspeed` do, and the first line read as an FSDP sharding-strategy
// name, as `--fsdp` does. Bad input must be a tessera::Error naming the file or key.
#include <string>

#include "fuzz/fuzz_input.h"
#include "tessera/core/error.h"
#include "tessera/dist/accelerator.h"
#include "tessera/dist/deepspeed_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = tessera::fuzz::write_input("ds_config.json", data, size);
  tessera::fuzz::expect_clean_error([&] {
    const auto config = tessera::dist::DeepSpeedConfig::read(path.string());
    tessera::dist::AcceleratorOptions options;
    config.apply_to(options);
  });
  const std::string text(reinterpret_cast<const char*>(data), size);
  tessera::fuzz::expect_clean_error(
      [&] { (void)tessera::dist::fsdp_sharding_stage(text.substr(0, text.find('\n'))); });
  return 0;
}
