// Grad mode, node recording, saved tensors, hooks and the backward engine.
#include <algorithm>
#include <atomic>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "tessera/autograd/autograd.h"
#include "tessera/kernels/ops.h"

namespace tessera::autograd {

namespace {
thread_local bool grad_enabled = true;
std::atomic<uint64_t> next_sequence_nr{1};
std::atomic<uint64_t> next_hook_id{1};

// Deletes a node once nothing refers to it. Left to ~Node, the last reference to a node
// destroyed its inputs' nodes, and theirs, recursively: a graph of 200,000 ops overflowed the
// stack when it was let go. Instead this takes over the edges of each node it holds the last
// reference to and drops that node's closures (whose captured tensors may hold the same
// input nodes, which `pending` still holds) before the node goes, so every node of a chain
// is deleted from this one loop. PyTorch's deleteNode does the same.
void delete_node(Node* first) {
  std::vector<std::shared_ptr<Node>> pending;
  const auto take_over = [&pending](Node& node) {
    for (Edge& edge : node.next_edges)
      if (edge.node) pending.push_back(std::move(edge.node));
    node.backward = nullptr;
    node.output_hooks.clear();
  };
  take_over(*first);
  delete first;
  while (!pending.empty()) {
    std::shared_ptr<Node> node = std::move(pending.back());
    pending.pop_back();
    if (node.use_count() == 1) take_over(*node);
  }  // the last reference goes here: back into delete_node, with nothing left to take over
}

std::shared_ptr<Node> new_node() { return std::shared_ptr<Node>(new Node(), delete_node); }

// Erases the entry with `id` from a vector of (id, hook) pairs.
template <class Hook>
void erase_hook(std::vector<std::pair<uint64_t, Hook>>& hooks, uint64_t id) {
  std::erase_if(hooks, [id](const auto& entry) { return entry.first == id; });
}
}  // namespace

std::string describe(const Tensor& t) {
  return detail::concat("shape ", shape_str(t.shape()), ", ", dtype_name(t.dtype()), ", ",
                        t.device().str());
}

bool is_grad_enabled() { return grad_enabled; }
void set_grad_enabled(bool on) { grad_enabled = on; }

void HookHandle::remove() {
  if (!remover_) return;
  auto remover = std::move(remover_);
  remover_ = nullptr;
  remover();
}

AutogradMeta& meta_of(const Tensor& t) {
  auto& slot = t.impl().autograd;
  if (!slot) slot = std::make_shared<AutogradMeta>();
  return *slot;
}

static AutogradMeta* meta_if_any(const Tensor& t) {
  return t.defined() ? t.impl().autograd.get() : nullptr;
}

Edge gradient_edge(const Tensor& t) {
  AutogradMeta* meta = meta_if_any(t);
  if (meta == nullptr) return {};
  if (meta->grad_fn) return {meta->grad_fn, meta->output_nr};
  if (!meta->requires_grad) return {};
  // A leaf: its AccumulateGrad node is shared by every graph alive at the same time,
  // so one backward sees all of the leaf's uses and knows when its gradient is final.
  std::shared_ptr<Node> node = meta->accumulate_grad.lock();
  if (!node) {
    node = new_node();
    node->name = "AccumulateGrad";
    node->sequence_nr = next_sequence_nr++;
    node->outputs = {TensorGeometry::of(t)};
    node->leaf = t.impl_ptr();
    meta->accumulate_grad = node;
  }
  return {node, 0};
}

bool any_requires_grad(const std::vector<Tensor>& inputs) {
  if (!grad_enabled) return false;
  return std::any_of(inputs.begin(), inputs.end(),
                     [](const Tensor& t) { return t.defined() && t.requires_grad(); });
}

std::shared_ptr<Node> record(const char* name, const std::vector<Tensor>& inputs,
                             const std::vector<Tensor>& outputs, BackwardFn backward, bool force) {
  if (!grad_enabled) return nullptr;
  if (!force && !any_requires_grad(inputs)) return nullptr;
  auto node = new_node();
  node->name = name;
  node->sequence_nr = next_sequence_nr++;
  node->backward = std::move(backward);
  node->next_edges.reserve(inputs.size());
  for (const Tensor& input : inputs) node->next_edges.push_back(gradient_edge(input));
  node->outputs.reserve(outputs.size());
  for (const Tensor& output : outputs) node->outputs.push_back(TensorGeometry::of(output));
  for (size_t i = 0; i < outputs.size(); ++i) {
    // Integer outputs (indices, masks) carry no gradient.
    if (!is_floating(outputs[i].dtype())) continue;
    AutogradMeta& meta = meta_of(outputs[i]);
    meta.grad_fn = node;
    meta.output_nr = static_cast<int>(i);
    meta.requires_grad = true;
  }
  return node;
}

// ---- saved tensors ----

SavedTensor SavedTensor::input(const Tensor& t) {
  SavedTensor saved;
  if (!t.defined()) return saved;
  saved.data_ = t;
  saved.owner_ = t.impl_ptr();
  saved.version_ = t.impl().version;
  return saved;
}

SavedTensor SavedTensor::output(const Tensor& t) {
  SavedTensor saved;
  if (!t.defined()) return saved;
  saved.data_ = ops::alias(t);
  saved.owner_ = t.impl_ptr();
  saved.version_ = t.impl().version;
  return saved;
}

Tensor SavedTensor::unpack(const char* op) const {
  if (!data_.defined()) return data_;
  // An output that nobody holds any more cannot have been written in place.
  if (auto owner = owner_.lock()) {
    TESSERA_CHECK(owner->version == version_, op, ": a tensor saved for backward (",
                  describe(data_), ") was modified by an in-place operation: it was at version ",
                  version_, " and is now at version ", owner->version,
                  "; clone it before modifying it");
  }
  return data_;
}

// ---- hooks ----

HookHandle register_hook(const Tensor& t, GradHook hook) {
  TESSERA_CHECK(t.requires_grad(), "register_hook: the tensor (", describe(t),
                ") does not require grad");
  const uint64_t id = next_hook_id++;
  AutogradMeta& meta = meta_of(t);
  if (meta.grad_fn) {
    std::weak_ptr<Node> weak_node = meta.grad_fn;
    const int output_nr = meta.output_nr;
    // Sized on the first hook: most nodes never get one, and recording stays allocation-free.
    auto& node_hooks = meta.grad_fn->output_hooks;
    if (node_hooks.empty()) node_hooks.resize(meta.grad_fn->outputs.size());
    node_hooks.at(output_nr).emplace_back(id, std::move(hook));
    return HookHandle([weak_node, output_nr, id] {
      if (auto node = weak_node.lock()) erase_hook(node->output_hooks[output_nr], id);
    });
  }
  meta.hooks.emplace_back(id, std::move(hook));
  std::weak_ptr<AutogradMeta> weak_meta = t.impl().autograd;
  return HookHandle([weak_meta, id] {
    if (auto m = weak_meta.lock()) erase_hook(m->hooks, id);
  });
}

HookHandle register_grad_ready_hook(const Tensor& leaf, GradReadyHook hook) {
  TESSERA_CHECK(leaf.requires_grad() && leaf.is_leaf(),
                "register_grad_ready_hook: expected a leaf tensor that requires grad, got ",
                leaf.is_leaf() ? "a leaf that does not require grad" : "a non-leaf tensor", " (",
                describe(leaf), ")");
  const uint64_t id = next_hook_id++;
  AutogradMeta& meta = meta_of(leaf);
  meta.ready_hooks.emplace_back(id, std::move(hook));
  std::weak_ptr<AutogradMeta> weak_meta = leaf.impl().autograd;
  return HookHandle([weak_meta, id] {
    if (auto m = weak_meta.lock()) erase_hook(m->ready_hooks, id);
  });
}

// ---- the engine ----

namespace {

// Applies hooks (by copy: a hook may remove itself) to a gradient.
Tensor apply_hooks(std::vector<std::pair<uint64_t, GradHook>> hooks, Tensor grad) {
  for (auto& [id, hook] : hooks) {
    Tensor replaced = hook(grad);
    if (replaced.defined()) grad = replaced;
  }
  return grad;
}

std::atomic<int64_t> destination_written{0};
std::atomic<int64_t> destination_copied{0};

// True when nothing but the one reference to t refers to its memory: it may be changed in place.
bool is_private(const Tensor& t) {
  return t.impl_ptr().use_count() == 1 && t.storage().use_count() == 1 && !t.requires_grad();
}

// True when a and b are the same elements: one storage, offset, shape, strides and dtype.
bool same_memory(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.storage() == b.storage() && a.offset() == b.offset() &&
         a.shape() == b.shape() && a.strides() == b.strides() && a.dtype() == b.dtype();
}

// True when nothing but `grad` itself refers to its memory and that memory is exactly a
// contiguous tensor of the leaf's geometry: then it can become the leaf's .grad as it is.
bool can_adopt_as_grad(const Tensor& grad, const Tensor& leaf) {
  return is_private(grad) && grad.is_contiguous() && grad.impl().offset == 0 &&
         grad.storage()->nbytes() == grad.nbytes() && grad.shape() == leaf.shape() &&
         grad.dtype() == leaf.dtype() && grad.device() == leaf.device();
}

// The first gradient of a leaf whose .grad is undefined becomes its .grad: where the leaf has a
// destination, in it (as written there by a backward, else copied); otherwise as it is when
// nothing else refers to it (a weight's GEMM output, say: PyTorch's AccumulateGrad steals it
// too), else as a fresh copy (it may alias memory other nodes still read).
void set_first_gradient(AutogradMeta& meta, const Tensor& leaf, Tensor grad) {
  const Tensor& destination = meta.grad_destination;
  if (destination.defined()) {
    if (same_memory(grad, destination)) {
      ++destination_written;
    } else {
      ops::copy_(destination, grad);
      ++destination_copied;
    }
    meta.grad = destination;
  } else if (can_adopt_as_grad(grad, leaf)) {
    meta.grad = std::move(grad);
  } else {
    Tensor fresh = empty(leaf.shape(), {.dtype = leaf.dtype(), .device = leaf.device()});
    ops::copy_(fresh, grad);
    meta.grad = fresh;
  }
}

// Adds `grad` into the leaf's .grad (in place when one exists, so gradients that live
// as views of a flat bucket stay there), then reports the leaf's gradient as final.
// `task` is the backward running this: a destination another (outer) backward claimed holds
// that backward's partial gradient, which must survive.
void accumulate_into_leaf(Node& node, Tensor grad, const void* task) {
  Tensor leaf(node.leaf);
  AutogradMeta& meta = meta_of(leaf);
  if (grad.defined()) grad = apply_hooks(meta.hooks, grad);
  const bool claimed_by_outer =
      meta.destination_claimed_by != nullptr && meta.destination_claimed_by != task;
  if (meta.destination_claimed_by == task) meta.destination_claimed_by = nullptr;
  if (grad.defined()) {
    if (!meta.grad.defined() && claimed_by_outer) {
      // A nested backward (a checkpoint's recompute) reaches the leaf while the backward
      // around it keeps a partial gradient in the destination: added there, both survive, and
      // the outer backward finds its part already in .grad (below).
      meta.grad = meta.grad_destination;
      ops::binary_(BinaryOp::Add, meta.grad, grad);
    } else if (!meta.grad.defined()) {
      set_first_gradient(meta, leaf, std::move(grad));
    } else if (same_memory(grad, meta.grad_destination) &&
               same_memory(meta.grad, meta.grad_destination)) {
      // Already in .grad: a nested backward made the destination .grad while this part was
      // in it.
    } else {
      TESSERA_CHECK(meta.grad.shape() == leaf.shape(), "backward: the .grad of a leaf (",
                    describe(leaf), ") has shape ", shape_str(meta.grad.shape()));
      ops::binary_(BinaryOp::Add, meta.grad, grad);
    }
  }
  auto ready_hooks = meta.ready_hooks;
  for (auto& [id, hook] : ready_hooks) hook(leaf);
}

// A destination offered to a backward for one input; `leaf` is set when it is (a view of) that
// leaf's own destination offered for overwriting.
struct Offer {
  GradDestination destination;
  std::shared_ptr<TensorImpl> leaf;
  bool defined() const { return destination.tensor.defined(); }
};

struct LaterFirst {
  bool operator()(const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) const {
    return a->sequence_nr < b->sequence_nr;
  }
};

class GraphTask {
 public:
  explicit GraphTask(bool retain_graph) : retain_graph_(retain_graph) {}
  GraphTask(const GraphTask&) = delete;
  GraphTask& operator=(const GraphTask&) = delete;
  ~GraphTask() {
    // A backward that failed may leave claims: their destinations are free again.
    for (const auto& leaf : claimed_leaves_) {
      AutogradMeta* meta = leaf->autograd.get();
      if (meta != nullptr && meta->destination_claimed_by == this)
        meta->destination_claimed_by = nullptr;
    }
  }

  void add_root(const Edge& edge, const Tensor& grad) {
    roots_.push_back(edge.node);
    add_gradient(edge, grad, "backward");
  }

  void run() {
    count_dependencies();
    buffers_.reserve(dependencies_.size() + roots_.size());
    std::unordered_set<Node*> queued;
    for (const auto& root : roots_) {
      if (dependencies_[root.get()] == 0 && queued.insert(root.get()).second) ready_.push(root);
    }
    while (!ready_.empty()) {
      std::shared_ptr<Node> node = ready_.top();
      ready_.pop();
      execute(node);
    }
  }

 private:
  void count_dependencies() {
    std::unordered_set<Node*> seen;
    std::vector<Node*> stack;
    for (const auto& root : roots_) {
      if (seen.insert(root.get()).second) stack.push_back(root.get());
    }
    while (!stack.empty()) {
      Node* node = stack.back();
      stack.pop_back();
      for (const Edge& edge : node->next_edges) {
        if (!edge.valid()) continue;
        ++dependencies_[edge.node.get()];
        if (seen.insert(edge.node.get()).second) stack.push_back(edge.node.get());
      }
    }
  }

  // Sums a gradient into the input buffer of edge.node; `from` names the producer.
  // `added_in_place`: grad is the partial gradient of this buffer slot, offered to the
  // backward for accumulating, which added into it.
  void add_gradient(const Edge& edge, Tensor grad, const std::string& from,
                    bool added_in_place = false) {
    const TensorGeometry& want = edge.node->outputs.at(edge.output_nr);
    TESSERA_CHECK(grad.shape() == want.shape, from, ": produced a gradient of shape ",
                  shape_str(grad.shape()), " for ", edge.node->name, " whose output has shape ",
                  shape_str(want.shape));
    TESSERA_CHECK(grad.device() == want.device, from, ": produced a gradient on ",
                  grad.device().str(), " for a tensor on ", want.device.str());
    if (grad.dtype() != want.dtype) grad = ops::to(grad, want.device, want.dtype);
    auto& buffer = buffers_[edge.node.get()];
    buffer.resize(edge.node->outputs.size());
    Tensor& slot = buffer[edge.output_nr];
    if (!slot.defined()) {
      slot = std::move(grad);
    } else if (added_in_place && grad.is_same(slot)) {
      // Already summed (x + x returns one tensor twice: that is not this case).
    } else if (holds_claimed_destination(*edge.node, grad)) {
      ops::binary_(BinaryOp::Add, grad, slot);  // the sum stays in the leaf's destination
      slot = std::move(grad);
    } else if ((is_private(slot) && slot.is_contiguous()) ||
               holds_claimed_destination(*edge.node, slot)) {
      ops::binary_(BinaryOp::Add, slot, grad);
    } else {
      slot = ops::add(slot, grad);
    }
  }

  // True when t is exactly the destination of node's leaf holding this backward's partial
  // gradient (so it may be added into although the leaf's meta refers to it too).
  bool holds_claimed_destination(const Node& node, const Tensor& t) const {
    if (!node.is_accumulate_grad()) return false;
    const AutogradMeta* meta = node.leaf->autograd.get();
    return meta != nullptr && meta->destination_claimed_by == this &&
           same_memory(t, meta->grad_destination);
  }

  // The partial gradient waiting in the input buffer of edge.node for this edge; null when
  // none arrived yet.
  const Tensor* partial_for(const Edge& edge) const {
    auto it = buffers_.find(edge.node.get());
    if (it == buffers_.end() || it->second.size() <= static_cast<size_t>(edge.output_nr))
      return nullptr;
    const Tensor& slot = it->second[edge.output_nr];
    return slot.defined() ? &slot : nullptr;
  }

  // What the producer of the gradient along `edge` may write into (see GradDestination).
  Offer offer_for(const Edge& edge) {
    Node& target = *edge.node;
    if (const Tensor* partial = partial_for(edge)) {
      if (partial->is_contiguous() &&
          (is_private(*partial) || holds_claimed_destination(target, *partial)))
        return {{*partial, /*accumulate=*/true}, nullptr};
      return {};
    }
    if (target.is_accumulate_grad()) {
      // Hooks may replace the gradient, and a defined .grad is added into (no_sync
      // accumulation, a second backward): then the backward computes it as before.
      const AutogradMeta* meta = target.leaf->autograd.get();
      if (meta != nullptr && meta->grad_destination.defined() && !meta->grad.defined() &&
          meta->hooks.empty() && meta->destination_claimed_by == nullptr)
        return {{meta->grad_destination, /*accumulate=*/false}, target.leaf};
      return {};
    }
    // A view of a leaf (a weight used as weight.t()) that gets only this gradient: the leaf's
    // destination seen through the view, so the view's backward hands on that memory.
    const bool hooked = std::any_of(target.output_hooks.begin(), target.output_hooks.end(),
                                    [](const auto& hooks) { return !hooks.empty(); });
    if (!target.destination_view || hooked || target.next_edges.size() != 1 ||
        !target.next_edges[0].valid() || target.outputs.size() != 1 || dependencies_[&target] != 1)
      return {};
    Offer inner = offer_for(target.next_edges[0]);
    if (inner.leaf == nullptr) return {};
    Tensor view = target.destination_view(inner.destination.tensor);
    if (!view.shares_storage(inner.destination.tensor) || view.shape() != target.outputs[0].shape)
      return {};
    return {{std::move(view), /*accumulate=*/false}, std::move(inner.leaf)};
  }

  // The destinations offered to node's backward, one per input (empty when none): at most one
  // input per leaf or buffer slot, so two inputs never write the same memory.
  std::vector<Offer> offers_for(const Node& node) {
    std::vector<Offer> offers;
    for (size_t i = 0; i < node.next_edges.size(); ++i) {
      const Edge& edge = node.next_edges[i];
      if (!edge.valid()) continue;
      Offer offer = offer_for(edge);
      if (!offer.defined()) continue;
      const bool taken = std::any_of(offers.begin(), offers.end(), [&](const Offer& o) {
        return (offer.leaf && o.leaf == offer.leaf) ||
               same_memory(o.destination.tensor, offer.destination.tensor);
      });
      if (taken) continue;
      if (offers.empty()) offers.resize(node.next_edges.size());
      offers[i] = std::move(offer);
    }
    return offers;
  }

  // After node's backward: a leaf whose destination a gradient was written into now holds this
  // backward's partial gradient there, which nothing else may overwrite until it is accumulated.
  void claim_used_destinations(const std::vector<Offer>& offers, const std::vector<Tensor>& grads) {
    for (size_t i = 0; i < offers.size() && i < grads.size(); ++i) {
      const Offer& offer = offers[i];
      if (offer.leaf == nullptr || !grads[i].is_same(offer.destination.tensor)) continue;
      meta_of(Tensor(offer.leaf)).destination_claimed_by = this;
      claimed_leaves_.push_back(offer.leaf);
    }
  }

  void execute(const std::shared_ptr<Node>& node) {
    std::vector<Tensor> grads = std::move(buffers_[node.get()]);
    buffers_.erase(node.get());
    grads.resize(node->outputs.size());
    if (node->is_accumulate_grad()) {
      accumulate_into_leaf(*node, std::move(grads[0]), this);
      return;
    }
    TESSERA_CHECK(!node->released && node->backward,
                  "backward: trying to backward through the graph a second time: ", node->name,
                  " already freed its saved tensors after the first backward; pass "
                  "retain_graph=true to the first backward");
    BackwardArgs args;
    for (size_t i = 0; i < grads.size(); ++i) {
      const TensorGeometry& out = node->outputs[i];
      const bool hooked = i < node->output_hooks.size() && !node->output_hooks[i].empty();
      if (!grads[i].defined() && (hooked || !node->takes_undefined_grads))
        grads[i] = zeros(out.shape, {.dtype = out.dtype, .device = out.device});
      if (hooked) grads[i] = apply_hooks(node->output_hooks[i], grads[i]);
    }
    args.grad_outputs = std::move(grads);
    args.retain_graph = retain_graph_;
    for (const Edge& edge : node->next_edges) args.needs_input_grad.push_back(edge.valid());
    std::vector<Offer> offers = offers_for(*node);
    for (const Offer& offer : offers) args.destinations.push_back(offer.destination);
    std::vector<Tensor> input_grads = node->backward(args);
    claim_used_destinations(offers, input_grads);
    std::vector<bool> added_in_place(input_grads.size(), false);
    for (size_t i = 0; i < offers.size() && i < input_grads.size(); ++i)
      added_in_place[i] =
          offers[i].destination.accumulate && input_grads[i].is_same(offers[i].destination.tensor);
    // Drop the incoming gradients and the offers now: a gradient that holds the only reference
    // to its memory can then be kept as the leaf's .grad without a copy (accumulate_into_leaf)
    // or added into in place (add_gradient).
    args.grad_outputs.clear();
    args.destinations.clear();
    offers.clear();
    TESSERA_CHECK(input_grads.size() == node->next_edges.size(), node->name, ": returned ",
                  input_grads.size(), " gradients for ", node->next_edges.size(), " inputs");
    if (!retain_graph_) {
      node->backward = nullptr;  // frees the saved tensors
      node->released = true;
    }
    for (size_t i = 0; i < input_grads.size(); ++i) {
      const Edge& edge = node->next_edges[i];
      if (!edge.valid()) continue;
      if (input_grads[i].defined())
        add_gradient(edge, std::move(input_grads[i]), node->name, added_in_place[i]);
      if (--dependencies_[edge.node.get()] > 0) continue;
      // A leaf's last contribution: accumulate now, so its grad-ready hooks fire as
      // early as possible rather than when the leaf's (old) sequence number comes up.
      if (edge.node->is_accumulate_grad()) {
        execute(edge.node);
      } else {
        ready_.push(edge.node);
      }
    }
  }

  bool retain_graph_;
  std::vector<std::shared_ptr<TensorImpl>> claimed_leaves_;
  std::vector<std::shared_ptr<Node>> roots_;
  std::unordered_map<Node*, int> dependencies_;
  std::unordered_map<Node*, std::vector<Tensor>> buffers_;
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, LaterFirst> ready_;
};

}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grad_roots,
              bool retain_graph) {
  TESSERA_CHECK(!roots.empty(), "backward: no tensors given");
  TESSERA_CHECK(grad_roots.empty() || grad_roots.size() == roots.size(), "backward: ", roots.size(),
                " tensors but ", grad_roots.size(), " gradients");
  NoGradGuard no_grad;  // backward closures are tape-free
  GraphTask task(retain_graph);
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& root = roots[i];
    TESSERA_CHECK(root.defined(), "backward: undefined tensor");
    TESSERA_CHECK(root.requires_grad(), "backward: the tensor (", describe(root),
                  ") does not require grad and has no grad_fn");
    Tensor grad = grad_roots.empty() ? Tensor() : grad_roots[i];
    if (!grad.defined()) {
      TESSERA_CHECK(root.numel() == 1,
                    "backward: a gradient can be created implicitly only for a scalar output, "
                    "but the tensor has shape ",
                    shape_str(root.shape()), "; pass a gradient of that shape");
      grad = ones(root.shape(), {.dtype = root.dtype(), .device = root.device()});
    }
    TESSERA_CHECK(grad.shape() == root.shape(), "backward: gradient of shape ",
                  shape_str(grad.shape()), " given for a tensor of shape ",
                  shape_str(root.shape()));
    task.add_root(gradient_edge(root), grad);
  }
  task.run();
}

void set_grad_destination(const Tensor& leaf, Tensor destination) {
  TESSERA_CHECK(leaf.defined() && leaf.is_leaf(),
                "set_grad_destination: expected a leaf tensor, got ",
                leaf.defined() ? "a non-leaf tensor (" + describe(leaf) + ")" : "an undefined one");
  if (destination.defined()) {
    TESSERA_CHECK(destination.shape() == leaf.shape() && destination.dtype() == leaf.dtype() &&
                      destination.device() == leaf.device(),
                  "set_grad_destination: the destination (", describe(destination),
                  ") must have the leaf's shape, dtype and device (", describe(leaf), ")");
    TESSERA_CHECK(destination.is_contiguous(), "set_grad_destination: the destination (",
                  describe(destination), ", strides ", shape_str(destination.strides()),
                  ") must be contiguous");
    TESSERA_CHECK(!destination.requires_grad(), "set_grad_destination: the destination (",
                  describe(destination), ") must not require grad");
  }
  AutogradMeta& meta = meta_of(leaf);
  TESSERA_CHECK(meta.destination_claimed_by == nullptr,
                "set_grad_destination: a backward "
                "still holds a partial gradient of the leaf (",
                describe(leaf), ") in its destination");
  meta.grad_destination = std::move(destination);
}

Tensor grad_destination(const Tensor& leaf) {
  const AutogradMeta* meta = meta_if_any(leaf);
  return meta != nullptr ? meta->grad_destination : Tensor();
}

GradDestinationCounts grad_destination_counts() {
  return {destination_written.load(), destination_copied.load()};
}

void zero_grad(const std::vector<Tensor>& tensors, bool set_to_none) {
  for (const Tensor& t : tensors) {
    AutogradMeta* meta = meta_if_any(t);
    if (meta == nullptr || !meta->grad.defined()) continue;
    if (set_to_none) {
      meta->grad = Tensor();
    } else {
      ops::fill_(meta->grad, 0.0);
    }
  }
}

}  // namespace tessera::autograd
