// `tessera plan`: each rank's peak memory for training a GPT at a ZeRO stage on N processes,
// predicted by a size-only dry run of two real optimizer steps (dist/memory_plan.h), next to
// ZeRO's formula, and whether it fits a card of --card-gib.
#include <cstdio>
#include <memory>

#include "tessera/cli/command.h"
#include "tessera/core/error.h"
#include "tessera/dist/memory_plan.h"

namespace tessera::cli {
namespace {

struct PlanArgs {
  int64_t n_layer = 12, n_head = 12, n_embd = 768, vocab = 50304, block_size = 0;
  int zero_stage = 0, nproc = 1, grad_accum = 1;
  int64_t batch = 8, seq = 1024;
  std::string dtype = "fp32", device = "cuda";
  double card_gib = 80;
  int64_t prefetch = -1;
};

double gib(int64_t bytes) { return static_cast<double>(bytes) / double(1 << 30); }

void print_plan(const PlanArgs& a, const dist::MemoryPlan& p) {
  std::printf(
      "plan: GPT %lld layers, %lld heads, %lld channels, vocab %lld: psi = %lld parameters\n",
      (long long)a.n_layer, (long long)a.n_head, (long long)a.n_embd, (long long)a.vocab,
      (long long)p.psi);
  std::printf("      %s on %d process(es), %s, %lldx%lld rows x %d micro-batches, %s routes\n",
              p.strategy.c_str(), a.nproc, a.dtype.c_str(), (long long)a.batch, (long long)a.seq,
              a.grad_accum, a.device.c_str());
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
  std::array<int64_t, kNumMemoryCategories> formula{};
  formula[static_cast<int>(MemoryCategory::Parameters)] = p.formula.parameters;
  formula[static_cast<int>(MemoryCategory::Gradients)] = p.formula.gradients;
  formula[static_cast<int>(MemoryCategory::OptimizerState)] = p.formula.optimizer;
  row("ZeRO formula", formula, p.formula.total());
  const bool fits = gib(p.peak) <= a.card_gib;
  std::printf("peak %.3f GiB per rank: %s a %.0f GiB card\n", gib(p.peak),
              fits ? "fits" : "does NOT fit", a.card_gib);
  std::printf("peak_bytes %lld\n", (long long)p.peak);
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
      sub.add_option("--nproc", a->nproc, "processes (one per GPU; default 1)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--batch", a->batch, "rows per micro-batch and process (default 8)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--seq", a->seq, "tokens per row (default 1024)")->check(CLI::PositiveNumber);
      sub.add_option("--grad-accum", a->grad_accum, "micro-batches per step (default 1)")
          ->check(CLI::PositiveNumber);
      sub.add_option("--dtype", a->dtype, "fp32 | bf16 | fp16 (default fp32)")
          ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
      sub.add_option("--device", a->device,
                     "cuda: take a GPU's routes (flash attention, fused classifier); cpu: the "
                     "CPU's (default cuda)")
          ->check(CLI::IsMember({"cuda", "cpu"}));
      sub.add_option("--prefetch", a->prefetch,
                     "stage 3: elements gathered ahead of use (default: the Accelerator's)");
      sub.add_option("--card-gib", a->card_gib, "memory of one card in GiB (default 80)")
          ->check(CLI::PositiveNumber);
      sub.callback([a] {
        TESSERA_CHECK(a->n_embd % a->n_head == 0, "tessera plan: --n-head ", a->n_head,
                      " must divide --n-embd ", a->n_embd);
        dist::MemoryPlanOptions o;
        o.model = nn::GPTConfig{.vocab_size = a->vocab,
                                .block_size = a->block_size > 0 ? a->block_size : a->seq,
                                .n_layer = a->n_layer,
                                .n_head = a->n_head,
                                .n_embd = a->n_embd};
        o.zero_stage = a->zero_stage;
        o.world = a->nproc;
        o.batch = a->batch;
        o.seq = a->seq;
        o.gradient_accumulation_steps = a->grad_accum;
        o.mixed_precision = a->dtype == "fp32" ? "no" : a->dtype;
        o.gpu_routes = a->device == "cuda";
        o.stage3_prefetch_bucket_size = a->prefetch;
        print_plan(*a, dist::plan_memory(o));
      });
    });

}  // namespace
}  // namespace tessera::cli
