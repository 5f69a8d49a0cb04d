#include "tessera/kernels/fused_table.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>

#include "tessera/core/error.h"
#include "tessera/core/settings.h"
#include "tessera/core/size_only.h"

namespace tessera {

FusedKernelTable& fused_kernel_table(DeviceType type) {
  static std::array<FusedKernelTable, kNumDeviceTypes> tables{};
  return tables[static_cast<int>(type)];
}

// ---- the size-only dry run (core/size_only.h) ----

namespace {

FusedKernelTable& saved_cpu_row() {
  static FusedKernelTable saved;
  return saved;
}

// Every entry of the CPU row a no-op; with fused_routes also those a GPU has and the CPU
// lacks (flash attention, the fused classifier, multi-tensor AdamW, ...), so the run takes
// the routes a CUDA device takes and allocates what they allocate.
void silence_cpu_row(bool fused_routes) {
  FusedKernelTable& t = fused_kernel_table(DeviceType::CPU);
  saved_cpu_row() = t;
  make_size_only_noop(t.linear_forward, fused_routes);
  make_size_only_noop(t.linear_weight_grad, fused_routes);
  make_size_only_noop(t.linear_gelu_forward, fused_routes);
  make_size_only_noop(t.linear_input_grad_dgelu, fused_routes);
  make_size_only_noop(t.classifier, fused_routes);
  make_size_only_noop(t.flash_attention_forward, fused_routes);
  make_size_only_noop(t.flash_attention_backward, fused_routes);
  make_size_only_noop(t.cudnn_attention_forward);
  make_size_only_noop(t.cudnn_attention_backward);
  make_size_only_noop(t.global_grad_norm, fused_routes);
  make_size_only_noop(t.dropout_forward, fused_routes);
  make_size_only_noop(t.dropout_backward, fused_routes);
  make_size_only_noop(t.gelu_erf_forward, fused_routes);
  make_size_only_noop(t.gelu_erf_backward, fused_routes);
  // The in-place updates always: the CPU's own AdamW and scaling loops would write every
  // parameter and moment (committing the memory this mode exists not to use), and in place
  // they allocate nothing either way.
  make_size_only_noop(t.multi_tensor_adamw, true);
  make_size_only_noop(t.multi_tensor_scale, true);
}

void restore_cpu_row() { fused_kernel_table(DeviceType::CPU) = saved_cpu_row(); }

const bool size_only_hook_registered = [] {
  register_size_only_table(silence_cpu_row, restore_cpu_row);
  return true;
}();

}  // namespace

// ---- the Linear GEMMs, the MLP and SwiGLU ----

bool fused_linear_operands(const Tensor& x2d, const Tensor& w, const Tensor& bias, bool allow_f64) {
  const DType t = x2d.dtype();
  const bool float_type =
      t == DType::f32 || t == DType::f16 || t == DType::bf16 || (allow_f64 && t == DType::f64);
  const bool bias_ok =
      !bias.defined() || (bias.device() == x2d.device() &&
                          (bias.dtype() == t || (bias.dtype() == DType::f32 && t != DType::f64)));
  return float_type && w.dtype() == t && w.device() == x2d.device() && bias_ok;
}

bool swiglu_takes(const Tensor& gate, const Tensor& up) {
  if (!gate.defined() || !up.defined()) return false;
  const FusedKernelTable& fused = fused_kernel_table(gate.device().type);
  return fused.swiglu_forward != nullptr && fused.swiglu_backward != nullptr &&
         gate.shape() == up.shape() && gate.dtype() == up.dtype() && gate.device() == up.device() &&
         is_floating(gate.dtype()) && gate.is_contiguous() && up.is_contiguous();
}

namespace {
bool elementwise_route_takes(const Tensor& x, bool has_entries) {
  return has_entries && x.defined() && is_floating(x.dtype()) && x.is_contiguous();
}
}  // namespace

bool dropout_takes(const Tensor& x) {
  if (!x.defined()) return false;
  const FusedKernelTable& fused = fused_kernel_table(x.device().type);
  return elementwise_route_takes(x, fused.dropout_forward && fused.dropout_backward);
}

bool gelu_erf_takes(const Tensor& x) {
  if (!x.defined()) return false;
  const FusedKernelTable& fused = fused_kernel_table(x.device().type);
  return elementwise_route_takes(x, fused.gelu_erf_forward && fused.gelu_erf_backward);
}

// The composition's mask is keep * (1 / (1 - p)) with the scalar filled into x's dtype (f32
// first for the 16-bit ones, as every conversion from double does), and keep alone for p = 1.
double dropout_kept_scale(double p, DType dtype) {
  if (p >= 1.0) return 1.0;
  const double s = 1.0 / (1.0 - p);
  switch (dtype) {
    case DType::f64: return s;
    case DType::f32: return static_cast<float>(s);
    case DType::bf16: return static_cast<float>(BFloat16(static_cast<float>(s)));
    case DType::f16: return static_cast<float>(Half(static_cast<float>(s)));
    default: TESSERA_FAIL("dropout: needs a floating dtype, got ", dtype_name(dtype));
  }
}

void check_elementwise_entry_operands(const char* op, DeviceType type, const Tensor& a,
                                      const char* a_name, const Tensor& b, const char* b_name) {
  auto describe = [](const Tensor& t) {
    return t.defined()
               ? shape_str(t.shape()) + " " + dtype_name(t.dtype()) + " on " + t.device().str()
               : std::string("undefined");
  };
  TESSERA_CHECK(a.defined() && b.defined() && a.shape() == b.shape() && a.dtype() == b.dtype() &&
                    a.device() == b.device() && a.device().type == type && a.is_contiguous() &&
                    b.is_contiguous() && is_floating(a.dtype()),
                op, ": ", a_name, " and ", b_name,
                " must be contiguous floating tensors of one shape, dtype and device (",
                type == DeviceType::CUDA ? "cuda" : "cpu", "), got ", describe(a), " and ",
                describe(b));
}

void check_dropout_draw(const char* op, const DropoutDraw& draw) {
  TESSERA_CHECK(draw.p > 0 && draw.p <= 1, op, ": p must lie in (0, 1], got ", draw.p);
}

bool linear_gelu_takes(const Tensor& x2d, const Tensor& w_fc, const Tensor& b_fc,
                       const Tensor& w_proj, const Tensor& b_proj) {
  const FusedKernelTable& fused = fused_kernel_table(x2d.device().type);
  return fused.linear_gelu_forward != nullptr && fused.linear_input_grad_dgelu != nullptr &&
         fused_linear_operands(x2d, w_fc, b_fc, /*allow_f64=*/true) &&
         fused_linear_operands(x2d, w_proj, b_proj, /*allow_f64=*/true);
}

// ---- the attention backend ----

namespace {
// The chosen backend as an int, or -1 while neither set_attention_backend nor the
// environment has chosen one yet.
std::atomic<int>& backend_slot() {
  static std::atomic<int> slot{-1};
  return slot;
}
}  // namespace

AttentionBackend parse_attention_backend(const std::string& name, const char* source) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "flash") return AttentionBackend::Flash;
  if (lower == "cudnn") return AttentionBackend::Cudnn;
  TESSERA_FAIL(source, ": unknown attention backend '", name, "' (expected 'flash' or 'cudnn')");
}

const char* attention_backend_name(AttentionBackend backend) {
  return backend == AttentionBackend::Cudnn ? "cudnn" : "flash";
}

AttentionBackend attention_backend_from_environment() {
  return parse_attention_backend(setting_value_from_environment(Setting::Attention).text,
                                 "TESSERA_ATTENTION");
}

void set_attention_backend(AttentionBackend backend) {
  set_setting_option(Setting::Attention, attention_backend_name(backend));
  backend_slot().store(static_cast<int>(backend));
}

AttentionBackendRestorer::AttentionBackendRestorer()
    : saved_(attention_backend()),
      was_option_(setting_value(Setting::Attention).source == SettingSource::Option) {}

AttentionBackendRestorer::~AttentionBackendRestorer() {
  set_attention_backend(saved_);
  // The default or the environment chose it: drop the option, so they choose again.
  if (!was_option_) clear_setting_option(Setting::Attention);
}

AttentionBackend attention_backend() {
  std::atomic<int>& slot = backend_slot();
  if (slot.load() < 0) {
    // A bad TESSERA_ATTENTION raises here and leaves the slot unset, so every use raises.
    int unset = -1;
    slot.compare_exchange_strong(unset, static_cast<int>(attention_backend_from_environment()));
  }
  return static_cast<AttentionBackend>(slot.load());
}

const char* attention_route_name(AttentionRoute route) {
  static const char* names[] = {"composed", "fused", "fused_projection"};
  return names[static_cast<int>(route)];
}

// ---- which attention kernels take a call ----

bool rows_readable_by_kernels(const Tensor& t) {
  if (t.dim() == 0 || t.stride(t.dim() - 1) != 1) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.stride(d) % 8 != 0) return false;
  return reinterpret_cast<uintptr_t>(t.raw_data()) % 16 == 0;
}

Tensor attention_heads_view(const Tensor& x, int64_t first, int64_t C, int64_t n_head) {
  const Tensor part = raw::narrow(x, 2, first, C);
  return raw::permute(raw::view(part, {x.size(0), x.size(1), n_head, C / n_head}), {0, 2, 1, 3});
}

bool attention_shapes_fit(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.dtype() != DType::bf16 && q.dtype() != DType::f16) return false;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4) return false;
  if (k.size(2) != q.size(2) || (q.size(3) != 64 && q.size(3) != 128)) return false;
  // Grouped-query attention runs in the kernels themselves: k, v [B, Hkv, T, D], Hkv | H.
  if (k.shape() != v.shape() || k.size(0) != q.size(0) || k.size(3) != q.size(3) ||
      k.size(1) == 0 || q.size(1) % k.size(1) != 0)
    return false;
  for (const Tensor* t : {&q, &k, &v}) {
    if (t->dtype() != q.dtype() || !rows_readable_by_kernels(*t)) return false;
  }
  return true;
}

std::optional<MaskedAttentionKernels> masked_attention_kernels(const Tensor& q, const Tensor& k,
                                                               const Tensor& v, double dropout_p) {
  if (!attention_shapes_fit(q, k, v)) return std::nullopt;
  const FusedKernelTable& fused = fused_kernel_table(q.device().type);
  if (dropout_p != 0) {
    const bool drawable = fused.flash_masked_attention_dropout_forward != nullptr &&
                          fused.flash_masked_attention_dropout_backward != nullptr;
    return drawable && dropout_p > 0 && dropout_p < 1 ? std::optional(MaskedAttentionKernels::Flash)
                                                      : std::nullopt;
  }
  const bool flash = fused.flash_masked_attention_forward != nullptr &&
                     fused.flash_masked_attention_backward != nullptr;
  const bool cudnn_entries = fused.cudnn_masked_attention_available != nullptr &&
                             fused.cudnn_masked_attention_forward != nullptr &&
                             fused.cudnn_masked_attention_backward != nullptr;
  if (!flash && !cudnn_entries) return std::nullopt;
  if (attention_backend() == AttentionBackend::Cudnn) return MaskedAttentionKernels::Cudnn;
  const bool flash_chosen = setting_value(Setting::Attention).source != SettingSource::Default;
  if (flash && flash_chosen) return MaskedAttentionKernels::Flash;
  if (cudnn_entries && fused.cudnn_masked_attention_available(nullptr))
    return MaskedAttentionKernels::Cudnn;
  if (flash) return MaskedAttentionKernels::Flash;
  return std::nullopt;
}

namespace {

// True when q's device has the flash kernels, both directions; with dropout, those that drop.
bool has_flash_attention(const FusedKernelTable& fused, bool with_dropout) {
  if (with_dropout)
    return fused.flash_attention_dropout_forward != nullptr &&
           fused.flash_attention_dropout_backward != nullptr;
  return fused.flash_attention_forward != nullptr && fused.flash_attention_backward != nullptr;
}

}  // namespace

bool attention_takes(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                     double dropout_p) {
  if (!causal) return masked_attention_kernels(q, k, v, dropout_p).has_value();
  const FusedKernelTable& fused = fused_kernel_table(q.device().type);
  if (!has_flash_attention(fused, false)) return false;
  const bool dropout_drawable =
      dropout_p == 0 || (dropout_p > 0 && dropout_p < 1 && has_flash_attention(fused, true));
  return dropout_drawable && attention_shapes_fit(q, k, v);
}

bool attention_qkv_takes(const Tensor& qkv, int64_t n_head, double dropout_p) {
  if (qkv.dim() != 3 || qkv.size(2) % 3 != 0 || n_head <= 0) return false;
  const int64_t C = qkv.size(2) / 3;
  if (C % n_head != 0 || qkv.stride(2) != 1) return false;
  return attention_takes(attention_heads_view(qkv, 0, C, n_head),
                         attention_heads_view(qkv, C, C, n_head),
                         attention_heads_view(qkv, 2 * C, C, n_head), /*causal=*/true, dropout_p);
}

bool attention_qkv_projection_takes(const Tensor& x, const Tensor& w, const Tensor& bias,
                                    int64_t n_head, std::optional<DType> cast_to) {
  // The dtype t computes in: its own, or cast_to where autocast casts it.
  auto compute_dtype = [&](const Tensor& t) {
    return cast_to && is_floating(t.dtype()) && t.dtype() != DType::f64 ? *cast_to : t.dtype();
  };
  if (!bias.defined() || x.dim() != 3 || w.dim() != 2 || w.size(0) != x.size(2) ||
      w.size(1) % 3 != 0 || bias.shape() != Shape{w.size(1)} || n_head <= 0 ||
      (w.size(1) / 3) % n_head != 0 || x.size(1) == 0 || x.size(0) == 0)
    return false;
  const DType dtype = compute_dtype(x);
  const int64_t D = w.size(1) / 3 / n_head;
  // The projection's output, a fresh contiguous [B, T, 3C], meets the fused attention's
  // layout conditions whenever its dtype and head size do; the bias sums come from the flash
  // backend's kernels.
  const FusedKernelTable& fused = fused_kernel_table(x.device().type);
  return (dtype == DType::bf16 || dtype == DType::f16) && compute_dtype(w) == dtype &&
         (D == 64 || D == 128) && attention_backend() == AttentionBackend::Flash &&
         has_flash_attention(fused, false) &&
         fused.flash_attention_backward_with_bias_grad != nullptr;
}

}  // namespace tessera
