// YAML settings files (yaml-cpp) as JSON values, so every file the project reads (`tessera
// train --config`, `tessera launch --config_file`, Accelerate's default_config.yaml) is
// checked by one set of rules whatever its format. Plain scalars take YAML 1.1's types
// (as PyYAML, which writes Accelerate's files, reads them): null/~, true/false/yes/no/on/off,
// integers, floats; a quoted scalar is always text.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace tessera::train {

// Parses `text` (from the file `path`, for messages). Malformed YAML, a key given twice and
// a number out of range are errors naming the file and the line ("config 'f.yaml' line 3:").
nlohmann::json parse_yaml(const std::string& text, const std::string& path);

// Reads and parses a file; one that cannot be opened is an error naming it.
nlohmann::json read_yaml_file(const std::string& path);

// A JSON object as block YAML, keys in the object's order, strings quoted where YAML would
// read them as something else ('no', '1', ...).
std::string to_yaml(const nlohmann::json& value);

}  // namespace tessera::train
