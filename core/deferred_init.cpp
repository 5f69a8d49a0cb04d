#include "tessera/core/deferred_init.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

#include "tessera/core/dispatch.h"

namespace tessera {

namespace {

thread_local int guard_depth = 0;

// A placeholder is its TensorImpl while that still points at the storage it was made with.
struct Entry {
  std::weak_ptr<TensorImpl> impl;
  std::weak_ptr<Storage> placeholder;
  InitRecipe recipe;
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<const TensorImpl*, Entry> entries;
  std::atomic<size_t> size{0};
};

Registry& registry() {
  static Registry r;
  return r;
}

std::atomic<uint64_t> bytes_read{0};

bool still_placeholder(const Entry& e, const TensorImpl* impl) {
  const auto alive = e.impl.lock();
  const auto storage = e.placeholder.lock();
  return alive && alive.get() == impl && storage && storage == alive->storage;
}

// The entry of t while t is a placeholder (stale entries are dropped on the way); the
// registry's mutex must be held.
Entry* find_locked(const Tensor& t) {
  if (!t.defined()) return nullptr;
  Registry& r = registry();
  auto it = r.entries.find(t.impl_ptr().get());
  if (it == r.entries.end()) return nullptr;
  if (!still_placeholder(it->second, it->first)) {
    r.entries.erase(it);
    r.size = r.entries.size();
    return nullptr;
  }
  return &it->second;
}

Tensor make_placeholder(const Shape& shape, TensorOptions opts, InitRecipe recipe) {
  Tensor t = raw::make(empty({0}, {.dtype = opts.dtype, .device = opts.device}).storage(), shape,
                       contiguous_strides(shape), 0, opts.dtype);
  recipe.dtypes = {opts.dtype};
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.entries[t.impl_ptr().get()] = {t.impl_ptr(), t.impl().storage, std::move(recipe)};
  r.size = r.entries.size();
  return t;
}

InitRecipe recipe_of(const Tensor& t, const std::string& what) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const Entry* e = find_locked(t);
  TESSERA_CHECK(e, "deferred init: ", what, " of shape ",
                t.defined() ? shape_str(t.shape()) : "(undefined)",
                " is not a placeholder of deferred initialisation");
  return e->recipe;
}

// Elements [begin, begin + target.numel()) of the recipe's value, in target's dtype (the
// recipe's first dtype), written into target.
void fill_from_recipe(const InitRecipe& recipe, int64_t begin, const Tensor& target) {
  const int64_t n = target.numel();
  if (n == 0) return;
  switch (recipe.kind) {
    case InitRecipe::Kind::Constant:
      raw::fill_(target, recipe.a);
      return;
    case InitRecipe::Kind::Copy: {
      const Tensor flat = raw::reshape(recipe.source, {recipe.source.numel()});
      Tensor piece = raw::narrow(flat, 0, begin, n);
      bytes_read += static_cast<uint64_t>(n) * piece.element_size();
      if (piece.device() != target.device()) piece = raw::to(piece, target.device(), piece.dtype());
      raw::copy_(target, piece);
      return;
    }
    case InitRecipe::Kind::Normal:
    case InitRecipe::Kind::Uniform: {
      // Element i of a draw lives in block offset + i / per_block (core/philox.h), and the
      // kernel numbers a target's elements from its own start: a target that starts at a
      // block boundary is drawn in place; the elements before the first boundary come
      // from that one block drawn whole.
      const bool normal = recipe.kind == InitRecipe::Kind::Normal;
      const RandomKind kind = normal ? RandomKind::Normal : RandomKind::Uniform;
      const int64_t per_block = normal ? 2 : 4;
      auto draw = [&](const Tensor& dst, uint64_t block) {
        checked_kernel(kernel_table(dst.device().type).random, "random", dst.device())(
            dst, kind, recipe.seed, block, recipe.a, recipe.b);
      };
      int64_t done = 0;
      if (const int64_t lead = begin % per_block; lead != 0) {
        const Tensor block =
            empty({per_block}, {.dtype = target.dtype(), .device = target.device()});
        draw(block, recipe.offset + static_cast<uint64_t>(begin / per_block));
        done = std::min(per_block - lead, n);
        raw::copy_(raw::narrow(target, 0, 0, done), raw::narrow(block, 0, lead, done));
      }
      if (done < n)
        draw(raw::narrow(target, 0, done, n - done),
             recipe.offset + static_cast<uint64_t>((begin + done) / per_block));
      return;
    }
  }
}

}  // namespace

DeferredInitGuard::DeferredInitGuard() { ++guard_depth; }
DeferredInitGuard::~DeferredInitGuard() { --guard_depth; }
bool DeferredInitGuard::active() { return guard_depth > 0; }

Tensor init_normal(const Shape& shape, double mean, double stddev, Generator* gen,
                   TensorOptions opts) {
  TESSERA_CHECK(is_floating(opts.dtype), "init_normal: needs a floating dtype, got ",
                dtype_name(opts.dtype));
  if (!DeferredInitGuard::active()) {
    Tensor t = empty(shape, {.dtype = opts.dtype, .device = opts.device});
    normal_(t, mean, stddev, gen);
    return t;
  }
  // The blocks normal_ would reserve (two normals a block), so later draws stay the same.
  Generator& g = gen ? *gen : default_generator();
  InitRecipe recipe{.kind = InitRecipe::Kind::Normal, .a = mean, .b = stddev};
  const uint64_t n = static_cast<uint64_t>(shape_numel(shape));
  if (n > 0) recipe.offset = g.reserve((n + 1) / 2);
  recipe.seed = g.seed();
  return make_placeholder(shape, opts, std::move(recipe));
}

Tensor init_constant(const Shape& shape, double value, TensorOptions opts) {
  if (!DeferredInitGuard::active())
    return full(shape, value, {.dtype = opts.dtype, .device = opts.device});
  return make_placeholder(shape, opts, InitRecipe{.kind = InitRecipe::Kind::Constant, .a = value});
}

bool is_deferred(const Tensor& t) {
  if (!any_deferred()) return false;
  std::lock_guard<std::mutex> lock(registry().mutex);
  return find_locked(t) != nullptr;
}

bool any_deferred() {
  Registry& r = registry();
  if (r.size.load() == 0) return false;
  std::lock_guard<std::mutex> lock(r.mutex);
  for (auto it = r.entries.begin(); it != r.entries.end();)
    it = still_placeholder(it->second, it->first) ? std::next(it) : r.entries.erase(it);
  r.size = r.entries.size();
  return r.size.load() > 0;
}

InitRecipe deferred_recipe(const Tensor& t, const std::string& what) { return recipe_of(t, what); }

void set_deferred_recipe(const Tensor& t, InitRecipe recipe) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  Entry* e = find_locked(t);
  TESSERA_CHECK(e, "deferred init: set_deferred_recipe needs a placeholder");
  if (recipe.dtypes.empty()) recipe.dtypes = e->recipe.dtypes;
  e->recipe = std::move(recipe);
}

void set_deferred_source(const Tensor& t, const Tensor& source) {
  TESSERA_CHECK(source.defined() && source.numel() == t.numel(), "deferred init: a source of ",
                source.defined() ? source.numel() : 0, " elements for a placeholder of ",
                t.numel());
  // Loading converts the source to the tensor's dtype now: that is where its value starts.
  set_deferred_recipe(
      t, InitRecipe{.kind = InitRecipe::Kind::Copy, .source = source, .dtypes = {t.dtype()}});
}

void retarget_deferred(const Tensor& t, Device device, DType dtype) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  Entry* e = find_locked(t);
  TESSERA_CHECK(e, "deferred init: retarget_deferred needs a placeholder");
  auto storage = empty({0}, {.dtype = dtype, .device = device}).storage();
  t.impl().storage = storage;
  t.impl().dtype = dtype;
  e->placeholder = storage;
  if (e->recipe.dtypes.back() != dtype) e->recipe.dtypes.push_back(dtype);
}

void materialize_deferred_range(const Tensor& t, int64_t begin, const Tensor& out) {
  const InitRecipe recipe = recipe_of(t, "materialize_deferred_range: the tensor");
  const int64_t n = out.numel();
  TESSERA_CHECK(out.dim() == 1 && out.is_contiguous(),
                "materialize_deferred_range: out must be 1-D and contiguous, got ",
                shape_str(out.shape()));
  TESSERA_CHECK(begin >= 0 && begin + n <= t.numel(), "materialize_deferred_range: elements [",
                begin, ", ", begin + n, ") of a tensor of ", t.numel());
  // Computed in the dtype the eager construction computed in, then converted as it was.
  const bool direct = recipe.dtypes.size() == 1 && out.dtype() == recipe.dtypes.front();
  Tensor value =
      direct ? out : empty({n}, {.dtype = recipe.dtypes.front(), .device = out.device()});
  fill_from_recipe(recipe, begin, value);
  if (direct) return;
  for (size_t i = 1; i < recipe.dtypes.size(); ++i)
    value = raw::to(value, out.device(), recipe.dtypes[i]);
  raw::copy_(out, value);
}

void materialize_deferred(const Tensor& t) {
  const Tensor whole = empty({t.numel()}, {.dtype = t.dtype(), .device = t.device()});
  materialize_deferred_range(t, 0, whole);
  TensorImpl& impl = t.impl();
  impl.storage = whole.storage();
  impl.strides = contiguous_strides(impl.shape);
  impl.offset = 0;
  forget_deferred(t);
}

void forget_deferred(const Tensor& t) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (t.defined()) r.entries.erase(t.impl_ptr().get());
  r.size = r.entries.size();
}

void check_not_deferred(const Tensor& t, const std::string& name, const std::string& who) {
  TESSERA_CHECK(
      !is_deferred(t), who, ": parameter '", name,
      "' was built under sharded initialisation (Accelerator::sharded_init) and holds no "
      "values yet; prepare the model with that Accelerator (ZeRO stage 3), which fills each "
      "rank's slice, before using it");
}

uint64_t deferred_bytes_read() { return bytes_read.load(); }

}  // namespace tessera
