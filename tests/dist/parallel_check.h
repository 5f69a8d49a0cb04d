// What the model-parallel checks share (dist_tp_check, dist_pp_check: a split model trained
// beside one process) and what their tests read back from the jobs' output.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <regex>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "tessera/autograd/functions.h"
#include "tessera/core/random.h"
#include "tessera/dist/process_group.h"
#include "tessera/nn/module.h"
#include "tessera/optim/adamw.h"

namespace tessera::parallel_check {

// Every parameter moved away from its initial value (0 biases, 1 norms) by N(0, 0.05): every
// path of the forward carries weight.
inline void perturb(nn::Module& model, Generator& gen) {
  autograd::NoGradGuard no_grad;
  for (const Tensor& p : model.parameters())
    ops::copy_(p, ops::add(p, normal(p.shape(), 0.0, 0.05, {.dtype = p.dtype()}, &gen)));
}

// ||got - want||₂ / ||want||₂ in f64: AdamW divides each gradient by its own running
// magnitude, so a single element whose gradient nearly cancels says little; the norm does.
inline double relative_difference(const Tensor& got, const Tensor& want) {
  const auto g = ops::to(got.detach(), Device::cpu(), DType::f64).contiguous().to_vector<double>();
  const auto w = ops::to(want.detach(), Device::cpu(), DType::f64).contiguous().to_vector<double>();
  TESSERA_CHECK(g.size() == w.size(), "parallel_check: ", g.size(), " values against ", w.size());
  double diff = 0, norm = 0;
  for (size_t i = 0; i < w.size(); ++i) diff += (g[i] - w[i]) * (g[i] - w[i]), norm += w[i] * w[i];
  return std::sqrt(diff / std::max(norm, 1e-300));
}

// The largest relative difference noted so far and where (a NaN counts as the largest);
// with `print`, every figure as it is noted.
struct Worst {
  bool print = false;
  double value = 0;
  std::string name = "-";
  void note(const std::string& what, double relative) {
    if (print) std::printf("  %-40s %.3g\n", what.c_str(), relative);
    if (relative > value || std::isnan(relative)) value = relative, name = what;
  }
};

// Notes every parameter of `one` against the same name in `gathered` (a split model's
// full_state_dict), refusing a name missing from it or one too many; returns the count.
inline int note_gathered(const std::map<std::string, Tensor>& gathered, const nn::Module& one,
                         Worst& worst) {
  int tensors = 0;
  for (const auto& [name, want] : one.named_parameters()) {
    auto it = gathered.find(name);
    TESSERA_CHECK(it != gathered.end(), "parallel_check: ", name, " was not gathered");
    worst.note(name, relative_difference(it->second, want)), ++tensors;
  }
  TESSERA_CHECK(gathered.size() == static_cast<size_t>(tensors),
                "parallel_check: ", gathered.size(), " tensors gathered for ", tensors);
  return tensors;
}

// A check program's flags: "--name VALUE" into a string or a number, "--name" alone into a
// bool (set to true). Refuses an unknown flag or one missing its value, naming it.
using FlagTarget = std::variant<std::string*, int*, int64_t*, double*, bool*>;
inline void parse_flags(int argc, char** argv, const std::map<std::string, FlagTarget>& flags) {
  for (int i = 1; i < argc; ++i) {
    auto it = flags.find(argv[i]);
    TESSERA_CHECK(it != flags.end(), "unknown flag ", argv[i]);
    if (bool* const* on = std::get_if<bool*>(&it->second)) {
      **on = true;
      continue;
    }
    TESSERA_CHECK(i + 1 < argc, "flag ", argv[i], " needs a value");
    const std::string value = argv[++i];
    std::visit(
        [&](auto* target) {
          using T = std::remove_pointer_t<decltype(target)>;
          if constexpr (std::is_same_v<T, std::string>)
            *target = value;
          else if constexpr (std::is_same_v<T, double>)
            *target = std::stod(value);
          else if constexpr (!std::is_same_v<T, bool>)
            *target = static_cast<T>(std::stoll(value));
        },
        it->second);
  }
}

// Step `step`'s batch, the same on every rank: `rows` x `tokens` inputs and targets drawn
// from `vocab` by a generator seeded with 7000 + step.
inline std::pair<Tensor, Tensor> random_batch(int step, int64_t rows, int64_t tokens,
                                              int64_t vocab) {
  Generator gen(7000 + step);
  return {randint(0, vocab, {rows, tokens}, {.dtype = DType::i64}, &gen),
          randint(0, vocab, {rows, tokens}, {.dtype = DType::i64}, &gen)};
}

// A check program's main: joins the job, runs `check` (its exit status) on the world, prints an
// error as "rank R: refused: MESSAGE" (status 2) and leaves the job.
inline int run_on_every_rank(const std::function<int(dist::ProcessGroup&)>& check) {
  dist::init_process_group();
  dist::ProcessGroup& world = dist::world();
  int status = 0;
  try {
    status = check(world);
  } catch (const std::exception& e) {
    std::printf("rank %d: refused: %s\n", world.rank(), e.what());
    status = 2;
  }
  std::fflush(stdout);
  dist::destroy_process_group();
  return status;
}

// The checks' optimizer: AdamW with weight decay 0.1.
inline optim::AdamW adamw(const std::vector<Tensor>& params, double lr, double eps) {
  return optim::AdamW(params, {.lr = lr, .eps = eps, .weight_decay = 0.1});
}

// How often `what` stands in `text`.
inline int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// The largest "largest relative difference X" any rank printed (0 when none did).
inline double largest_difference_printed(const std::string& output) {
  double worst = 0;
  const std::regex figure("largest relative difference ([0-9.e+-]+) in (\\S+)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), figure);
       it != std::sregex_iterator(); ++it)
    worst = std::max(worst, std::stod((*it)[1]));
  return worst;
}

}  // namespace tessera::parallel_check
