#include "tessera/core/size_only.h"

#include <sys/mman.h>

#include <atomic>
#include <memory>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/core/dispatch.h"
#include "tessera/core/error.h"
#include "tessera/core/memory_category.h"

namespace tessera {

namespace {

std::atomic<bool> g_active{false};

// Addresses handed out in order from a reserved region (wrapping around at its end: nothing
// is ever computed, so overlapping stale blocks is harmless). Pages are committed only
// where host code writes.
class SizeOnlyAllocator final : public Allocator {
 public:
  SizeOnlyAllocator() {
    for (size_t tib : {16, 4, 1}) {
      const size_t bytes = tib << 40;
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        base_ = static_cast<char*>(p);
        size_ = bytes;
        break;
      }
    }
    TESSERA_CHECK(base_ != nullptr, "size-only mode: cannot reserve address space for the dry run");
  }
  ~SizeOnlyAllocator() override { munmap(base_, size_); }
  void* allocate(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    const size_t rounded = (nbytes + 63) / 64 * 64;
    TESSERA_CHECK(rounded <= size_, "size-only mode: one allocation of ", nbytes,
                  " bytes exceeds the reserved ", size_, " bytes");
    if (next_ + rounded > size_) next_ = 0;
    void* p = base_ + next_;
    next_ += rounded;
    return p;
  }
  void deallocate(void*, size_t) override {}

 private:
  char* base_ = nullptr;
  size_t size_ = 0, next_ = 0;
};

// Kernels writing one element run for real (fill, copy, unary, binary; their inputs are one
// element too): they make the scalars host code reads back and branches on (the backward's
// seed gradient of 1, a loss scale, a division by the accumulation steps), so the dry run
// takes the branches a real one takes — the fused classifier's backward allocates a scaled
// copy of the logits' gradient only when its incoming gradient is not 1. Writing them commits
// next to no memory.
void fill_scalar(const Tensor& out, double value);
void copy_scalar(const Tensor& dst, const Tensor& src);
void unary_scalar(UnaryOp op, const Tensor& x, const Tensor& out);
void binary_scalar(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out);

void silence(KernelTable& t) {
  t.fill = fill_scalar, t.copy = copy_scalar, t.unary = unary_scalar, t.binary = binary_scalar;
  make_size_only_noop(t.random);
  make_size_only_noop(t.where), make_size_only_noop(t.add_scaled), make_size_only_noop(t.reduce),
      make_size_only_noop(t.arg_reduce);
  make_size_only_noop(t.softmax), make_size_only_noop(t.softmax_backward),
      make_size_only_noop(t.layer_norm), make_size_only_noop(t.layer_norm_backward);
  make_size_only_noop(t.matmul), make_size_only_noop(t.cumsum), make_size_only_noop(t.topk),
      make_size_only_noop(t.rms_norm), make_size_only_noop(t.rms_norm_backward);
  make_size_only_noop(t.rope), make_size_only_noop(t.embedding), make_size_only_noop(t.index_add),
      make_size_only_noop(t.cross_entropy);
  make_size_only_noop(t.cross_entropy_backward), make_size_only_noop(t.embedding_backward);
}

// The tables above core that take part in the mode (register_size_only_table).
struct TableHook {
  void (*silence)(bool fused_routes);
  void (*restore)();
};
std::vector<TableHook>& table_hooks() {
  static std::vector<TableHook> hooks;
  return hooks;
}

struct Saved {
  KernelTable kernels;
  bool counting = false;
  // One region for the process, reused by every mode (a plan compares several strategies in
  // one process) and never unmapped: tensors of a dry run may outlive the mode.
  SizeOnlyAllocator* allocator = nullptr;
};
Saved& saved() {
  static Saved s;
  return s;
}

void fill_scalar(const Tensor& out, double value) {
  if (out.numel() == 1) saved().kernels.fill(out, value);
}
void copy_scalar(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 1) saved().kernels.copy(dst, src);
}
void unary_scalar(UnaryOp op, const Tensor& x, const Tensor& out) {
  if (out.numel() == 1) saved().kernels.unary(op, x, out);
}
void binary_scalar(BinaryOp op, const Tensor& a, const Tensor& b, const Tensor& out) {
  if (out.numel() == 1) saved().kernels.binary(op, a, b, out);
}

}  // namespace

void register_size_only_table(void (*silence)(bool fused_routes), void (*restore)()) {
  TESSERA_CHECK(silence != nullptr && restore != nullptr,
                "register_size_only_table: both the silence and the restore function are needed");
  TESSERA_CHECK(!g_active, "register_size_only_table: a size-only mode is active");
  table_hooks().push_back({silence, restore});
}

SizeOnlyMode::SizeOnlyMode(bool fused_routes) {
  TESSERA_CHECK(!g_active.exchange(true), "size-only mode: already active");
  Saved& s = saved();
  s.kernels = kernel_table(DeviceType::CPU);
  s.counting = memory_categories_enabled();
  if (s.allocator == nullptr) s.allocator = new SizeOnlyAllocator();
  silence(kernel_table(DeviceType::CPU));
  for (const TableHook& hook : table_hooks()) hook.silence(fused_routes);
  set_cpu_allocator_override(s.allocator);
  enable_memory_categories(true);
}

SizeOnlyMode::~SizeOnlyMode() {
  Saved& s = saved();
  kernel_table(DeviceType::CPU) = s.kernels;
  for (auto hook = table_hooks().rbegin(); hook != table_hooks().rend(); ++hook) hook->restore();
  set_cpu_allocator_override(nullptr);
  enable_memory_categories(s.counting);
  g_active = false;
}

bool SizeOnlyMode::active() { return g_active; }

}  // namespace tessera
