#include "tessera/nn/module.h"
#include "tessera/kernels/ops.h"

#include <algorithm>
#include <set>
#include <sstream>

#include "tessera/autograd/autograd.h"
#include "tessera/core/deferred_init.h"

namespace tessera::nn {

namespace {

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

// Points `target`'s TensorImpl at `source`'s memory and layout (same identity, new data).
void repoint(const Tensor& target, const Tensor& source) {
  TensorImpl& impl = target.impl();
  impl.storage = source.storage();
  impl.shape = source.shape();
  impl.strides = source.strides();
  impl.offset = source.offset();
  impl.dtype = source.dtype();
  impl.version++;
}

}  // namespace

Tensor Module::operator()(const Tensor& x) {
  return call_with_hooks(x, [&] { return forward(x); });
}

Tensor Module::forward(const Tensor&) {
  TESSERA_FAIL(type_name(), ": this module has no one-tensor forward()");
}

Tensor Module::call_with_hooks(const Tensor& input, const std::function<Tensor()>& body) {
  for (auto& [id, hook] : forward_pre_hooks_) hook(*this, input);
  // A placeholder of sharded construction (core/deferred_init.h) holds no values: refused
  // by name here instead of read out of bounds by a kernel. One atomic load when none lives.
  if (any_deferred())
    for (const auto& [name, p] : named_parameters()) check_not_deferred(p, name, type_name());
  Tensor output = body();
  for (auto& [id, hook] : forward_hooks_) hook(*this, input, output);
  // An identity call (Dropout off returns its input) has no backward of its own.
  if (!backward_pre_hooks_.empty() && output.defined() && output.requires_grad() &&
      !output.is_leaf() && !output.is_same(input)) {
    // Fires when the output's gradient arrives, before the ops of this module run backward.
    autograd::register_hook(output, [this](const Tensor&) {
      for (auto& [id, hook] : backward_pre_hooks_) hook(*this);
      return Tensor();
    });
  }
  return output;
}

void Module::check_new_name(const std::string& name, const char* what) const {
  TESSERA_CHECK(!name.empty() && name.find('.') == std::string::npos, type_name(), ": ", what,
                " name '", name, "' must be non-empty and contain no '.'");
  auto taken = [&](const auto& list) {
    return std::any_of(list.begin(), list.end(), [&](const auto& e) {
      if constexpr (std::is_same_v<std::decay_t<decltype(e)>, Entry>)
        return e.name == name;
      else
        return e.first == name;
    });
  };
  TESSERA_CHECK(!taken(params_) && !taken(buffers_) && !taken(children_), type_name(),
                ": cannot register ", what, " '", name, "': the name is already used");
}

Tensor Module::register_parameter(const std::string& name, const Tensor& t, bool requires_grad) {
  check_new_name(name, "parameter");
  TESSERA_CHECK(t.defined(), type_name(), ": parameter '", name, "' is undefined");
  TESSERA_CHECK(is_floating(t.dtype()), type_name(), ": parameter '", name, "' has dtype ",
                dtype_name(t.dtype()), "; parameters must be floating point");
  Tensor p = t;
  if (!p.is_leaf()) p = t.detach();  // parameters are leaves of every graph
  p.requires_grad_(requires_grad);
  params_.push_back({name, p, true});
  return p;
}

Tensor Module::register_buffer(const std::string& name, const Tensor& t, bool persistent) {
  check_new_name(name, "buffer");
  TESSERA_CHECK(t.defined(), type_name(), ": buffer '", name, "' is undefined");
  buffers_.push_back({name, t, persistent});
  return t;
}

void Module::add_child(const std::string& name, Module* child, std::unique_ptr<Module> owned) {
  check_new_name(name, "module");
  TESSERA_CHECK(child != this, type_name(), ": a module cannot be its own child ('", name, "')");
  children_.emplace_back(name, child);
  if (owned) owned_children_.push_back(std::move(owned));
}

void Module::collect(const std::string& prefix, bool recurse, bool buffers, bool only_persistent,
                     NamedTensors& out) const {
  for (const auto& e : buffers ? buffers_ : params_) {
    if (only_persistent && !e.persistent) continue;
    out.emplace_back(join(prefix, e.name), e.tensor);
  }
  if (!recurse) return;
  for (const auto& [name, child] : children_)
    child->collect(join(prefix, name), true, buffers, only_persistent, out);
}

static NamedTensors unique_tensors(NamedTensors all) {
  std::set<const TensorImpl*> seen;
  NamedTensors out;
  for (auto& [name, t] : all)
    if (seen.insert(t.impl_ptr().get()).second) out.emplace_back(std::move(name), std::move(t));
  return out;
}

NamedTensors Module::named_parameters(bool recurse) const {
  NamedTensors all;
  collect("", recurse, false, false, all);
  return unique_tensors(std::move(all));
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters(recurse)) out.push_back(t);
  return out;
}

NamedTensors Module::named_buffers(bool recurse) const {
  NamedTensors all;
  collect("", recurse, true, false, all);
  return unique_tensors(std::move(all));
}

std::vector<std::pair<std::string, Module*>> Module::named_children() const { return children_; }

std::vector<std::pair<std::string, Module*>> Module::named_modules() const {
  std::vector<std::pair<std::string, Module*>> out{{"", const_cast<Module*>(this)}};
  for (const auto& [name, child] : children_)
    for (auto& [sub, m] : child->named_modules()) out.emplace_back(join(name, sub), m);
  return out;
}

Tensor Module::parameter(const std::string& name) const {
  for (auto& [n, t] : named_parameters())
    if (n == name) return t;
  TESSERA_FAIL(type_name(), ": no parameter named '", name, "'");
}

int64_t Module::num_parameters(bool only_trainable) const {
  int64_t n = 0;
  for (auto& [name, t] : named_parameters())
    if (!only_trainable || t.requires_grad()) n += t.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, child] : children_) child->train(on);
}

NamedTensors Module::state_dict() const {
  NamedTensors all;
  collect("", true, false, false, all);
  collect("", true, true, true, all);
  NamedTensors out;
  for (auto& [name, t] : all) out.emplace_back(name, t.detach());
  return out;
}

LoadStateDictResult Module::load_state_dict(const std::map<std::string, Tensor>& state,
                                            const LoadStateDictOptions& opts) {
  NamedTensors mine;
  collect("", true, false, false, mine);
  collect("", true, true, true, mine);
  LoadStateDictResult result;
  std::vector<std::string> mismatches;
  std::set<std::string> known;
  for (const auto& [name, t] : mine) {
    known.insert(name);
    auto it = state.find(name);
    if (it == state.end()) {
      result.missing_keys.push_back(name);
    } else if (it->second.shape() != t.shape()) {
      mismatches.push_back(name + ": checkpoint " + shape_str(it->second.shape()) + " vs model " +
                           shape_str(t.shape()));
    }
  }
  for (const auto& [name, t] : state)
    if (!known.count(name) && !(opts.ignore && opts.ignore(name)))
      result.unexpected_keys.push_back(name);

  auto list = [](const std::vector<std::string>& v) {
    std::ostringstream os;
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
    return os.str();
  };
  // Shape mismatches are always fatal: there is nothing sensible to copy.
  const bool fail =
      !mismatches.empty() ||
      (opts.strict && (!result.missing_keys.empty() || !result.unexpected_keys.empty()));
  if (fail) {
    std::ostringstream msg;
    msg << type_name() << "::load_state_dict: state dict does not match the model.";
    if (!result.missing_keys.empty()) msg << "\n  missing keys: " << list(result.missing_keys);
    if (!result.unexpected_keys.empty())
      msg << "\n  unexpected keys: " << list(result.unexpected_keys);
    if (!mismatches.empty()) msg << "\n  shape mismatches: " << list(mismatches);
    TESSERA_FAIL(msg.str());
  }
  autograd::NoGradGuard no_grad;
  for (const auto& [name, t] : mine) {
    auto it = state.find(name);
    if (it == state.end() || it->second.is_same(t)) continue;
    // A placeholder keeps the source as its future value: a sharded strategy then copies
    // only the slice a rank keeps (for a memory-mapped file: only those pages are read).
    if (is_deferred(t)) {
      set_deferred_source(t, it->second);
      continue;
    }
    ops::copy_(t, it->second.device() == t.device()
                      ? it->second
                      : ops::to(it->second, t.device(), it->second.dtype()));
    t.impl().version++;
  }
  return result;
}

void Module::convert_tensors(Device device, DType dtype, bool change_dtype) {
  NamedTensors all;
  collect("", true, false, false, all);
  collect("", true, true, false, all);
  std::set<const TensorImpl*> done;  // tied tensors appear under several names
  for (auto& [name, t] : all) {
    if (!done.insert(t.impl_ptr().get()).second) continue;
    const DType target = change_dtype && is_floating(t.dtype()) ? dtype : t.dtype();
    if (t.device() == device && t.dtype() == target) continue;
    t.set_grad(Tensor());
    if (is_deferred(t)) {  // still no values: only what they will be converted to
      retarget_deferred(t, device, target);
      continue;
    }
    repoint(t, ops::contiguous(ops::to(t, device, target)));
  }
}

Module& Module::to(Device device) {
  convert_tensors(device, DType::f32, false);
  return *this;
}

Module& Module::to(DType dtype) {
  TESSERA_CHECK(is_floating(dtype), type_name(), "::to: target dtype ", dtype_name(dtype),
                " is not floating point");
  NamedTensors all;
  collect("", true, false, false, all);
  const Device device = all.empty() ? Device::cpu() : all.front().second.device();
  convert_tensors(device, dtype, true);
  return *this;
}

Module& Module::to(Device device, DType dtype) {
  TESSERA_CHECK(is_floating(dtype), type_name(), "::to: target dtype ", dtype_name(dtype),
                " is not floating point");
  convert_tensors(device, dtype, true);
  return *this;
}

void Module::zero_grad(bool set_to_none) { autograd::zero_grad(parameters(), set_to_none); }

bool Module::any_hooks() const {
  if (has_hooks()) return true;
  for (const auto& [name, child] : children_)
    if (child->any_hooks()) return true;
  return false;
}

uint64_t Module::register_forward_pre_hook(ForwardPreHook hook) {
  forward_pre_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

uint64_t Module::register_forward_hook(ForwardHook hook) {
  forward_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

uint64_t Module::register_backward_pre_hook(BackwardPreHook hook) {
  backward_pre_hooks_.emplace_back(next_hook_id_, std::move(hook));
  return next_hook_id_++;
}

void Module::remove_hook(uint64_t id) {
  auto drop = [id](auto& list) {
    std::erase_if(list, [id](const auto& e) { return e.first == id; });
  };
  drop(forward_pre_hooks_);
  drop(forward_hooks_);
  drop(backward_pre_hooks_);
}

}  // namespace tessera::nn
