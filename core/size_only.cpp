#include "tessera/core/size_only.h"

#include <sys/mman.h>

#include <atomic>
#include <memory>
#include <type_traits>
#include <vector>

#include "tessera/core/allocator.h"
#include "tessera/core/dispatch.h"
#include "tessera/core/error.h"
#include "tessera/core/fused_dispatch.h"
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

// Sets a function-pointer entry to a no-op of its own signature (kept null when it was:
// a null entry selects the composed route, which must stay what it is).
template <class R, class... A>
void make_noop(R (*&fn)(A...), bool even_if_null = false) {
  if (fn == nullptr && !even_if_null) return;
  fn = [](A...) -> R {
    if constexpr (std::is_same_v<R, Tensor>)
      return zeros({}, {.dtype = DType::f32});
    else if constexpr (!std::is_void_v<R>)
      return R{};
  };
}

void silence(KernelTable& t) {
  make_noop(t.fill), make_noop(t.copy), make_noop(t.random), make_noop(t.unary),
      make_noop(t.binary);
  make_noop(t.where), make_noop(t.add_scaled), make_noop(t.reduce), make_noop(t.arg_reduce);
  make_noop(t.softmax), make_noop(t.softmax_backward), make_noop(t.layer_norm),
      make_noop(t.layer_norm_backward);
  make_noop(t.matmul), make_noop(t.cumsum), make_noop(t.topk), make_noop(t.rms_norm),
      make_noop(t.rms_norm_backward);
  make_noop(t.rope), make_noop(t.embedding), make_noop(t.index_add), make_noop(t.cross_entropy);
  make_noop(t.cross_entropy_backward);
}

void silence(FusedKernelTable& t, bool fused_routes) {
  make_noop(t.linear_forward, fused_routes), make_noop(t.linear_weight_grad, fused_routes);
  make_noop(t.classifier, fused_routes), make_noop(t.flash_attention_forward, fused_routes);
  make_noop(t.flash_attention_backward, fused_routes), make_noop(t.cudnn_attention_forward);
  make_noop(t.cudnn_attention_backward), make_noop(t.global_grad_norm, fused_routes);
  // The in-place updates always: the CPU's own AdamW and scaling loops would write every
  // parameter and moment (committing the memory this mode exists not to use), and in place
  // they allocate nothing either way.
  make_noop(t.multi_tensor_adamw, true), make_noop(t.multi_tensor_scale, true);
}

struct Saved {
  KernelTable kernels;
  FusedKernelTable fused;
  bool counting = false;
  std::unique_ptr<SizeOnlyAllocator> allocator;
};
Saved& saved() {
  static Saved s;
  return s;
}

}  // namespace

SizeOnlyMode::SizeOnlyMode(bool fused_routes) {
  TESSERA_CHECK(!g_active.exchange(true), "size-only mode: already active");
  Saved& s = saved();
  s.kernels = kernel_table(DeviceType::CPU);
  s.fused = fused_kernel_table(DeviceType::CPU);
  s.counting = memory_categories_enabled();
  s.allocator = std::make_unique<SizeOnlyAllocator>();
  silence(kernel_table(DeviceType::CPU));
  silence(fused_kernel_table(DeviceType::CPU), fused_routes);
  set_cpu_allocator_override(s.allocator.get());
  enable_memory_categories(true);
}

SizeOnlyMode::~SizeOnlyMode() {
  Saved& s = saved();
  kernel_table(DeviceType::CPU) = s.kernels;
  fused_kernel_table(DeviceType::CPU) = s.fused;
  set_cpu_allocator_override(nullptr);
  enable_memory_categories(s.counting);
  // The allocator stays alive (and reachable, so leak checkers know it is kept on purpose):
  // tensors of the dry run may outlive the mode.
  static auto* kept = new std::vector<std::unique_ptr<SizeOnlyAllocator>>();
  kept->push_back(std::move(s.allocator));
  g_active = false;
}

bool SizeOnlyMode::active() { return g_active; }

}  // namespace tessera
