// Which activations a causal LM recomputes in backward (activation checkpointing by policy):
// the one place where a policy is named, parsed, checked against a model and turned into what
// each block does. GPT-2 and Llama (reference and fast blocks) read region() and nothing else.
//
//   none         nothing is recomputed
//   full         every block (what gradient_checkpointing = true has always meant)
//   every_k:K    blocks 0, K, 2K, ... (K >= 1, at most the model's blocks); every_k:1 = full
//   attention    in every block only the attention sub-layer (the module after the first norm,
//                its dropout included; the norm and the residual add stay outside)
//   mlp          in every block only the MLP sub-layer (the module after the second norm)
//
// Recomputed regions replay the default generator and the autocast policy of the first run
// (autograd::checkpoint), so losses and gradients are bit for bit those of a run without it.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/core/tensor.h"

namespace tessera::nn {

// What one block recomputes in backward.
enum class CheckpointRegion : uint8_t { none, block, attention, mlp };

class CheckpointPolicy {
 public:
  enum class Kind : uint8_t { none, full, every_k, attention, mlp };

  CheckpointPolicy() = default;  // none
  static CheckpointPolicy full() { return CheckpointPolicy(Kind::full, 1); }
  static CheckpointPolicy every_k(int64_t k);  // refuses k < 1, naming it
  static CheckpointPolicy attention() { return CheckpointPolicy(Kind::attention, 1); }
  static CheckpointPolicy mlp() { return CheckpointPolicy(Kind::mlp, 1); }

  // "none" | "full" | "every_k:K" | "attention" | "mlp" (exactly so: K in decimal digits).
  // Anything else is refused with a message that quotes the text and lists the policies.
  static CheckpointPolicy parse(const std::string& text);
  // Hugging Face's gradient_checkpointing_kwargs (a JSON object): Tessera's own key "policy"
  // (a name parse() reads; full when absent) and torch's "use_reentrant", accepted and
  // ignored (Tessera has one implementation: the non-reentrant one's semantics). Another key,
  // or a value of the wrong type, is refused naming it.
  static CheckpointPolicy from_kwargs(const nlohmann::json& kwargs);

  Kind kind() const { return kind_; }
  int64_t k() const { return k_; }  // every_k's K (1 otherwise)
  bool enabled() const { return kind_ != Kind::none; }
  // The policy as parse() reads it ("every_k:2").
  std::string name() const;

  // Refuses, naming the policy, one that cannot apply to a model of n_layer blocks:
  // every_k:K with K > n_layer (it would checkpoint block 0 alone, which every_k:n_layer
  // says; a K beyond the model is taken for a mistake in the policy, not silently accepted).
  void check_model(int64_t n_layer) const;

  // What block `index` (0-based) recomputes under this policy.
  CheckpointRegion region(int64_t index) const;

  bool operator==(const CheckpointPolicy&) const = default;

 private:
  CheckpointPolicy(Kind kind, int64_t k) : kind_(kind), k_(k) {}
  Kind kind_ = Kind::none;
  int64_t k_ = 1;
};

// fn(x) with its activations recomputed in backward when `recompute` (autograd::checkpoint:
// only x is kept, and the recompute replays the default generator and the autocast policy),
// else fn(x) as it is. fn is kept for the backward: what it refers to must outlive it.
Tensor checkpointed(bool recompute, std::function<Tensor(const Tensor&)> fn, const Tensor& x);

}  // namespace tessera::nn
