#include "tessera/train/yaml_file.h"

#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <regex>
#include <set>

#include "tessera/core/error.h"

namespace tessera::train {
namespace {

using Json = nlohmann::json;

std::string where(const std::string& path, const YAML::Mark& mark) {
  return detail::concat("config '", path, "' line ", mark.line + 1);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// YAML 1.1's core types of a plain scalar; `key` names it in a range error.
Json plain_scalar(const std::string& text, const std::string& at, const std::string& key) {
  const std::string word = lower(text);
  if (text.empty() || text == "~" || word == "null") return nullptr;
  if (word == "true" || word == "yes" || word == "on") return true;
  if (word == "false" || word == "no" || word == "off") return false;
  static const std::regex integer(R"([-+]?[0-9]+)");
  static const std::regex real(R"([-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?)");
  const bool is_integer = std::regex_match(text, integer);
  if (!is_integer && !std::regex_match(text, real)) return text;
  errno = 0;
  if (is_integer) {
    const long long value = std::strtoll(text.c_str(), nullptr, 10);
    TESSERA_CHECK(errno != ERANGE, at, ": key \"", key, "\": number ", text, " is out of range");
    return value;
  }
  const double value = std::strtod(text.c_str(), nullptr);
  TESSERA_CHECK(errno != ERANGE || value == 0, at, ": key \"", key, "\": number ", text,
                " is out of range");
  return value;
}

Json to_json(const YAML::Node& node, const std::string& path, const std::string& key) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return nullptr;
    case YAML::NodeType::Scalar:
      // Quoted scalars carry the non-specific tag "!": text, never a number or a switch.
      if (node.Tag() == "!") return node.Scalar();
      return plain_scalar(node.Scalar(), where(path, node.Mark()), key);
    case YAML::NodeType::Sequence: {
      Json list = Json::array();
      for (const YAML::Node& item : node) list.push_back(to_json(item, path, key));
      return list;
    }
    case YAML::NodeType::Map: {
      Json object = Json::object();
      for (const auto& entry : node) {
        TESSERA_CHECK(entry.first.IsScalar(), where(path, entry.first.Mark()),
                      ": a key must be plain text");
        const std::string name = entry.first.Scalar();
        TESSERA_CHECK(!object.contains(name), where(path, entry.first.Mark()), ": key \"", name,
                      "\" is given twice");
        object[name] = to_json(entry.second, path, name);
      }
      return object;
    }
  }
  return nullptr;
}

void emit(YAML::Emitter& out, const Json& value) {
  if (value.is_object()) {
    out << YAML::BeginMap;
    for (const auto& [key, item] : value.items()) {
      out << YAML::Key << key << YAML::Value;
      emit(out, item);
    }
    out << YAML::EndMap;
  } else if (value.is_array()) {
    out << YAML::Flow << YAML::BeginSeq;
    for (const Json& item : value) emit(out, item);
    out << YAML::EndSeq;
  } else if (value.is_string()) {
    const std::string text = value.get<std::string>();
    // What a reader would take for another type keeps its quotes ('no' is not false).
    const bool ambiguous = !plain_scalar(text, "", "").is_string();
    if (ambiguous) out << YAML::SingleQuoted;
    out << text;
  } else if (value.is_boolean()) {
    out << YAML::TrueFalseBool << YAML::LowerCase << value.get<bool>();
  } else if (value.is_null()) {
    out << YAML::Null;
  } else if (value.is_number_integer()) {
    out << value.get<long long>();
  } else {
    out << value.get<double>();
  }
}

}  // namespace

Json parse_yaml(const std::string& text, const std::string& path) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    TESSERA_FAIL(where(path, e.mark), ": not valid YAML: ", e.msg);
  }
  return to_json(root, path, "");
}

Json read_yaml_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), "config '", path, "': cannot open");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_yaml(text, path);
}

std::string to_yaml(const Json& value) {
  YAML::Emitter out;
  emit(out, value);
  return std::string(out.c_str()) + "\n";
}

}  // namespace tessera::train
