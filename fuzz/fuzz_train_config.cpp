// libFuzzer target: the training config reader (train/training_args.h): read_config_file
// (JSON, or flat YAML `key: value` lines), then apply_config_values and validate, as
// `tessera train --config` does, and the settings written back out (config.train.json).
// Bad input must be a tessera::Error naming the file or key.
#include "fuzz/fuzz_input.h"
#include "tessera/core/error.h"
#include "tessera/train/training_args.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const char* name : {"config.json", "config.yaml"}) {
    const auto path = tessera::fuzz::write_input(name, data, size);
    tessera::fuzz::expect_clean_error([&] {
      tessera::train::TrainingArguments args;
      const std::string source = "config '" + path.string() + "'";
      tessera::train::apply_config_values(args, tessera::train::read_config_file(path.string()),
                                          source);
      tessera::train::validate(args);
      (void)args.to_json().dump();
    });
  }
  return 0;
}
