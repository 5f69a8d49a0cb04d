#include "tessera/cli/train_config.h"

#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "tessera/core/device.h"
#include "tessera/core/error.h"

namespace tessera::cli {

namespace {

enum class Kind { Int, Real, Text, Flag };

struct Field {
  Kind kind;
  std::function<void(TrainConfig&, const nlohmann::json&)> set;
  std::function<nlohmann::json(const TrainConfig&)> get;
};

template <class T>
Field field(Kind kind, T TrainConfig::*member) {
  return {kind, [member](TrainConfig& c, const nlohmann::json& v) { c.*member = v.get<T>(); },
          [member](const TrainConfig& c) { return nlohmann::json(c.*member); }};
}

const std::map<std::string, Field>& fields() {
  static const std::map<std::string, Field> all = {
      {"data", field(Kind::Text, &TrainConfig::data)},
      {"val_data", field(Kind::Text, &TrainConfig::val_data)},
      {"init", field(Kind::Text, &TrainConfig::init)},
      {"n_layer", field(Kind::Int, &TrainConfig::n_layer)},
      {"n_head", field(Kind::Int, &TrainConfig::n_head)},
      {"n_embd", field(Kind::Int, &TrainConfig::n_embd)},
      {"block_size", field(Kind::Int, &TrainConfig::block_size)},
      {"vocab_size", field(Kind::Int, &TrainConfig::vocab_size)},
      {"batch", field(Kind::Int, &TrainConfig::batch)},
      {"seq", field(Kind::Int, &TrainConfig::seq)},
      {"grad_accum", field(Kind::Int, &TrainConfig::grad_accum)},
      {"shuffle", field(Kind::Flag, &TrainConfig::shuffle)},
      {"steps", field(Kind::Int, &TrainConfig::steps)},
      {"lr", field(Kind::Real, &TrainConfig::lr)},
      {"min_lr", field(Kind::Real, &TrainConfig::min_lr)},
      {"warmup", field(Kind::Int, &TrainConfig::warmup)},
      {"schedule", field(Kind::Text, &TrainConfig::schedule)},
      {"weight_decay", field(Kind::Real, &TrainConfig::weight_decay)},
      {"beta1", field(Kind::Real, &TrainConfig::beta1)},
      {"beta2", field(Kind::Real, &TrainConfig::beta2)},
      {"eps", field(Kind::Real, &TrainConfig::eps)},
      {"grad_clip", field(Kind::Real, &TrainConfig::grad_clip)},
      {"seed", field(Kind::Int, &TrainConfig::seed)},
      {"device", field(Kind::Text, &TrainConfig::device)},
      {"dtype", field(Kind::Text, &TrainConfig::dtype)},
      {"eval_every", field(Kind::Int, &TrainConfig::eval_every)},
      {"eval_batches", field(Kind::Int, &TrainConfig::eval_batches)},
      {"sample_every", field(Kind::Int, &TrainConfig::sample_every)},
      {"save_every", field(Kind::Int, &TrainConfig::save_every)},
      {"keep_last", field(Kind::Int, &TrainConfig::keep_last)},
      {"out", field(Kind::Text, &TrainConfig::out)},
      {"resume", field(Kind::Text, &TrainConfig::resume)},
  };
  return all;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::Int: return "an integer";
    case Kind::Real: return "a number";
    case Kind::Text: return "a string";
    case Kind::Flag: return "true or false";
  }
  return "?";
}

std::string normalize_key(std::string key) {
  for (char& c : key)
    if (c == '-') c = '_';
  return key;
}

// Converts a flag's text to the key's type; JSON values must already have it.
nlohmann::json typed_value(const std::string& key, Kind kind, const nlohmann::json& value,
                           const std::string& source) {
  auto fail = [&]() -> nlohmann::json {
    TESSERA_FAIL(source, ": key \"", key, "\" must be ", kind_name(kind), ", got ", value.dump());
  };
  if (value.is_string() && kind != Kind::Text) {
    // Flags and YAML scalars arrive as text: parse them strictly.
    const std::string s = value.get<std::string>();
    nlohmann::json parsed = nlohmann::json::parse(s, nullptr, false);
    if (parsed.is_discarded() || parsed.is_string()) return fail();
    return typed_value(key, kind, parsed, source);
  }
  switch (kind) {
    case Kind::Int:
      if (value.is_number_integer()) return value;
      if (value.is_number_float() && value.get<double>() == static_cast<double>(static_cast<int64_t>(value.get<double>())))
        return static_cast<int64_t>(value.get<double>());
      return fail();
    case Kind::Real:
      if (value.is_number()) return value.get<double>();
      return fail();
    case Kind::Text:
      if (value.is_string()) return value;
      return fail();
    case Kind::Flag:
      if (value.is_boolean()) return value;
      return fail();
  }
  return fail();
}

// One flat YAML line: `key: value`, with '#' comments; the value is a JSON scalar when it
// parses as one (numbers, true/false, "quoted"), otherwise the bare text.
nlohmann::json parse_flat_yaml(const std::string& text, const std::string& path) {
  nlohmann::json out = nlohmann::json::object();
  std::istringstream in(text);
  std::string line;
  int line_no = 0;
  auto trim = [](std::string s) {
    const auto b = s.find_first_not_of(" \t\r");
    const auto e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
  };
  while (std::getline(in, line)) {
    ++line_no;
    if (!line.empty() && line[0] != '"' && line[0] != '\'') {
      const auto hash = line.find(" #");
      if (hash != std::string::npos) line = line.substr(0, hash);
    }
    line = trim(line);
    if (line.empty() || line[0] == '#' || line == "---") continue;
    const auto colon = line.find(':');
    TESSERA_CHECK(colon != std::string::npos && colon > 0, "config '", path, "' line ", line_no,
                  ": expected `key: value` (only flat YAML is supported), got '", line, "'");
    const std::string key = trim(line.substr(0, colon));
    std::string value = trim(line.substr(colon + 1));
    TESSERA_CHECK(!value.empty(), "config '", path, "' line ", line_no, ": key \"", key,
                  "\" has no value (nested YAML is not supported)");
    if (value.size() >= 2 && value.front() == '\'' && value.back() == '\'')
      value = "\"" + value.substr(1, value.size() - 2) + "\"";
    nlohmann::json parsed = nlohmann::json::parse(value, nullptr, false);
    if (value == "yes" || value == "no") parsed = (value == "yes");
    out[key] = parsed.is_discarded() ? nlohmann::json(value) : parsed;
  }
  return out;
}

}  // namespace

const std::vector<std::string>& train_config_keys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k;
    for (const auto& [name, f] : fields()) k.push_back(name);
    return k;
  }();
  return keys;
}

nlohmann::json TrainConfig::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, f] : fields()) j[name] = f.get(*this);
  return j;
}

nlohmann::json read_config_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TESSERA_CHECK(in.good(), "config '", path, "': cannot open");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const bool yaml = path.ends_with(".yaml") || path.ends_with(".yml");
  if (yaml) return parse_flat_yaml(text, path);
  try {
    nlohmann::json j = nlohmann::json::parse(text);
    TESSERA_CHECK(j.is_object(), "config '", path, "': expected a JSON object of settings");
    return j;
  } catch (const nlohmann::json::parse_error& e) {
    TESSERA_FAIL("config '", path, "': not valid JSON at byte ", e.byte, ": ", e.what());
  }
}

void apply_config_values(TrainConfig& cfg, const nlohmann::json& values, const std::string& source) {
  for (const auto& [raw_key, value] : values.items()) {
    const std::string key = normalize_key(raw_key);
    auto it = fields().find(key);
    if (it == fields().end()) {
      std::string known;
      for (const auto& k : train_config_keys()) known += (known.empty() ? "" : ", ") + k;
      TESSERA_FAIL(source, ": unknown key \"", raw_key, "\" (known keys: ", known, ")");
    }
    it->second.set(cfg, typed_value(raw_key, it->second.kind, value, source));
  }
}

void validate(const TrainConfig& c) {
  auto require = [](bool ok, const std::string& key, const std::string& what, const nlohmann::json& got) {
    TESSERA_CHECK(ok, "config: key \"", key, "\" ", what, " (got ", got.dump(), ")");
  };
  require(!c.data.empty(), "data", "must name the training token file (--data)", c.data);
  for (auto [key, value] : {std::pair{"batch", c.batch}, {"seq", c.seq}, {"grad_accum", c.grad_accum},
                            {"steps", c.steps}, {"eval_batches", c.eval_batches}}) {
    require(value > 0, key, "must be positive", value);
  }
  for (auto [key, value] : {std::pair{"warmup", c.warmup}, {"eval_every", c.eval_every},
                            {"sample_every", c.sample_every}, {"save_every", c.save_every},
                            {"vocab_size", c.vocab_size}, {"block_size", c.block_size}, {"seed", c.seed}}) {
    require(value >= 0, key, "must not be negative", value);
  }
  require(c.schedule == "constant" || c.warmup < c.steps, "warmup",
          "must be shorter than steps = " + std::to_string(c.steps) + " for a decaying schedule", c.warmup);
  require(c.keep_last >= 1, "keep_last", "must be at least 1", c.keep_last);
  if (c.init.empty()) {
    for (auto [key, value] : {std::pair{"n_layer", c.n_layer}, {"n_head", c.n_head}, {"n_embd", c.n_embd}})
      require(value > 0, key, "must be positive", value);
    require(c.n_embd % c.n_head == 0, "n_head",
            "must divide n_embd = " + std::to_string(c.n_embd) + " into equal heads", c.n_head);
    const int64_t context = c.block_size > 0 ? c.block_size : c.seq;
    require(c.seq <= context, "seq",
            "is longer than the model context block_size = " + std::to_string(context), c.seq);
  }
  require(c.lr > 0, "lr", "must be positive", c.lr);
  require(c.min_lr <= c.lr, "min_lr", "must not exceed lr", c.min_lr);
  require(c.weight_decay >= 0, "weight_decay", "must not be negative", c.weight_decay);
  require(c.beta1 >= 0 && c.beta1 < 1, "beta1", "must be in [0, 1)", c.beta1);
  require(c.beta2 >= 0 && c.beta2 < 1, "beta2", "must be in [0, 1)", c.beta2);
  require(c.eps > 0, "eps", "must be positive", c.eps);
  require(c.grad_clip >= 0, "grad_clip", "must not be negative (0 = no clipping)", c.grad_clip);
  require(c.schedule == "constant" || c.schedule == "cosine" || c.schedule == "linear", "schedule",
          "must be constant, cosine or linear", c.schedule);
  require(c.dtype == "fp32" || c.dtype == "bf16" || c.dtype == "fp16", "dtype",
          "must be fp32, bf16 or fp16", c.dtype);
  try {
    Device::parse(c.device);
  } catch (const Error&) {
    require(false, "device", "must be cpu, cuda or cuda:N", c.device);
  }
}

}  // namespace tessera::cli
