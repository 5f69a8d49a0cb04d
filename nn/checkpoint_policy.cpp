#include "tessera/nn/checkpoint_policy.h"

#include <cctype>
#include <utility>
#include <vector>

#include "tessera/autograd/autograd.h"
#include "tessera/core/error.h"

namespace tessera::nn {

namespace {

constexpr const char* kPolicies = "none, full, every_k:K (K >= 1), attention, mlp";
constexpr const char* kEveryPrefix = "every_k:";
// K is a block stride: 18 digits keep it far inside int64 before any block count is seen.
constexpr size_t kMaxDigits = 18;

}  // namespace

CheckpointPolicy CheckpointPolicy::every_k(int64_t k) {
  TESSERA_CHECK(k >= 1, "gradient checkpointing policy every_k:", k,
                ": K must be at least 1 (every_k:1 checkpoints every block)");
  return CheckpointPolicy(Kind::every_k, k);
}

CheckpointPolicy CheckpointPolicy::parse(const std::string& text) {
  if (text == "none") return CheckpointPolicy();
  if (text == "full") return full();
  if (text == "attention") return attention();
  if (text == "mlp") return mlp();
  if (text.starts_with(kEveryPrefix)) {
    const std::string digits = text.substr(std::string(kEveryPrefix).size());
    bool whole = !digits.empty() && digits.size() <= kMaxDigits;
    for (char c : digits) whole = whole && std::isdigit(static_cast<unsigned char>(c));
    TESSERA_CHECK(whole, "gradient checkpointing policy '", text,
                  "': K must be a whole number of blocks >= 1 (every_k:2 checkpoints blocks 0, "
                  "2, 4, ...)");
    const int64_t k = std::stoll(digits);
    TESSERA_CHECK(k >= 1, "gradient checkpointing policy '", text,
                  "': K must be at least 1 (every_k:1 checkpoints every block)");
    return every_k(k);
  }
  TESSERA_FAIL("gradient checkpointing policy '", text, "' is not one of ", kPolicies);
}

CheckpointPolicy CheckpointPolicy::from_kwargs(const nlohmann::json& kwargs) {
  TESSERA_CHECK(kwargs.is_object(), "gradient_checkpointing_kwargs must be a dict (JSON object), got ",
                kwargs.dump());
  CheckpointPolicy policy = full();  // Hugging Face: enabling without a policy recomputes every layer
  for (const auto& [key, value] : kwargs.items()) {
    if (key == "use_reentrant") {
      // torch.utils.checkpoint's switch between two implementations; Tessera has one.
      TESSERA_CHECK(value.is_boolean() || value.is_null(), "gradient_checkpointing_kwargs: \"use_reentrant\" ",
                    "must be true or false, got ", value.dump());
      continue;
    }
    if (key == "policy") {
      TESSERA_CHECK(value.is_string(), "gradient_checkpointing_kwargs: \"policy\" must be a string (",
                    kPolicies, "), got ", value.dump());
      policy = parse(value.get<std::string>());
      continue;
    }
    TESSERA_FAIL("gradient_checkpointing_kwargs: unknown key \"", key,
                 "\" (Tessera reads \"policy\": ", kPolicies, "; and accepts torch's \"use_reentrant\")");
  }
  return policy;
}

std::string CheckpointPolicy::name() const {
  switch (kind_) {
    case Kind::none:
      return "none";
    case Kind::full:
      return "full";
    case Kind::every_k:
      return kEveryPrefix + std::to_string(k_);
    case Kind::attention:
      return "attention";
    case Kind::mlp:
      return "mlp";
  }
  return "?";
}

void CheckpointPolicy::check_model(int64_t n_layer) const {
  TESSERA_CHECK(kind_ != Kind::every_k || k_ <= n_layer, "gradient checkpointing policy '", name(),
                "' asks for one block in ", k_, ", but the model has ", n_layer,
                " blocks (K must be at most ", n_layer, ")");
}

CheckpointRegion CheckpointPolicy::region(int64_t index) const {
  switch (kind_) {
    case Kind::none:
      return CheckpointRegion::none;
    case Kind::full:
      return CheckpointRegion::block;
    case Kind::every_k:
      return index % k_ == 0 ? CheckpointRegion::block : CheckpointRegion::none;
    case Kind::attention:
      return CheckpointRegion::attention;
    case Kind::mlp:
      return CheckpointRegion::mlp;
  }
  return CheckpointRegion::none;
}

Tensor checkpointed(bool recompute, std::function<Tensor(const Tensor&)> fn, const Tensor& x) {
  if (!recompute) return fn(x);
  return autograd::checkpoint(
      [fn = std::move(fn)](const std::vector<Tensor>& in) { return std::vector<Tensor>{fn(in[0])}; },
      {x})[0];
}

}  // namespace tessera::nn
