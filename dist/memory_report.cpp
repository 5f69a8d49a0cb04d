#include "tessera/dist/memory_report.h"

#include <cstdio>
#include <sstream>

namespace tessera::dist {

ZeroMemoryFormula zero_memory_formula(int64_t psi, int64_t param_bytes, bool f32_masters, int stage,
                                      int world) {
  const double w = world;
  auto share = [&](double bytes, bool sharded) {
    return static_cast<int64_t>(sharded ? bytes / w : bytes);
  };
  const double optimizer = static_cast<double>(psi) * (f32_masters ? 12 : 2 * param_bytes);
  return {share(static_cast<double>(param_bytes * psi), stage >= 3),
          share(static_cast<double>(param_bytes * psi), stage >= 2), share(optimizer, stage >= 1)};
}

namespace {

std::string mib(int64_t bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f", static_cast<double>(bytes) / (1 << 20));
  return text;
}

void row(std::ostringstream& os, const std::string& label,
         const std::array<int64_t, kNumMemoryCategories>& b, int64_t total) {
  char line[256];
  using C = MemoryCategory;
  auto at = [&](C c) { return mib(b[static_cast<int>(c)]); };
  std::snprintf(line, sizeof line, "%-20s %11s %11s %11s %13s %13s %9s %11s\n", label.c_str(),
                at(C::Parameters).c_str(), at(C::Gradients).c_str(), at(C::OptimizerState).c_str(),
                at(C::Activations).c_str(), at(C::Communication).c_str(), at(C::Other).c_str(),
                mib(total).c_str());
  os << line;
}

}  // namespace

std::string format_memory_report(const MemoryReportHeader& h, const std::vector<RankMemory>& ranks,
                                 const ZeroMemoryFormula& formula,
                                 const std::vector<MemoryPhase>& phases) {
  std::ostringstream os;
  os << "memory per rank (MiB) under " << h.strategy << " on " << h.world
     << " process(es), psi = " << h.psi << " parameters, " << h.precision << "\n";
  char head[256];
  std::snprintf(head, sizeof head, "%-20s %11s %11s %11s %13s %13s %9s %11s\n", "", "parameters",
                "gradients", "optimizer", "activations", "communication", "other", "total");
  os << head;
  for (const MemoryPhase& phase : phases)
    for (size_t r = 0; r < phase.ranks.size(); ++r)
      row(os, "rank " + std::to_string(r) + " " + phase.name, phase.ranks[r].at_peak,
          phase.ranks[r].peak);
  for (size_t r = 0; r < ranks.size(); ++r) {
    int64_t now = 0;
    for (int64_t b : ranks[r].now) now += b;
    row(os, "rank " + std::to_string(r) + " now", ranks[r].now, now);
    row(os, "rank " + std::to_string(r) + " peak", ranks[r].at_peak, ranks[r].peak);
  }
  std::array<int64_t, kNumMemoryCategories> f{};
  f[static_cast<int>(MemoryCategory::Parameters)] = formula.parameters;
  f[static_cast<int>(MemoryCategory::Gradients)] = formula.gradients;
  f[static_cast<int>(MemoryCategory::OptimizerState)] = formula.optimizer;
  row(os, "ZeRO formula", f, formula.total());
  return os.str();
}

}  // namespace tessera::dist
