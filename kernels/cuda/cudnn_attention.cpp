// cuDNN fused attention through the cuDNN frontend graph API (see cudnn_attention.h).
//
// One SDPA graph per problem: dtype, B, H, T, D, every tensor's strides, the scale, the device
// (and, for the backward, whether deterministic mode is on) are baked into the graph and its
// execution plan, so built graphs are cached under exactly that key. Building a plan takes
// milliseconds to seconds; a training run sees a handful of keys and builds each once.
//
// The log-sum-exp convention: cuDNN's "Stats" output (generate_stats, stats_use_log2 off) is
// max + ln(sum exp(s - max)) over each query row of the scores s AFTER the attention scale and
// the causal mask, in natural log, f32, shaped [B, H, T, 1]. That is exactly Tessera's lse
// (the flash kernels' m + log(sum exp(s - m)) of the scaled scores), so no conversion is
// needed: a contiguous [B, H, T] lse is handed to cuDNN as [B, H, T, 1] with strides
// (H*T, T, 1, 1), and the backward of either implementation accepts the other's lse (the
// tests check both the values and the cross use).
#include "tessera/kernels/cuda/cudnn_attention.h"

#include "tessera/kernels/cuda/attention_checks.h"

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "tessera/core/error.h"

#if TESSERA_WITH_CUDNN_FRONTEND
#include <cudnn_frontend.h>

#include <bit>
#include <map>
#include <memory>
#include <tuple>
#include <unordered_map>

#include "tessera/core/cuda/cuda_check.h"
#include "tessera/core/cuda/cuda_runtime.h"
#endif

namespace tessera::cuda {

#if !TESSERA_WITH_CUDNN_FRONTEND

namespace {
constexpr const char* kNotBuilt =
    "built without the cuDNN frontend headers (run scripts/setup.sh)";
}

bool cudnn_attention_available(std::string* reason) {
  if (reason) *reason = kNotBuilt;
  return false;
}

void cudnn_attention_forward(const Tensor&, const Tensor&, const Tensor&, double, const Tensor&,
                             const Tensor&) {
  TESSERA_FAIL("cudnn_attention_forward: ", kNotBuilt);
}

void cudnn_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const Tensor&, const Tensor&, double, const Tensor&, const Tensor&,
                              const Tensor&) {
  TESSERA_FAIL("cudnn_attention_backward: ", kNotBuilt);
}

bool cudnn_masked_attention_available(std::string* reason) { return cudnn_attention_available(reason); }

void cudnn_masked_attention_forward(const Tensor&, const Tensor&, const Tensor&, double, bool,
                                    const Tensor&, const Tensor&, const Tensor&) {
  TESSERA_FAIL("cudnn_masked_attention_forward: ", kNotBuilt);
}

void cudnn_masked_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, double, bool, const Tensor&,
                                     const Tensor&, const Tensor&, const Tensor&) {
  TESSERA_FAIL("cudnn_masked_attention_backward: ", kNotBuilt);
}


#else  // TESSERA_WITH_CUDNN_FRONTEND

namespace {
namespace fe = cudnn_frontend;
using TensorAttr = std::shared_ptr<fe::graph::Tensor_attributes>;

// Tensor ids in the graphs' variant packs.
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kSeqQ, kSeqKV };

// A frontend call that failed becomes a tessera::Error naming the op and the call.
void check_frontend(fe::error_t status, const char* op, const char* call) {
  if (status.is_bad())
    TESSERA_FAIL(op, ": cuDNN frontend ", call, " failed: ", status.get_message());
}

// ---- argument checks: the contract of the hand-written kernels (attention_checks.h) ----
using attention_detail::check_head_view;
using attention_detail::check_kv_lengths;
using attention_detail::check_lse;
using Problem = attention_detail::AttnShape;

Problem check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  const Problem p = attention_detail::check_inputs(op, q, k, v, /*any_head_size=*/false);
  attention_detail::check_vector_rows(op, q, k, v);
  return p;
}

// ---- per-thread cuDNN state ----
// A handle per (thread, device) and a graph cache per thread: an execution plan is tied to
// the handle it was built with, and handles must not be used by two threads at once. Both
// are deliberately never destroyed: tearing cuDNN down during thread/static destruction can
// run after the CUDA runtime has already unloaded.
cudnnHandle_t handle_for(int device) {
  thread_local auto* handles = new std::map<int, cudnnHandle_t>();
  auto it = handles->find(device);
  if (it != handles->end()) return it->second;
  cudnnHandle_t handle = nullptr;
  TESSERA_CUDNN_CHECK(cudnnCreate(&handle));
  handles->emplace(device, handle);
  return handle;
}

// The key a built graph is valid for.
struct GraphKey {
  bool backward;
  DType dtype;
  int device;
  Problem p;
  uint32_t scale_bits;
  bool deterministic;
  std::vector<int64_t> strides;  // of every [B, H, T, D] operand, in a fixed order
  bool causal = true;
  bool padded = false;  // keys padded on the right: seq_len_q / seq_len_kv inputs

  auto tie() const {
    return std::tie(backward, dtype, device, p.B, p.H, p.T, p.D, p.Hkv, scale_bits, deterministic,
                    strides, causal, padded);
  }
  bool operator<(const GraphKey& o) const { return tie() < o.tie(); }
};

struct BuiltGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

std::vector<int64_t> dims_of(const Problem& p) { return {p.B, p.H, p.T, p.D}; }
// k, v, dk, dv: Hkv heads (grouped-query attention when Hkv < H; cuDNN reads query head h's
// keys from head h / (H / Hkv) and sums dk, dv over each group, as the flash kernels do).
std::vector<int64_t> kv_dims_of(const Problem& p) { return {p.B, p.Hkv, p.T, p.D}; }
std::vector<int64_t> stats_dims(const Problem& p) { return {p.B, p.H, p.T, 1}; }
std::vector<int64_t> stats_strides(const Problem& p) { return {p.H * p.T, p.T, 1, 1}; }

// Four strides of operand `index` in the key's stride list.
std::vector<int64_t> strides_at(const GraphKey& key, size_t index) {
  return {key.strides.begin() + 4 * index, key.strides.begin() + 4 * index + 4};
}

std::shared_ptr<fe::graph::Graph> new_graph(DType dtype) {
  auto graph = std::make_shared<fe::graph::Graph>();
  graph->set_io_data_type(dtype == DType::bf16 ? fe::DataType_t::BFLOAT16 : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return graph;
}

TensorAttr input(fe::graph::Graph& graph, const char* name, int64_t uid,
                 std::vector<int64_t> dims, std::vector<int64_t> strides) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim(std::move(dims))
                          .set_stride(std::move(strides)));
}

void mark_output(const TensorAttr& t, int64_t uid, std::vector<int64_t> dims,
                 std::vector<int64_t> strides) {
  t->set_output(true).set_uid(uid).set_dim(std::move(dims)).set_stride(std::move(strides));
}

// The per-row sequence lengths of a padded graph: i32 [B, 1, 1, 1].
TensorAttr sequence_lengths(fe::graph::Graph& graph, const char* name, int64_t uid, int64_t B) {
  auto t = input(graph, name, uid, {B, 1, 1, 1}, {1, 1, 1, 1});
  t->set_data_type(fe::DataType_t::INT32);
  return t;
}

// The key's masking on either direction's attributes: the causal band (key j <= query i) and
// cuDNN's padding mask over the seq_len_q / seq_len_kv inputs.
template <class Attributes>
void set_masking(Attributes& attributes, fe::graph::Graph& graph, const GraphKey& key) {
  if (key.causal)
    attributes.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
  if (key.padded)
    attributes.set_padding_mask(true)
        .set_seq_len_q(sequence_lengths(graph, "seq_len_q", kSeqQ, key.p.B))
        .set_seq_len_kv(sequence_lengths(graph, "seq_len_kv", kSeqKV, key.p.B));
}

// Forward: operands q, k, v, out in key.strides.
std::shared_ptr<fe::graph::Graph> forward_graph(const GraphKey& key) {
  auto graph = new_graph(key.dtype);
  auto q = input(*graph, "q", kQ, dims_of(key.p), strides_at(key, 0));
  auto k = input(*graph, "k", kK, kv_dims_of(key.p), strides_at(key, 1));
  auto v = input(*graph, "v", kV, kv_dims_of(key.p), strides_at(key, 2));
  auto attributes = fe::graph::SDPA_attributes()
                        .set_name("tessera_sdpa_forward")
                        .set_generate_stats(true)
                        .set_stats_use_log2(false)  // natural log, as Tessera's lse
                        .set_attn_scale(std::bit_cast<float>(key.scale_bits));
  set_masking(attributes, *graph, key);
  auto [out, stats] = graph->sdpa(q, k, v, attributes);
  mark_output(out, kO, dims_of(key.p), strides_at(key, 3));
  mark_output(stats, kStats, stats_dims(key.p), stats_strides(key.p));
  stats->set_data_type(fe::DataType_t::FLOAT);
  return graph;
}

// Backward: operands q, k, v, out, dout, dq, dk, dv in key.strides.
std::shared_ptr<fe::graph::Graph> backward_graph(const GraphKey& key) {
  auto graph = new_graph(key.dtype);
  auto q = input(*graph, "q", kQ, dims_of(key.p), strides_at(key, 0));
  auto k = input(*graph, "k", kK, kv_dims_of(key.p), strides_at(key, 1));
  auto v = input(*graph, "v", kV, kv_dims_of(key.p), strides_at(key, 2));
  auto out = input(*graph, "out", kO, dims_of(key.p), strides_at(key, 3));
  auto dout = input(*graph, "dout", kDO, dims_of(key.p), strides_at(key, 4));
  auto stats = input(*graph, "lse", kStats, stats_dims(key.p), stats_strides(key.p));
  stats->set_data_type(fe::DataType_t::FLOAT);
  auto attributes = fe::graph::SDPA_backward_attributes()
                        .set_name("tessera_sdpa_backward")
                        .set_attn_scale(std::bit_cast<float>(key.scale_bits))
                        .set_deterministic_algorithm(key.deterministic);
  set_masking(attributes, *graph, key);
  auto [dq, dk, dv] = graph->sdpa_backward(q, k, v, out, dout, stats, attributes);
  mark_output(dq, kDQ, dims_of(key.p), strides_at(key, 5));
  mark_output(dk, kDK, kv_dims_of(key.p), strides_at(key, 6));
  mark_output(dv, kDV, kv_dims_of(key.p), strides_at(key, 7));
  return graph;
}

// Validates the graph, picks an engine by cuDNN's heuristics and builds its plan.
BuiltGraph build(const char* op, std::shared_ptr<fe::graph::Graph> graph, cudnnHandle_t handle) {
  check_frontend(graph->validate(), op, "graph.validate");
  check_frontend(graph->build_operation_graph(handle), op, "graph.build_operation_graph");
  check_frontend(graph->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), op,
                 "graph.create_execution_plans");
  check_frontend(graph->check_support(handle), op, "graph.check_support");
  check_frontend(graph->build_plans(handle), op, "graph.build_plans");
  BuiltGraph built;
  built.graph = std::move(graph);
  check_frontend(built.graph->get_workspace_size(built.workspace_bytes), op,
                 "graph.get_workspace_size");
  return built;
}

const BuiltGraph& cached_graph(const char* op, const GraphKey& key, cudnnHandle_t handle) {
  thread_local auto* cache = new std::map<GraphKey, BuiltGraph>();
  auto it = cache->find(key);
  if (it != cache->end()) return it->second;
  BuiltGraph built = build(op, key.backward ? backward_graph(key) : forward_graph(key), handle);
  return cache->emplace(key, std::move(built)).first->second;
}

GraphKey make_key(bool backward, const Tensor& q, const Problem& p, double scale,
                  std::initializer_list<const Tensor*> operands, bool causal = true,
                  bool padded = false) {
  GraphKey key{backward, q.dtype(), q.device().index, p,
               std::bit_cast<uint32_t>(static_cast<float>(scale)),
               backward && deterministic(), {}, causal, padded};
  for (const Tensor* t : operands) key.strides.insert(key.strides.end(), t->strides().begin(),
                                                      t->strides().end());
  return key;
}

// The variant pack's sequence lengths of a padded graph: every query row counts (T), the keys
// up to kv_lengths. The T-filled tensor lives until the caller's call has been queued, which is
// enough: the caching allocator reuses its memory only in stream order.
void add_sequence_lengths(std::unordered_map<int64_t, void*>& pointers, const Problem& p,
                          const Tensor& kv_lengths, Tensor& seq_len_q) {
  seq_len_q = full({p.B}, static_cast<double>(p.T), {.dtype = DType::i32, .device = kv_lengths.device()});
  pointers[kSeqQ] = seq_len_q.raw_data();
  pointers[kSeqKV] = kv_lengths.raw_data();
}

// Runs a built graph on the current stream with a workspace from the caching allocator.
void execute(const char* op, const GraphKey& key, const Tensor& like,
             std::unordered_map<int64_t, void*> pointers) {
  DeviceGuard guard(like.device().index);
  cudnnHandle_t handle = handle_for(like.device().index);
  TESSERA_CUDNN_CHECK(cudnnSetStream(handle, current_stream(like.device().index)));
  const BuiltGraph& built = cached_graph(op, key, handle);
  Tensor workspace;
  if (built.workspace_bytes > 0)
    workspace = empty({built.workspace_bytes}, {.dtype = DType::u8, .device = like.device()});
  check_frontend(built.graph->execute(handle, pointers,
                                      workspace.defined() ? workspace.raw_data() : nullptr),
                 op, "graph.execute");
}

void* ptr(const Tensor& t) { return t.raw_data(); }

using NamedTensors = std::initializer_list<std::pair<const char*, const Tensor*>>;

// The availability answer per device, computed once.
struct Availability {
  bool ok = false;
  std::string reason;
};

Availability probe(int device, bool masked) {
  const size_t version = cudnnGetVersion();
  if (version < 90000)
    return {false, "cuDNN " + std::to_string(version) +
                       " is loaded; the attention path needs 9.0 or newer"};
  int major = 0, minor = 0;
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  TESSERA_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major < 8)
    return {false, "device " + std::to_string(device) + " has compute capability " +
                       std::to_string(major) + "." + std::to_string(minor) +
                       "; cuDNN fused attention needs 8.0+"};
  // A trial build of a small forward and backward graph (not cached: its strides are its own).
  try {
    DeviceGuard guard(device);
    cudnnHandle_t handle = handle_for(device);
    const Problem p{1, 1, 64, 64, 1};
    const std::vector<int64_t> contiguous{64 * 64, 64 * 64, 64, 1};
    GraphKey key{false, DType::bf16, device, p, std::bit_cast<uint32_t>(0.125f), false, {},
                 /*causal=*/!masked, /*padded=*/masked};
    for (int i = 0; i < 8; ++i) key.strides.insert(key.strides.end(), contiguous.begin(),
                                                   contiguous.end());
    build("cudnn_attention_available", forward_graph(key), handle);
    key.backward = true;
    build("cudnn_attention_available", backward_graph(key), handle);
  } catch (const std::exception& e) {
    return {false, std::string("trial graph build failed: ") + e.what()};
  }
  return {true, ""};
}

// The availability answer per device and graph family (causal / masked), computed once.
bool available(bool masked, std::string* reason) {
  if (device_count() == 0) {
    if (reason) *reason = "no CUDA device";
    return false;
  }
  static std::mutex mutex;
  static std::map<std::pair<int, bool>, Availability> answers;
  const int device = current_device();
  std::lock_guard<std::mutex> lock(mutex);
  auto it = answers.find({device, masked});
  if (it == answers.end()) it = answers.emplace(std::pair{device, masked}, probe(device, masked)).first;
  if (reason) *reason = it->second.reason;
  return it->second.ok;
}

void forward(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, double scale,
             bool causal, const Tensor& kv_lengths, const Tensor& out, const Tensor& lse) {
  const Problem p = check_qkv(op, q, k, v);
  check_head_view(op, "out", out, q, /*vector_rows=*/true, /*written=*/true);
  check_lse(op, lse, p, q.device());
  const bool padded = kv_lengths.defined();
  if (padded) check_kv_lengths(op, kv_lengths, p, q.device());
  const GraphKey key = make_key(false, q, p, scale, {&q, &k, &v, &out}, causal, padded);
  std::unordered_map<int64_t, void*> pointers{
      {kQ, ptr(q)}, {kK, ptr(k)}, {kV, ptr(v)}, {kO, ptr(out)}, {kStats, ptr(lse)}};
  Tensor seq_len_q;
  if (padded) add_sequence_lengths(pointers, p, kv_lengths, seq_len_q);
  execute(op, key, q, std::move(pointers));
}

void backward(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
              const Tensor& dout, const Tensor& lse, double scale, bool causal,
              const Tensor& kv_lengths, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const Problem p = check_qkv(op, q, k, v);
  for (auto [name, t] : NamedTensors{{"out", &out}, {"dout", &dout}})
    check_head_view(op, name, *t, q, /*vector_rows=*/true, /*written=*/false);
  check_head_view(op, "dq", dq, q, /*vector_rows=*/true, /*written=*/true);
  for (auto [name, t] : NamedTensors{{"dk", &dk}, {"dv", &dv}})
    check_head_view(op, name, *t, k, /*vector_rows=*/true, /*written=*/true);
  check_lse(op, lse, p, q.device());
  const bool padded = kv_lengths.defined();
  if (padded) check_kv_lengths(op, kv_lengths, p, q.device());
  const GraphKey key =
      make_key(true, q, p, scale, {&q, &k, &v, &out, &dout, &dq, &dk, &dv}, causal, padded);
  std::unordered_map<int64_t, void*> pointers{
      {kQ, ptr(q)},  {kK, ptr(k)},       {kV, ptr(v)},   {kO, ptr(out)}, {kDO, ptr(dout)},
      {kStats, ptr(lse)}, {kDQ, ptr(dq)}, {kDK, ptr(dk)}, {kDV, ptr(dv)}};
  Tensor seq_len_q;
  if (padded) add_sequence_lengths(pointers, p, kv_lengths, seq_len_q);
  execute(op, key, q, std::move(pointers));
}

}  // namespace

bool cudnn_attention_available(std::string* reason) { return available(false, reason); }
bool cudnn_masked_attention_available(std::string* reason) { return available(true, reason); }

void cudnn_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                             const Tensor& out, const Tensor& lse) {
  forward("cudnn_attention_forward", q, k, v, scale, /*causal=*/true, Tensor(), out, lse);
}

void cudnn_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& out, const Tensor& dout, const Tensor& lse,
                              double scale, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  backward("cudnn_attention_backward", q, k, v, out, dout, lse, scale, /*causal=*/true, Tensor(),
           dq, dk, dv);
}

void cudnn_masked_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, double scale,
                                    bool causal, const Tensor& kv_lengths, const Tensor& out,
                                    const Tensor& lse) {
  forward("cudnn_masked_attention_forward", q, k, v, scale, causal, kv_lengths, out, lse);
}

void cudnn_masked_attention_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& out, const Tensor& dout, const Tensor& lse,
                                     double scale, bool causal, const Tensor& kv_lengths,
                                     const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  backward("cudnn_masked_attention_backward", q, k, v, out, dout, lse, scale, causal, kv_lengths,
           dq, dk, dv);
}

#endif  // TESSERA_WITH_CUDNN_FRONTEND

}  // namespace tessera::cuda
