// The tape: grad mode, graph nodes, the backward engine, gradient hooks and
// activation checkpointing.
//
// How a graph is built: a differentiable function (autograd/functions.h) computes
// its result with the tape-free ops:: and, when grad mode is on and an input
// requires grad, calls `record`, which creates one Node holding the backward
// closure and one edge per input (to the input's grad_fn, or to the
// AccumulateGrad node of a leaf). `backward` walks the nodes reachable from the
// roots in reverse order of creation, so for a sequential model the last layer's
// gradients are produced (and its leaves' grad-ready hooks fire) first.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tessera/core/tensor.h"

namespace tessera::autograd {

// ---- grad mode (thread-local) ----
bool is_grad_enabled();
void set_grad_enabled(bool on);

// Disables recording in this scope (restores the previous mode on exit).
class NoGradGuard {
 public:
  NoGradGuard() : previous_(is_grad_enabled()) { set_grad_enabled(false); }
  ~NoGradGuard() { set_grad_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// Sets grad mode to `on` in this scope (checkpoint's recompute uses it).
class GradModeGuard {
 public:
  explicit GradModeGuard(bool on) : previous_(is_grad_enabled()) { set_grad_enabled(on); }
  ~GradModeGuard() { set_grad_enabled(previous_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool previous_;
};

// ---- hooks ----
// Returned by the register_* functions; remove() unregisters (idempotent). Letting the
// handle go out of scope does NOT remove the hook.
class HookHandle {
 public:
  HookHandle() = default;
  explicit HookHandle(std::function<void()> remover) : remover_(std::move(remover)) {}
  void remove();

 private:
  std::function<void()> remover_;
};

// Called with the gradient flowing into `t` (for a leaf: before it is accumulated);
// a defined return value replaces that gradient, an undefined one keeps it.
// Registered on a non-leaf, it runs before the backward of the op that produced
// `t` (nn::Module uses this for its before-backward hook).
using GradHook = std::function<Tensor(const Tensor& grad)>;
HookHandle register_hook(const Tensor& t, GradHook hook);

// Called once per backward when the LEAF's .grad holds all contributions of that
// backward, as soon as the last one is accumulated and while the rest of backward
// still runs (DDP launches a bucket's all-reduce from here). A leaf the backward
// does not reach gets no call. Limitation: a leaf used both inside a checkpoint()
// region and outside it is reported once per region.
using GradReadyHook = std::function<void(const Tensor& leaf)>;
HookHandle register_grad_ready_hook(const Tensor& leaf, GradReadyHook hook);

// ---- graph nodes ----
struct Node;

// Where the gradient of an op's input goes: output `output_nr` of `node`.
struct Edge {
  std::shared_ptr<Node> node;
  int output_nr = 0;
  bool valid() const { return node != nullptr; }
};

// Memory a backward may write one input's gradient into instead of allocating it (the
// engine offers it; see BackwardArgs::destinations).
struct GradDestination {
  Tensor tensor;  // undefined: none offered
  // false: overwrite it; true: it already holds a partial gradient, add into it.
  bool accumulate = false;
};

// What the backward closure gets.
struct BackwardArgs {
  std::vector<Tensor> grad_outputs;    // one per output; zeros where no gradient flowed
  std::vector<bool> needs_input_grad;  // one per input
  // The backward keeps the graph (retain_graph): this node may run again, so what it saved
  // must not be changed in place.
  bool retain_graph = false;
  // One per input, or empty when none is offered. A backward may ignore a destination; if it
  // uses one it returns that very tensor (same TensorImpl) as the input's gradient, having
  // overwritten it (accumulate = false) or added into it (accumulate = true). The tensor has
  // the input's shape and dtype but may be a view (the layout a transpose or reshape of a
  // leaf maps the leaf's destination to): check its strides before writing a layout into it.
  std::vector<GradDestination> destinations;
  const Tensor& grad() const { return grad_outputs.at(0); }
  bool needs(size_t input) const { return needs_input_grad.at(input); }
  // The destination offered for `input`; nullptr when none.
  const GradDestination* destination(size_t input) const {
    return input < destinations.size() && destinations[input].tensor.defined()
               ? &destinations[input]
               : nullptr;
  }
};
// Returns one gradient per input (undefined where not needed). A gradient may come
// back in a different dtype: the engine converts it to the input's dtype.
using BackwardFn = std::function<std::vector<Tensor>(const BackwardArgs&)>;

// Shape, dtype and device of a tensor, kept without keeping its memory.
struct TensorGeometry {
  Shape shape;
  DType dtype = DType::f32;
  Device device = Device::cpu();
  static TensorGeometry of(const Tensor& t) { return {t.shape(), t.dtype(), t.device()}; }
};

struct Node {
  std::string name;                     // e.g. "MatmulBackward"
  uint64_t sequence_nr = 0;             // creation order; later nodes run first in backward
  std::vector<Edge> next_edges;         // one per input
  std::vector<TensorGeometry> outputs;  // one per output
  BackwardFn backward;                  // reset after a backward without retain_graph
  bool released = false;
  // The backward takes an undefined gradient for an output nothing used (and no hook
  // watches) instead of a tensor of zeros the engine would fill for it.
  bool takes_undefined_grads = false;
  // Hooks on the outputs of this node (non-leaf tensor hooks), by output index; empty until
  // the first hook is registered.
  std::vector<std::vector<std::pair<uint64_t, GradHook>>> output_hooks;
  // Set only for the AccumulateGrad node of a leaf: the leaf whose .grad it fills.
  std::shared_ptr<TensorImpl> leaf;
  // Set only for a view node that re-lays its input out without copying (transpose, permute,
  // reshape): the forward view applied to a tensor of the input's geometry. A leaf's gradient
  // destination reaches the producer of this node's output gradient as this view of it.
  std::function<Tensor(const Tensor& input_like)> destination_view;
  bool is_accumulate_grad() const { return leaf != nullptr; }
};

// The autograd state of one tensor (TensorImpl::autograd).
struct AutogradMeta {
  Tensor grad;
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  int output_nr = 0;
  bool is_view = false;  // made by a differentiable view op from a tensor in a graph
  // For a view: the tensor it is (ultimately) a view of, whose history an in-place write
  // into the view rewrites (see rebase_view_history).
  std::shared_ptr<TensorImpl> view_base;
  std::weak_ptr<Node> accumulate_grad;  // a leaf's AccumulateGrad node, while a graph uses it
  std::vector<std::pair<uint64_t, GradHook>> hooks;             // leaves only
  std::vector<std::pair<uint64_t, GradReadyHook>> ready_hooks;  // leaves only
  // Leaves only: where the gradient is written when .grad is undefined at the start of its
  // accumulation (set_grad_destination).
  Tensor grad_destination;
  // The backward whose partial gradient the destination holds (an overwrite offer was used),
  // until that backward accumulates it; null otherwise.
  const void* destination_claimed_by = nullptr;
};

// "shape [2, 3], float32, cpu": how error messages name a tensor.
std::string describe(const Tensor& t);

// The meta of t, created when missing.
AutogradMeta& meta_of(const Tensor& t);
// The edge that t's gradient flows along (invalid when t does not require grad).
Edge gradient_edge(const Tensor& t);

// True when recording is on and any input requires grad.
bool any_requires_grad(const std::vector<Tensor>& inputs);

// Creates the backward node of an op and makes it the grad_fn of `outputs` (which
// then require grad). Does nothing unless grad mode is on and some input requires grad
// (or `force` is set: checkpoint's outputs depend on parameters it cannot see).
// Undefined inputs are allowed (no edge). Returns the node (null when nothing was recorded).
std::shared_ptr<Node> record(const char* name, const std::vector<Tensor>& inputs,
                             const std::vector<Tensor>& outputs, BackwardFn backward,
                             bool force = false);

// Marks `view` (sharing memory with `input`) as a differentiable view of input's base.
void mark_view(const Tensor& view, const Tensor& input);

// After an in-place op recorded on `view` (a view of a graph tensor), rewrites its base's
// history as PyTorch's CopySlices does: the base's new value is its old one with the view's
// region replaced, and the view becomes a view of that new base again. Raises, naming `op`,
// where this cannot be done (a base that is a leaf requiring grad, or not contiguous).
void rebase_view_history(const char* op, const Tensor& view);
// True when t is a view whose base (or t) is part of a graph (in-place writes must rebase).
bool is_graph_view(const Tensor& t);
// Raises before an in-place write into a graph view that rebase_view_history would refuse.
void check_view_write_allowed(const char* op, const Tensor& view);

// A tensor saved for backward with the version it had; unpack() raises if it was
// modified in place since. save_output() keeps an op's own output without keeping
// its autograd state alive (that would be a reference cycle through grad_fn).
class SavedTensor {
 public:
  SavedTensor() = default;
  static SavedTensor input(const Tensor& t);
  static SavedTensor output(const Tensor& t);
  // `op` names the node in the error message.
  Tensor unpack(const char* op) const;

 private:
  Tensor data_;                      // the saved values (an alias for outputs)
  std::weak_ptr<TensorImpl> owner_;  // whose version counter to check
  uint64_t version_ = 0;
};

// ---- running backward ----
// Computes the gradients of `roots` (scalar roots may omit their gradient) and
// accumulates them into the .grad of the leaves. Without retain_graph the graph's
// saved tensors are freed; a second backward through it raises, naming the node.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots = {},
              bool retain_graph = false);

// Where a leaf's gradient may be written when its .grad is undefined at the start of its
// accumulation (FlatBuckets: the parameter's view of the bucket). Must be contiguous, of the
// leaf's shape, dtype, device; an undefined tensor clears it. The backward then writes the
// leaf's first gradient straight into it (the weight GEMMs of linear and matmul do) or copies
// it there, and .grad becomes this tensor; a later backward with .grad undefined (zero_grad
// with set_to_none) overwrites it, so a .grad kept from an earlier step changes too.
// Not while a backward holds a partial gradient in the old destination.
void set_grad_destination(const Tensor& leaf, Tensor destination);
// The leaf's destination (undefined when none).
Tensor grad_destination(const Tensor& leaf);

// How leaves' first gradients reached their destinations (this process, since it started):
// `written`: a backward wrote the gradient there (no copy, no add); `copied`: the engine
// copied a gradient computed elsewhere into it.
struct GradDestinationCounts {
  int64_t written = 0;
  int64_t copied = 0;
};
GradDestinationCounts grad_destination_counts();

// Sets each tensor's .grad to undefined (set_to_none) or to zero in place.
void zero_grad(const std::vector<Tensor>& tensors, bool set_to_none = true);

// ---- activation checkpointing ----
// Runs fn(inputs) without saving activations (grad mode off) and, in backward,
// runs it again with grad mode on (the default Generator's state restored to what
// it was at the first run, so dropout draws the same mask) and backpropagates
// through the recomputed graph. Gradients equal those of a plain run bit for bit.
using CheckpointFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
std::vector<Tensor> checkpoint(CheckpointFn fn, const std::vector<Tensor>& inputs);

}  // namespace tessera::autograd
