// `tessera plan`: each rank's peak memory for training a GPT at a ZeRO stage on N processes,
// predicted by a size-only dry run of two real optimizer steps (dist/memory_plan.h), next to
// ZeRO's formula, and whether it fits the device's memory. With --all-strategies it plans
// DDP, ZeRO-1/2/3 and ZeRO-3 with the optimizer (and the parameters) offloaded, and gives a
// verdict for each: which strategies a model needs before any GPU is asked for. Nothing is
// allocated for real, so it runs anywhere (a laptop, a login node, the CPU CI).
//
// The memory it compares with: --max-memory (as Accelerate's and transformers' max_memory:
// "80GiB", "80GB", "81920MiB" or bytes), else the first CUDA device's own, else 80 GiB.
#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>

#include "tessera/cli/command.h"
#include "tessera/core/allocator.h"
#include "tessera/core/error.h"
#include "tessera/core/memory_stats.h"
#include "tessera/dist/memory_plan.h"

namespace tessera::cli {
namespace {

struct PlanArgs {
  int64_t n_layer = 12, n_head = 12, n_embd = 768, vocab = 50304, block_size = 0;
  int zero_stage = 0, nproc = 1, grad_accum = 1;
  int tp_size = 1, pp_size = 1, micro_batches = 1;  // the device mesh (dist/parallelize.h)
  int hybrid_shard_size = 0;  // 0: not hybrid
  int64_t batch = 8, seq = 1024;
  std::string dtype = "fp32", device = "cuda", offload = "none", max_memory, reduce_dtype;
  double card_gib = 0;
  int64_t prefetch = -1;
  bool all_strategies = false;
  bool fit = false;
  std::string accumulation = "reduce_every_micro_batch";
  int64_t max_buckets_in_flight = dist::kDefaultBucketsInFlight,
          bucket_bytes = dist::kDefaultBucketBytes;
  // --gradient-checkpointing [POLICY], read by checkpoint_policy().
  bool checkpointing = false;
  std::string checkpoint_policy;
  // As `tessera train` takes it: a run saves a checkpoint unless "no" (then the save phase
  // is still predicted, but the peak leaves it out).
  std::string save_strategy = "steps";
};

// The policy of --gradient-checkpointing (full when given without a value, none when absent),
// refused naming the flag and the value when it is not one or cannot apply to --n-layer.
nn::CheckpointPolicy checkpoint_policy(const PlanArgs& a) {
  if (!a.checkpointing) return {};
  try {
    const nn::CheckpointPolicy policy =
        nn::CheckpointPolicy::parse(a.checkpoint_policy.empty() ? "full" : a.checkpoint_policy);
    policy.check_model(a.n_layer);
    return policy;
  } catch (const Error& e) {
    TESSERA_FAIL("tessera plan: --gradient-checkpointing: ", e.what());
  }
}

// The dry run builds every block's modules (microseconds each): a bound that answers at
// once, far above any published model's few hundred layers.
constexpr int64_t kMaxLayers = 10000;

double gib(int64_t bytes) { return static_cast<double>(bytes) / double(1 << 30); }

// Bytes of "80GiB", "79.5 GiB", "80GB" (10^9), "81920MiB", "512MB", "85899345920".
int64_t parse_memory_size(const std::string& text) {
  size_t used = 0;
  double value = -1;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
  }
  std::string unit;
  for (char c : text.substr(used))
    if (!std::isspace(static_cast<unsigned char>(c))) unit += static_cast<char>(std::toupper(c));
  const std::pair<const char*, double> units[] = {{"", 1},
                                                  {"B", 1},
                                                  {"KB", 1e3},
                                                  {"MB", 1e6},
                                                  {"GB", 1e9},
                                                  {"TB", 1e12},
                                                  {"KIB", 1024},
                                                  {"MIB", 1024.0 * 1024},
                                                  {"GIB", double(1 << 30)},
                                                  {"TIB", double(int64_t(1) << 40)}};
  for (const auto& [name, scale] : units)
    if (unit == name && value > 0 && std::isfinite(value))
      return static_cast<int64_t>(std::llround(value * scale));
  TESSERA_CHECK(false, "tessera plan: --max-memory '", text,
                "' is not a memory size (a positive number with GiB, GB, MiB, MB or bytes, e.g. "
                "80GiB)");
  return 0;
}

struct Capacity {
  int64_t bytes;
  std::string source;
};

Capacity device_capacity(const PlanArgs& a) {
  if (!a.max_memory.empty()) return {parse_memory_size(a.max_memory), "--max-memory"};
  if (a.card_gib > 0) return {static_cast<int64_t>(a.card_gib * double(1 << 30)), "--card-gib"};
  if (a.device == "cuda" && cuda_device_count() > 0)
    if (const auto stats = device_memory_stats(Device::cuda(0)); stats && stats->total_bytes > 0)
      return {static_cast<int64_t>(stats->total_bytes), "cuda:0's memory"};
  return {int64_t(80) << 30, "no device here: an 80 GiB card (set --max-memory)"};
}

// "fits a 80 GiB card (12.3 GiB to spare)" / "does NOT fit a 80 GiB card (over by 3.1 GiB)".
std::string verdict(int64_t peak, int64_t capacity) {
  char text[160];
  const double card = std::round(gib(capacity) * 100) / 100;
  if (peak <= capacity)
    std::snprintf(text, sizeof(text), "fits a %g GiB card (%.3f GiB to spare)", card,
                  gib(capacity - peak));
  else
    std::snprintf(text, sizeof(text), "does NOT fit a %g GiB card (over by %.3f GiB)", card,
                  gib(peak - capacity));
  return text;
}

dist::MemoryPlanOptions plan_options(const PlanArgs& a) {
  dist::MemoryPlanOptions o;
  o.model = nn::GPTConfig{.vocab_size = a.vocab,
                          .block_size = a.block_size > 0 ? a.block_size : a.seq,
                          .n_layer = a.n_layer,
                          .n_head = a.n_head,
                          .n_embd = a.n_embd};
  o.zero_stage = a.zero_stage;
  o.world = a.nproc;
  o.hybrid_shard_size = a.hybrid_shard_size;
  o.batch = a.batch;
  o.seq = a.seq;
  o.gradient_accumulation_steps = a.grad_accum;
  o.mixed_precision = a.dtype == "fp32" ? "no" : a.dtype;
  o.reduce_dtype = a.reduce_dtype;
  o.gpu_routes = a.device == "cuda";
  o.stage3_prefetch_bucket_size = a.prefetch;
  o.accumulation = dist::gradient_accumulation_from_name(a.accumulation);
  o.max_buckets_in_flight = static_cast<size_t>(a.max_buckets_in_flight);
  o.bucket_bytes = static_cast<size_t>(a.bucket_bytes);
  o.offload_optimizer = a.offload != "none";
  o.offload_param = a.offload == "param";
  o.gradient_checkpointing = checkpoint_policy(a);
  o.saves_checkpoints = a.save_strategy != "no";
  o.tp_size = a.tp_size;
  o.pp_size = a.pp_size;
  o.pipeline_micro_batches = a.micro_batches;
  return o;
}

// What one step sends over the mesh's axes, as the dry run's collectives were issued.
void print_traffic(const PlanArgs& a, const dist::MemoryPlan& p) {
  if (a.tp_size > 1) {
    const int64_t tokens = a.batch * a.seq * a.grad_accum;
    std::printf(
        "tensor parallel over %d ranks: %lld all-reduces a step (4L + 4 = %lld per micro-batch) "
        "of %lld bytes in all (N·d = %lld tokens x %lld channels each, and the loss's 3N "
        "values); a ring sends about %.0f bytes a rank\n",
        a.tp_size, (long long)p.tp_traffic.collectives, (long long)(4 * a.n_layer + 4),
        (long long)p.tp_traffic.bytes, (long long)tokens / a.grad_accum, (long long)a.n_embd,
        2.0 * (a.tp_size - 1) / a.tp_size * static_cast<double>(p.tp_traffic.bytes));
    std::printf("tp_collectives_per_step %lld\ntp_collective_bytes_per_step %lld\n",
                (long long)p.tp_traffic.collectives, (long long)p.tp_traffic.bytes);
  }
  std::printf("dp_collective_bytes_per_step %lld\n", (long long)p.dp_traffic.bytes);
  std::printf("rank_parameter_bytes %lld\n",
              (long long)p.steady[static_cast<int>(MemoryCategory::Parameters)]);
}

// --pp-size > 1: each stage's kept state and sends (dist::plan_pipeline_stages).
void print_pipeline_plan(const PlanArgs& a) {
  const std::vector<dist::PipelineStagePlan> stages = dist::plan_pipeline_stages(plan_options(a));
  std::printf(
      "plan: GPT %lld layers, %lld heads, %lld channels, vocab %lld in %d pipeline stages "
      "(x %d dp replicas, %s), %s, %lldx%lld rows a rank in %d micro-batches\n",
      (long long)a.n_layer, (long long)a.n_head, (long long)a.n_embd, (long long)a.vocab, a.pp_size,
      a.nproc / a.pp_size, a.zero_stage == 0 ? "DDP" : ("ZeRO-" + std::to_string(a.zero_stage)).c_str(),
      a.dtype.c_str(), (long long)a.batch, (long long)a.seq, a.micro_batches);
  std::printf("%-8s %8s %12s %12s %12s %12s %14s %10s %14s\n", "stage", "blocks", "parameters",
              "params GiB", "grads GiB", "optim GiB", "sends a step", "bytes", "tied all-red.");
  for (const dist::PipelineStagePlan& s : stages) {
    const std::string blocks =
        std::to_string(s.blocks_begin) + ".." + std::to_string(s.blocks_end - 1);
    std::printf("%-8d %8s %12lld %12.3f %12.3f %12.3f %14lld %10lld %14lld\n", s.stage,
                blocks.c_str(), (long long)s.parameters, gib(s.parameter_bytes),
                gib(s.gradient_bytes), gib(s.optimizer_bytes), (long long)s.sends.collectives,
                (long long)s.sends.bytes, (long long)s.tied_all_reduce_bytes);
  }
  for (const dist::PipelineStagePlan& s : stages)
    std::printf("stage_bytes_by_category %d %lld %lld %lld\nstage_send_bytes_per_step %d %lld\n",
                s.stage, (long long)s.parameter_bytes, (long long)s.gradient_bytes,
                (long long)s.optimizer_bytes, s.stage, (long long)s.sends.bytes);
}

void print_header(const PlanArgs& a, int64_t psi) {
  std::printf(
      "plan: GPT %lld layers, %lld heads, %lld channels, vocab %lld: psi = %lld parameters\n",
      (long long)a.n_layer, (long long)a.n_head, (long long)a.n_embd, (long long)a.vocab,
      (long long)psi);
}

// ZeRO's formula as the paper writes it, e.g. "2Ψ + 14Ψ/W" for stage 2 with bf16 Adam.
std::string formula_text(const PlanArgs& a) {
  const int p = a.dtype == "fp32" ? 4 : 2;
  const int k = a.dtype == "fp32" ? 2 * p : 12;  // Adam's moments (+ f32 masters)
  const int whole[] = {p + p + k, p + p, p, 0};
  const int sharded[] = {0, k, p + k, p + p + k};
  std::string text;
  const int s = a.zero_stage;
  if (whole[s] > 0) text = std::to_string(whole[s]) + "Ψ";
  // Hybrid sharding divides by the shard group's size S rather than the world's.
  if (sharded[s] > 0)
    text += (text.empty() ? "" : " + ") + std::to_string(sharded[s]) +
            (a.hybrid_shard_size > 0 ? "Ψ/S" : "Ψ/W");
  return text;
}

// The peak by the terms of ZeRO's analysis: the state a rank keeps (its shard), the
// activations, what is gathered or being reduced, and the full gradient buckets in flight.
void print_terms(const PlanArgs& a, const dist::MemoryPlan& p) {
  const dist::MemoryPlan::Terms t = p.terms();
  std::printf("terms of the peak per rank (GiB):\n");
  std::printf("  %-20s parameters %.3f, gradients %.3f, optimizer %.3f = %.3f"
              " (ZeRO's formula %s = %.3f)\n",
              "kept state", gib(t.shard_parameters), gib(t.shard_gradients), gib(t.optimizer),
              gib(t.shard_parameters + t.shard_gradients + t.optimizer), formula_text(a).c_str(),
              gib(p.formula.total()));
  std::printf("  %-20s %.3f\n", "activations", gib(t.activations));
  std::printf("  %-20s %.3f", "gathered / reducing", gib(t.gathered_units));
  if (p.largest_unit_bytes > 0)
    std::printf(" (two gathered units: %.3f)", gib(2 * p.largest_unit_bytes));
  std::printf("\n  %-20s %.3f", "buckets in flight", gib(t.buckets_in_flight));
  if (p.max_buckets_in_flight > 0)
    std::printf(" (at most %zu x the largest bucket, %.3f: %.3f)", p.max_buckets_in_flight,
                gib(p.largest_bucket_bytes),
                gib(static_cast<int64_t>(p.max_buckets_in_flight) * p.largest_bucket_bytes));
  std::printf("\n  %-20s %.3f\n", "other", gib(t.other));
  std::printf("  %-20s %.3f GiB at the steps' peak; %.3f GiB while the model is built %s\n", "sum",
              gib(p.step_peak), gib(p.setup_peak),
              p.sharded_construction ? "by sharded construction (each rank its slices)"
                                     : "in f32 and sharded");
  if (a.zero_stage == 3) {
    const int64_t bound = p.expected_stage3_bound();
    std::printf("  formula + activations + two units + buckets in flight = %.3f GiB; "
                "steps' peak / that = %.3f\n",
                gib(bound), static_cast<double>(p.step_peak) / static_cast<double>(bound));
  }
}

void print_plan(const PlanArgs& a, const dist::MemoryPlan& p, const Capacity& capacity) {
  print_header(a, p.psi);
  std::printf("      %s on %d process(es), %s, %lldx%lld rows x %d micro-batches, %s routes, "
              "gradient checkpointing %s\n",
              p.strategy.c_str(), a.nproc, a.dtype.c_str(), (long long)a.batch, (long long)a.seq,
              a.grad_accum, a.device.c_str(), checkpoint_policy(a).name().c_str());
  std::printf("%-22s %12s %12s %12s %12s %14s %10s %12s\n", "per rank (GiB)", "parameters",
              "gradients", "optimizer", "activations", "communication", "other", "total");
  auto row = [](const char* label, const std::array<int64_t, kNumMemoryCategories>& b,
                int64_t total) {
    using C = MemoryCategory;
    auto at = [&](C c) { return gib(b[static_cast<int>(c)]); };
    std::printf("%-22s %12.3f %12.3f %12.3f %12.3f %14.3f %10.3f %12.3f\n", label,
                at(C::Parameters), at(C::Gradients), at(C::OptimizerState), at(C::Activations),
                at(C::Communication), at(C::Other), gib(total));
  };
  row("predicted peak", p.at_peak, p.peak);
  // The two phases apart: the construction (the f32 model before the cast and the sharding,
  // or under stage 3 the shard alone) can be the higher point (ZeRO-1/2 on many ranks).
  row("  construction", p.setup_at_peak, p.setup_peak);
  row("  steps' peak", p.step_at_peak, p.step_peak);
  // A checkpoint written between steps (rank 0's, which also streams the model's shards).
  row(a.save_strategy == "no" ? "  save (not run)" : "  save", p.save_at_peak, p.save_peak);
  std::array<int64_t, kNumMemoryCategories> formula{};
  formula[static_cast<int>(MemoryCategory::Parameters)] = p.formula.parameters;
  formula[static_cast<int>(MemoryCategory::Gradients)] = p.formula.gradients;
  formula[static_cast<int>(MemoryCategory::OptimizerState)] = p.formula.optimizer;
  row("ZeRO formula", formula, p.formula.total());
  if (p.host_peak > 0)
    std::printf("host memory per rank (offloaded): %.3f GiB\n", gib(p.host_peak));
  print_terms(a, p);
  std::printf("peak %.3f GiB per rank: %s [%s]\n", gib(p.peak),
              verdict(p.peak, capacity.bytes).c_str(), capacity.source.c_str());
  std::printf("peak_bytes %lld\n", (long long)p.peak);
  // By category, in the memory report's column order (parameters gradients optimizer
  // activations communication other), for scripts and tests.
  using C = MemoryCategory;
  auto by_category = [](const char* name, const std::array<int64_t, kNumMemoryCategories>& b) {
    std::printf("%s", name);
    for (C c : {C::Parameters, C::Gradients, C::OptimizerState, C::Activations, C::Communication,
                C::Other})
      std::printf(" %lld", (long long)b[static_cast<int>(c)]);
    std::printf("\n");
  };
  by_category("peak_bytes_by_category", p.at_peak);
  by_category("construction_peak_bytes_by_category", p.setup_at_peak);
  by_category("step_peak_bytes_by_category", p.step_at_peak);
  by_category("save_peak_bytes_by_category", p.save_at_peak);
  std::printf("step_peak_bytes %lld\nsetup_peak_bytes %lld\nsave_peak_bytes %lld\n",
              (long long)p.step_peak, (long long)p.setup_peak, (long long)p.save_peak);
  std::printf("buckets_in_flight_bound_bytes %lld\nshard_gradient_bytes %lld\n",
              (long long)(static_cast<int64_t>(p.max_buckets_in_flight) * p.largest_bucket_bytes),
              (long long)p.terms().shard_gradients);
  std::printf("largest_bucket_bytes %lld\nlargest_unit_bytes %lld\n",
              (long long)p.largest_bucket_bytes, (long long)p.largest_unit_bytes);
}

// The strategies a plan compares (--all-strategies, --fit), in the order of their memory.
struct Strategy {
  const char* name;
  int stage;
  const char* offload;
};
constexpr Strategy kStrategies[] = {{"DDP", 0, "none"},
                                    {"ZeRO-1", 1, "none"},
                                    {"ZeRO-2", 2, "none"},
                                    {"ZeRO-3", 3, "none"},
                                    {"ZeRO-3 + offload optimizer", 3, "optimizer"},
                                    {"ZeRO-3 + offload param", 3, "param"}};

// Every strategy for the same model, run and device: one dry run each.
void print_all_strategies(PlanArgs a, const Capacity& capacity) {
  bool header = false;
  for (const Strategy& r : kStrategies) {
    a.zero_stage = r.stage;
    a.offload = r.offload;
    const dist::MemoryPlan p = dist::plan_memory(plan_options(a));
    if (!header) {
      print_header(a, p.psi);
      std::printf(
          "      %d process(es), %s, %lldx%lld rows x %d micro-batches, %s routes, gradient "
          "checkpointing %s; device memory %.2f GiB (%s)\n",
          a.nproc, a.dtype.c_str(), (long long)a.batch, (long long)a.seq, a.grad_accum,
          a.device.c_str(), checkpoint_policy(a).name().c_str(), gib(capacity.bytes),
          capacity.source.c_str());
      std::printf("%-28s %16s %14s  %s\n", "strategy", "peak GiB/rank", "host GiB/rank", "verdict");
      header = true;
    }
    std::printf("%-28s %16.3f %14.3f  %s\n", r.name, gib(p.peak), gib(p.host_peak),
                verdict(p.peak, capacity.bytes).c_str());
    std::fflush(stdout);
  }
}

// DeepSpeed's estimator of the model states' memory per GPU for the same setting, on one node
// (deepspeed.runtime.zero's estimate_zero2_model_states_mem_needs and
// estimate_zero3_model_states_mem_needs; it assumes fp16/bf16 training with Adam and counts no
// activations): ZeRO-2 4Ψ + 16Ψ/W; ZeRO-3 4 x the largest layer + 18Ψ/W, with the optimizer
// offloaded + 2Ψ/W, with the parameters offloaded too the largest layer alone. None for DDP
// and ZeRO-1, which it does not estimate. The largest layer is the module with the most
// parameters of its own: the token embedding, or a block's MLP input projection.
std::optional<int64_t> deepspeed_estimate(const Strategy& s, const PlanArgs& a, int64_t psi) {
  const int64_t block_size = a.block_size > 0 ? a.block_size : a.seq;
  const int64_t largest_layer = std::max({a.vocab * a.n_embd, 4 * a.n_embd * a.n_embd + 4 * a.n_embd,
                                          block_size * a.n_embd});
  const int64_t w = a.nproc;
  if (s.stage == 2) return 4 * psi + 16 * psi / w;
  if (s.stage != 3) return std::nullopt;
  const std::string offload = s.offload;
  if (offload == "param") return 4 * largest_layer;
  if (offload == "optimizer") return 4 * largest_layer + 2 * psi / w;
  return 4 * largest_layer + 18 * psi / w;
}

// The largest n in [1, kMaxLayers] whose plan fits `capacity` (0 when one block does not),
// by dry runs, assuming the peak never falls as blocks are added. The peak grows by about the
// same bytes with each block, so the line through the last two plans places the answer and
// two more plans (it fits, one block more does not) usually confirm it; a guess that does not
// at least halve the bracket once a plan has failed is followed by its midpoint, so a few plans
// run, not one per block (a plan
// costs time in proportion to its depth: walking one block at a time from a poor guess took
// most of an hour at 5120 channels).
int64_t deepest_fit(const std::function<const dist::MemoryPlan&(int64_t)>& plan, int64_t capacity) {
  if (plan(1).peak > capacity) return 0;
  int64_t lo = 1, hi = kMaxLayers + 1;  // plan(lo) fits; plan(hi) does not (or hi is past the cap)
  int64_t a = 1, b = 2;                 // the two most recent plans, for the line
  while (hi - lo > 1) {
    const double slope = std::max(1.0, double(plan(b).peak - plan(a).peak) / double(b - a));
    const double line = double(lo) + double(capacity - plan(lo).peak) / slope;
    int64_t guess = static_cast<int64_t>(std::min(line, double(kMaxLayers)));
    const int64_t width = hi - lo;
    guess = std::clamp<int64_t>(guess, lo + 1, hi - 1);
    // The line's guess, and the block after it (a hit's confirmation); once a plan has failed,
    // the midpoint when the guess left more than half of the bracket.
    for (int64_t n : {guess, guess + 1}) {
      if (n <= lo || n >= hi) continue;
      (plan(n).peak <= capacity ? lo : hi) = n;
      a = b;
      b = n;
      if (plan(n).peak > capacity) break;
    }
    if (hi <= kMaxLayers && hi - lo > 1 && 2 * (hi - lo) > width) {
      const int64_t mid = lo + (hi - lo) / 2;
      (plan(mid).peak <= capacity ? lo : hi) = mid;
      a = b;
      b = mid;
    }
  }
  return lo;
}

// --fit: for each strategy the deepest GPT of the given width (heads, vocabulary, run and
// device) whose planned peak fits the device (deepest_fit: the last that fits, the next that
// does not).
void print_fits(PlanArgs a, const Capacity& capacity) {
  std::printf("plan --fit: the deepest GPT of %lld channels, %lld heads, vocab %lld that fits %.2f GiB (%s)\n"
              "      on %d process(es), %s, %lldx%lld rows x %d micro-batches, %s routes, gradient "
              "checkpointing %s; by dry runs\n",
              (long long)a.n_embd, (long long)a.n_head, (long long)a.vocab, gib(capacity.bytes),
              capacity.source.c_str(), a.nproc, a.dtype.c_str(), (long long)a.batch, (long long)a.seq,
              a.grad_accum, a.device.c_str(), checkpoint_policy(a).name().c_str());
  std::printf("%-28s %8s %16s %16s %26s\n", "strategy", "layers", "parameters", "peak GiB/rank",
              "DeepSpeed estimator GiB/GPU");
  for (const Strategy& s : kStrategies) {
    a.zero_stage = s.stage;
    a.offload = s.offload;
    std::map<int64_t, dist::MemoryPlan> plans;  // by depth: each dry run once
    const auto plan = [&](int64_t layers) -> const dist::MemoryPlan& {
      auto it = plans.find(layers);
      if (it == plans.end()) {
        PlanArgs at = a;
        at.n_layer = layers;
        it = plans.emplace(layers, dist::plan_memory(plan_options(at))).first;
      }
      return it->second;
    };
    const int64_t layers = deepest_fit(plan, capacity.bytes);
    if (layers == 0) {
      std::printf("%-28s %8s %16s %16.3f %26s\n", s.name, "none", "-", gib(plan(1).peak), "-");
      continue;
    }
    const dist::MemoryPlan& at = plan(layers);
    const std::optional<int64_t> ds = deepspeed_estimate(s, a, at.psi);
    char estimate[32] = "-";
    if (ds) std::snprintf(estimate, sizeof(estimate), "%.3f", gib(*ds));
    std::printf("%-28s %8lld %16lld %16.3f %26s\n", s.name, (long long)layers, (long long)at.psi,
                gib(at.peak), estimate);
    std::fflush(stdout);
  }
  std::printf("(the estimator counts the model states alone, as DeepSpeed's does: no activations, "
              "buffers or construction)\n");
}

const RegisterCommand reg(
    "plan", "Predict each rank's peak memory for a GPT training step (a size-only dry run)",
    [](CLI::App& sub) {
      auto a = std::make_shared<PlanArgs>();
      sub.add_option("--n-layer", a->n_layer, "transformer blocks (default 12)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--n-head", a->n_head, "attention heads (default 12)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--n-embd", a->n_embd, "channels (default 768)")->check(CLI::PositiveNumber);
      sub.add_option("--vocab", a->vocab, "vocabulary size (default 50304)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--block-size", a->block_size, "context length (default: --seq)");
      sub.add_option("--zero-stage", a->zero_stage, "0 = DDP, 1, 2 or 3 (default 0)")
          ->check(CLI::Range(0, 3));
      sub.add_option("--offload", a->offload,
                     "ZeRO-Offload: none | optimizer (stage >= 1) | param (stage 3)")
          ->check(CLI::IsMember({"none", "optimizer", "param"}));
      sub.add_option("--nproc", a->nproc, "processes (one per GPU; default 1)")
          ->check(CLI::PositiveNumber);
      CLI::Option* hybrid = sub.add_option(
          "--hybrid-shard-size", a->hybrid_shard_size,
          "hybrid sharding (stages 2/3): shard within groups of this many of the --nproc ranks, "
          "replicate across the groups");
      sub.add_option("--batch", a->batch, "rows per micro-batch and process (default 8)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--seq", a->seq, "tokens per row (default 1024)")->check(CLI::PositiveNumber);
      sub.add_option("--grad-accum", a->grad_accum, "micro-batches per step (default 1)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--dtype", a->dtype, "fp32 | bf16 | fp16 (default fp32)")
          ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
      sub.add_option("--reduce-dtype", a->reduce_dtype,
                     "dtype gradients are averaged in: fp32 | the --dtype (default: bf16 for bf16, else fp32)")
          ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
      sub.add_option("--device", a->device,
                     "cuda: take a GPU's routes (flash attention, fused classifier); cpu: the "
                     "CPU's (default cuda)")
          ->check(CLI::IsMember({"cuda", "cpu"}));
      CLI::Option* prefetch = sub.add_option(
          "--prefetch", a->prefetch, "stage 3: elements gathered ahead of use (default: the Accelerator's)");
      sub.add_option("--zero-accumulation", a->accumulation,
                     "ZeRO-2/3 with --grad-accum: reduce_every_micro_batch (default) | no_sync")
          ->check(CLI::IsMember({"reduce_every_micro_batch", "no_sync"}));
      sub.add_option("--max-buckets-in-flight", a->max_buckets_in_flight,
                     "ZeRO-2/3: full gradient buckets a backward holds at once (default " +
                         std::to_string(dist::kDefaultBucketsInFlight) + "; 0: no bound)")
          ->check(CLI::NonNegativeNumber);
      sub.add_option("--bucket-bytes", a->bucket_bytes,
                     "gradient bucket size in bytes (default " +
                         std::to_string(dist::kDefaultBucketBytes >> 20) +
                         " MiB; DeepSpeed's reduce_bucket_size x 4)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--max-memory,--device-memory", a->max_memory,
                     "memory of one device to plan for, e.g. 80GiB, 80GB, 81920MiB (default: "
                     "the first CUDA device's, else 80GiB)");
      sub.add_option("--card-gib", a->card_gib, "the same in GiB (older spelling)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--tp-size", a->tp_size,
                     "device mesh: ranks per tensor-parallel group of the --nproc (the model's "
                     "split dry-run as `tessera train --tp-size` splits it; default 1)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--pp-size", a->pp_size,
                     "device mesh: pipeline stages of the --nproc (each stage's kept state and "
                     "sends; default 1)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--micro-batches", a->micro_batches,
                     "--pp-size > 1: micro-batches each rank's rows are cut into (default 1)")
          ->check(CLI::PositiveNumber);
      sub.add_flag("--all-strategies", a->all_strategies,
                   "plan DDP, ZeRO-1/2/3 and ZeRO-3 with offload, one verdict each");
      sub.add_flag("--fit", a->fit,
                   "for each of those strategies the most --n-layer blocks (of this width) that fit the "
                   "device, next to DeepSpeed's estimator for that model");
      sub.add_option("--save-strategy", a->save_strategy,
                     "as `tessera train` takes it: steps or epoch (the default: a run saves "
                     "checkpoints, at its end at least, so the peak covers the save) | no")
          ->check(CLI::IsMember({"steps", "epoch", "no"}));
      CLI::Option* checkpointing = sub.add_option(
          "--gradient-checkpointing", a->checkpoint_policy,
          "plan the activations of a recompute policy, as `tessera train` takes it: full (the "
          "default when no value is given) | every_k:K | attention | mlp | none")
          ->expected(0, 1);
      sub.callback([a, prefetch, checkpointing, hybrid] {
        a->checkpointing = checkpointing->count() > 0;
        if (hybrid->count() > 0) {
          TESSERA_CHECK(!a->all_strategies && !a->fit,
                        "tessera plan: --hybrid-shard-size plans one "
                        "strategy; drop --all-strategies / --fit");
          dist::check_hybrid_sharding(a->hybrid_shard_size, a->nproc, a->zero_stage,
                                      a->offload != "none", "tessera plan: --hybrid-shard-size");
        }
        TESSERA_CHECK(a->n_layer <= kMaxLayers, "tessera plan: --n-layer ", a->n_layer,
                      " is more than the ", kMaxLayers, " blocks a plan builds (each one's modules are "
                      "built for the dry run)");
        TESSERA_CHECK(prefetch->count() == 0 || a->prefetch >= 0, "tessera plan: --prefetch must not be "
                      "negative (elements gathered ahead of use), got ", a->prefetch);
        TESSERA_CHECK(a->n_embd % a->n_head == 0, "tessera plan: --n-head ", a->n_head,
                      " must divide --n-embd ", a->n_embd);
        TESSERA_CHECK(a->all_strategies || a->fit || a->offload == "none" || a->zero_stage >= 1,
                      "tessera plan: --offload ", a->offload, " needs --zero-stage 1-3");
        TESSERA_CHECK(a->all_strategies || a->fit || a->offload != "param" || a->zero_stage == 3,
                      "tessera plan: --offload param needs --zero-stage 3");
        checkpoint_policy(*a);  // a bad policy is refused before any dry run
        TESSERA_CHECK((a->tp_size == 1 && a->pp_size == 1) || (!a->all_strategies && !a->fit),
                      "tessera plan: --tp-size/--pp-size plan one mesh; drop --all-strategies / "
                      "--fit");
        TESSERA_CHECK(a->pp_size == 1 || a->grad_accum == 1, "tessera plan: --pp-size ", a->pp_size,
                      ": a pipeline's micro-batches are its accumulation; use "
                      "--micro-batches instead of --grad-accum ",
                      a->grad_accum);
        const Capacity capacity = device_capacity(*a);
        TESSERA_CHECK(!(a->fit && a->all_strategies), "tessera plan: --fit and --all-strategies are two "
                      "reports; ask for one");
        if (a->fit)
          print_fits(*a, capacity);
        else if (a->all_strategies)
          print_all_strategies(*a, capacity);
        else if (a->pp_size > 1) {
          // Each stage's kept state; then rank 0's stage (the first) through a dry run of its
          // schedule, by category, activations included.
          print_pipeline_plan(*a);
          std::printf("rank 0, pipeline stage 0, its step as the dry run ran it:\n");
          const dist::MemoryPlan plan = dist::plan_memory(plan_options(*a));
          print_plan(*a, plan, capacity);
        } else {
          const dist::MemoryPlan plan = dist::plan_memory(plan_options(*a));
          print_plan(*a, plan, capacity);
          print_traffic(*a, plan);
        }
        // The dry run allocates nothing for real: its own footprint shows it.
        rusage usage{};
        getrusage(RUSAGE_SELF, &usage);
        std::printf("dry run: this process used at most %.0f MiB of memory\n",
                    static_cast<double>(usage.ru_maxrss) / 1024.0);
      });
    });

}  // namespace
}  // namespace tessera::cli
