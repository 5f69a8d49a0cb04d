// libFuzzer target: the `tessera train` config reader (JSON, or the flat YAML subset):
// read_config_file, then apply_config_values and validate, as `tessera train --config`
// does. Bad input must be a tessera::Error naming the file or key.
#include "tessera/core/error.h"
#include "fuzz/fuzz_input.h"
#include TESSERA_FUZZ_TRAIN_CONFIG_HEADER

namespace config = TESSERA_FUZZ_TRAIN_CONFIG_NAMESPACE;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  for (const char* name : {"config.json", "config.yaml"}) {
    const auto path = tessera::fuzz::write_input(name, data, size);
    tessera::fuzz::expect_clean_error([&] {
      config::TrainConfig cfg;
      config::apply_config_values(cfg, config::read_config_file(path.string()), path.string());
      config::validate(cfg);
      (void)cfg.to_json().dump();
    });
  }
  return 0;
}
