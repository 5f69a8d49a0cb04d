// Checkpoints of a device mesh's split models (dist/checkpoint.h): the optimizer state in the
// full model's format, gathered as each parameter is cut, and a rank's pieces of it.
#include <set>

#include "tessera/dist/checkpoint.h"
#include "tessera/dist/ddp.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

namespace {
// "state.12.exp_avg" -> {12, "exp_avg"}; {npos, ""} for keys of no parameter.
std::pair<size_t, std::string> parameter_key(const std::string& key) {
  return optim::parse_optimizer_state_key(key).value_or(std::pair{std::string::npos, ""});
}
}  // namespace

optim::OptimizerStateDict gather_full_optimizer_state(const optim::Optimizer& optimizer,
                                                      const std::vector<std::string>& names,
                                                      const MeshParallelModel& model,
                                                      const std::vector<std::string>& full_names) {
  return gather_full_optimizer_state(optimizer.state_dict(), names, model, full_names);
}

optim::OptimizerStateDict whole_state_of_slices(
    const optim::OptimizerStateDict& local,
    const std::vector<DataParallelStrategy::OptimizerSlice>& slices, const nn::Module& module,
    ProcessGroup& group, std::vector<std::string>& names) {
  const auto [trainable, trainable_names] = trainable_parameters(module);
  names = trainable_names;
  std::map<std::string, Tensor> parameters;
  for (size_t k = 0; k < names.size(); ++k) parameters.emplace(names[k], trainable[k]);
  // field -> parameter -> this rank's slices in place, zeros elsewhere; every rank's fields
  // (each rank holds a slice of some parameter, and every slice the same fields).
  std::map<std::string, std::map<std::string, Tensor>> whole;
  optim::OptimizerStateDict out;
  std::set<double> steps;
  for (const auto& [key, value] : local.scalars) {
    const auto [k, field] = parameter_key(key);
    if (k == std::string::npos)
      out.scalars[key] = value;  // the groups' lr and weight decay
    else
      steps.insert(value);
  }
  for (const auto& [key, t] : local.tensors) {
    const auto [k, field] = parameter_key(key);
    TESSERA_CHECK(k < slices.size(), "whole_state_of_slices: unexpected tensor ", key);
    const DataParallelStrategy::OptimizerSlice& slice = slices[k];
    const Tensor& p = parameters.at(slice.name);
    Tensor& flat = whole[field][slice.name];
    if (!flat.defined()) flat = zeros({p.numel()}, {.dtype = t.dtype(), .device = t.device()});
    ops::copy_(ops::narrow(flat, 0, slice.begin, slice.numel), ops::reshape(t, {slice.numel}));
  }
  TESSERA_CHECK(steps.size() <= 1, "whole_state_of_slices: this rank's slices were stepped ",
                steps.empty() ? 0 : *steps.begin(), " to ", steps.empty() ? 0 : *steps.rbegin(),
                " times");
  // Every rank must hold the same fields for the sums below to pair up: refused on every rank
  // alike when one holds fewer (a rank whose slices are all padding holds none).
  Tensor fields = from_vector(std::vector<double>{double(whole.size()), -double(whole.size())}, {2},
                              {.dtype = DType::f64});
  group.all_reduce(fields, ReduceOp::Max)->wait();
  const std::vector<double> most = fields.to_vector<double>();
  TESSERA_CHECK(most[0] == -most[1], "whole_state_of_slices: the ranks of the dp axis hold ",
                -most[1], " to ", most[0],
                " optimizer fields (a rank whose slices are all padding holds none); the model "
                "is too small for this many ranks to checkpoint it under ZeRO");
  // In the fields' and the parameters' order, the same on every rank: the sums pair up.
  for (auto& [field, by_name] : whole) {
    const Tensor like = by_name.begin()->second;  // every slice of a field: one dtype
    for (size_t k = 0; k < names.size(); ++k) {
      const Tensor& p = parameters.at(names[k]);
      Tensor& flat = by_name[names[k]];
      if (!flat.defined())
        flat = zeros({p.numel()}, {.dtype = like.dtype(), .device = like.device()});
      group.all_reduce(flat, ReduceOp::Sum)->wait();
      out.tensors[optim::optimizer_state_key(k, field)] = ops::reshape(flat, p.shape());
      if (!steps.empty()) out.scalars[optim::optimizer_state_key(k, "step")] = *steps.begin();
    }
  }
  return out;
}

optim::OptimizerStateDict gather_full_optimizer_state(const optim::OptimizerStateDict& local,
                                                      const std::vector<std::string>& names,
                                                      const MeshParallelModel& model,
                                                      const std::vector<std::string>& full_names) {
  optim::OptimizerStateDict full;
  std::map<std::string, std::map<std::string, Tensor>> pieces;  // field -> parameter -> piece
  std::map<std::string, double> steps;                          // parameter -> step
  for (const auto& [key, value] : local.scalars) {
    const auto [index, field] = parameter_key(key);
    if (index == std::string::npos)
      full.scalars[key] = value;  // the groups' lr and weight decay
    else
      steps[names.at(index)] = value;
  }
  for (const auto& [key, t] : local.tensors) {
    const auto [index, field] = parameter_key(key);
    TESSERA_CHECK(index < names.size(), "gather_full_optimizer_state: unexpected tensor ", key);
    pieces[field][names[index]] = t;
  }
  std::map<std::string, size_t> position;
  for (size_t j = 0; j < full_names.size(); ++j) position[full_names[j]] = j;
  // Fields in name order, the same on every rank (every rank of a mesh run has stepped the
  // same number of times, so the same fields exist everywhere).
  for (const auto& [field, by_name] : pieces)
    for (const auto& [name, whole] : model.gather_full(by_name)) {
      auto at = position.find(name);
      TESSERA_CHECK(at != position.end(), "gather_full_optimizer_state: ", name,
                    " is not a trainable parameter of the full model");
      full.tensors[optim::optimizer_state_key(at->second, field)] = whole;
    }
  // Every rank of a mesh run steps in lock-step, every parameter with a gradient each time: a
  // rank's parameters share one step, which is every other rank's too (checked here, where a
  // rank knows its own; a pipeline stage knows only its parameters').
  std::set<double> distinct;
  for (const auto& [name, step] : steps) distinct.insert(step);
  TESSERA_CHECK(distinct.size() <= 1,
                "gather_full_optimizer_state: this rank's parameters were "
                "stepped ",
                *distinct.begin(), " to ", *distinct.rbegin(),
                " times; a mesh "
                "checkpoint needs every parameter updated on every step");
  for (const auto& entry : full.tensors)
    if (!distinct.empty())
      full.scalars[optim::optimizer_state_key(parameter_key(entry.first).first, "step")] =
          *distinct.begin();
  return full;
}

optim::OptimizerStateDict pieces_of_whole_optimizer_state(
    const optim::OptimizerStateDict& saved, const std::vector<std::string>& saved_names,
    const std::vector<std::string>& names, const MeshParallelModel* model,
    const std::string& where) {
  std::map<std::string, size_t> saved_index;
  for (size_t j = 0; j < saved_names.size(); ++j) saved_index[saved_names[j]] = j;
  optim::OptimizerStateDict mine;
  for (const auto& [key, value] : saved.scalars)
    if (parameter_key(key).first == std::string::npos) mine.scalars[key] = value;
  std::map<size_t, std::vector<std::pair<std::string, Tensor>>> fields;  // saved j -> fields
  for (const auto& [key, t] : saved.tensors) {
    const auto [j, field] = parameter_key(key);
    TESSERA_CHECK(j < saved_names.size(), where, ": tensor \"", key, "\" names parameter ", j,
                  " but ", saved_names.size(), " were saved");
    fields[j].emplace_back(field, t);
  }
  for (size_t k = 0; k < names.size(); ++k) {
    auto at = saved_index.find(names[k]);
    TESSERA_CHECK(at != saved_index.end(), where, ": no optimizer state was saved for ", names[k]);
    const size_t j = at->second;
    auto step = saved.scalars.find(optim::optimizer_state_key(j, "step"));
    if (step == saved.scalars.end()) continue;  // not updated yet when saved
    mine.scalars[optim::optimizer_state_key(k, "step")] = step->second;
    for (const auto& [field, t] : fields[j])
      mine.tensors[optim::optimizer_state_key(k, field)] = model ? model->piece_of(names[k], t) : t;
  }
  return mine;
}

}  // namespace tessera::dist
