// nn::Module: named parameters and buffers in a tree of child modules.
//
// Names are hierarchical and dotted ("transformer.h.0.attn.c_attn.weight"), in
// registration order. A parameter is a Tensor whose TensorImpl is shared between
// the module's member and the registry, so re-pointing its storage (to(), load,
// or the dist layer moving it into a flat buffer) is seen everywhere. Nothing here
// caches raw pointers into parameter memory.
//
// Hooks (the dist layer's ZeRO-3 gathers a layer's parameters just in time):
// forward pre-hooks run before forward, forward hooks after it, and backward
// pre-hooks when the gradient of the module's output arrives, i.e. before any
// of the module's own backward runs.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::nn {

class Module;

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;
using ForwardPreHook = std::function<void(Module& module, const Tensor& input)>;
using ForwardHook = std::function<void(Module& module, const Tensor& input, const Tensor& output)>;
using BackwardPreHook = std::function<void(Module& module)>;

// What load_state_dict found (strict loading raises instead of returning these).
struct LoadStateDictResult {
  std::vector<std::string> missing_keys;
  std::vector<std::string> unexpected_keys;
};

struct LoadStateDictOptions {
  bool strict = true;
  // Keys ignored when present (e.g. GPT-2's mask buffers "*.attn.bias").
  std::function<bool(const std::string& key)> ignore;
};

class Module {
 public:
  Module() = default;
  virtual ~Module() = default;
  // Parameters are registered by address of the owning module: no copies or moves.
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // Runs the hooks around forward(x).
  Tensor operator()(const Tensor& x);
  // The module's computation; modules without a one-tensor forward raise.
  virtual Tensor forward(const Tensor& x);
  // Short type name for messages ("Linear", "GPT").
  virtual std::string type_name() const { return "Module"; }

  // ---- registration (by subclasses' constructors) ----
  // Registers t (made a leaf that requires grad) and returns it (same TensorImpl).
  Tensor register_parameter(const std::string& name, const Tensor& t, bool requires_grad = true);
  // Persistent buffers are part of the state dict; others (masks, caches) are not.
  Tensor register_buffer(const std::string& name, const Tensor& t, bool persistent = true);
  // A child the caller owns (typically a member); it must outlive this module.
  template <class M>
  M& register_module(const std::string& name, M& child) {
    add_child(name, &child, nullptr);
    return child;
  }
  // A child this module owns.
  template <class M>
  M& register_module(const std::string& name, std::unique_ptr<M> child) {
    M* raw = child.get();  // taken before the move: argument order is unspecified
    add_child(name, raw, std::unique_ptr<Module>(std::move(child)));
    return *raw;
  }

  // ---- traversal ----
  // Unique tensors (a tensor shared by two names is listed once, under the first).
  NamedTensors named_parameters(bool recurse = true) const;
  std::vector<Tensor> parameters(bool recurse = true) const;
  NamedTensors named_buffers(bool recurse = true) const;
  std::vector<std::pair<std::string, Module*>> named_children() const;
  // This module ("" name) and all descendants, depth first.
  std::vector<std::pair<std::string, Module*>> named_modules() const;
  // The parameter called `name` (dotted path), or an error naming it.
  Tensor parameter(const std::string& name) const;
  int64_t num_parameters(bool only_trainable = false) const;

  // ---- modes ----
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // ---- state ----
  // Parameters and persistent buffers, detached, sharing memory with the module.
  NamedTensors state_dict() const;
  // Copies values into the existing tensors (converting dtype/device). Strict mode
  // raises one error listing every missing key, unexpected key and shape mismatch.
  LoadStateDictResult load_state_dict(const std::map<std::string, Tensor>& state,
                                      const LoadStateDictOptions& opts = {});

  // Moves/converts every parameter and buffer in place (TensorImpls keep their
  // identity, so optimizers and hooks holding them follow). dtype conversion applies
  // to floating tensors only. Gradients are dropped.
  Module& to(Device device);
  Module& to(DType dtype);
  Module& to(Device device, DType dtype);
  void zero_grad(bool set_to_none = true);

  // ---- hooks; each register_* returns an id for remove_hook ----
  uint64_t register_forward_pre_hook(ForwardPreHook hook);
  uint64_t register_forward_hook(ForwardHook hook);
  uint64_t register_backward_pre_hook(BackwardPreHook hook);
  void remove_hook(uint64_t id);
  // True when any forward or backward hook is registered on this module (not its children):
  // a fused path that skips this module's own call must then not be taken.
  bool has_hooks() const {
    return !forward_pre_hooks_.empty() || !forward_hooks_.empty() || !backward_pre_hooks_.empty();
  }
  // has_hooks() of this module or any descendant.
  bool any_hooks() const;
  // Runs body() between the forward hooks, and arms the backward pre-hooks on its
  // output. Entry points other than operator() (GPT::loss; the fast blocks, nn/gpt_fast.h,
  // which compute a module's output their own way) use it too.
  Tensor call_with_hooks(const Tensor& input, const std::function<Tensor()>& body);

 protected:

 private:
  struct Entry {
    std::string name;
    Tensor tensor;
    bool persistent = true;
  };
  void add_child(const std::string& name, Module* child, std::unique_ptr<Module> owned);
  void check_new_name(const std::string& name, const char* what) const;
  void collect(const std::string& prefix, bool recurse, bool buffers, bool only_persistent,
               NamedTensors& out) const;
  void convert_tensors(Device device, DType dtype, bool change_dtype);

  std::vector<Entry> params_;
  std::vector<Entry> buffers_;
  std::vector<std::pair<std::string, Module*>> children_;
  std::vector<std::unique_ptr<Module>> owned_children_;
  bool training_ = true;
  uint64_t next_hook_id_ = 1;
  std::vector<std::pair<uint64_t, ForwardPreHook>> forward_pre_hooks_;
  std::vector<std::pair<uint64_t, ForwardHook>> forward_hooks_;
  std::vector<std::pair<uint64_t, BackwardPreHook>> backward_pre_hooks_;
};

// An indexed list of owned modules; children are named "0", "1", ...
class ModuleList : public Module {
 public:
  template <class M>
  M& push_back(std::unique_ptr<M> m) {
    M& ref = register_module(std::to_string(items_.size()), std::move(m));
    items_.push_back(&ref);
    return ref;
  }
  Module& operator[](size_t i) const { return *items_.at(i); }
  size_t size() const { return items_.size(); }
  std::string type_name() const override { return "ModuleList"; }

 private:
  std::vector<Module*> items_;
};

}  // namespace tessera::nn
