// The Accelerator's checkpoint (dist/checkpoint.h): Accelerator::save_state, load_state and
// save_model, the checkpoint folder's layout, and the checks that run before a loaded value
// changes anything.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>

#include "tessera/autograd/autograd.h"
#include "tessera/core/file_io.h"
#include "tessera/core/random.h"
#include "tessera/core/safetensors.h"
#include "tessera/dist/accelerator.h"
#include "tessera/dist/checkpoint.h"
#include "tessera/kernels/ops.h"

namespace tessera::dist {

namespace fs = std::filesystem;

namespace {
std::string numbered(const std::string& stem, size_t i, const std::string& ext) {
  return i == 0 ? stem + ext : stem + "_" + std::to_string(i) + ext;
}
constexpr const char* kStateFile = "accelerator_state.json";

// A JSON value that must be a non-negative integer; error names the file and key.
uint64_t count_at(const nlohmann::json& j, const std::string& where, const std::string& key) {
  TESSERA_CHECK(j.is_number_unsigned() || (j.is_number_integer() && j.get<int64_t>() >= 0), where,
                ": \"", key, "\" must be a non-negative integer, got ", j.dump());
  return j.get<uint64_t>();
}

// A count stored as a double (schedule steps, loss-scaler counters): whole, 0 to 2^53 (the
// doubles that hold every integer exactly, so converting it to int64 is exact).
bool is_count(double v) { return v >= 0 && v <= 9007199254740992.0 && v == std::floor(v); }

// This process's RNG (seed, offset). Saved by another number of processes, a rank that
// was saved takes its own state and a new rank keeps its seed (the user's, e.g. 42 + rank)
// at saved rank 0's offset: per-rank streams (dropout masks) cannot be mapped between world
// sizes, since each rank draws for its own rows.
std::pair<uint64_t, uint64_t> saved_rng_state(const nlohmann::json& state, uint64_t saved_world,
                                              int rank, const std::string& where) {
  TESSERA_CHECK(state["rng"].is_array() && state["rng"].size() == 2 * saved_world, where,
                ": \"rng\" must hold a seed and an offset for each of the ", saved_world,
                " processes");
  const uint64_t source = static_cast<uint64_t>(rank) < saved_world ? rank : 0;
  const uint64_t seed = count_at(state["rng"][2 * source], where, "rng");
  const uint64_t offset = count_at(state["rng"][2 * source + 1], where, "rng");
  if (static_cast<uint64_t>(rank) < saved_world) return {seed, offset};
  return {default_generator().seed(), offset};
}

// Each loader's position for this process. The data order numbers rows globally (micro-step
// k of the world covers rows [k·W·B, (k+1)·W·B)), so a checkpoint saved by W processes of B
// rows resumes with W' processes of B' rows at k' = k·W·B / (W'·B') when that divides.
// `replicas`: the ranks that read different rows (the mesh's dp axis; the world without one).
std::vector<uint64_t> saved_loader_positions(const nlohmann::json& state, uint64_t saved_world,
                                             const std::vector<data::DataLoader*>& loaders,
                                             int world, int rank, int replicas,
                                             const std::string& where) {
  std::vector<uint64_t> positions;
  for (size_t i = 0; i < loaders.size(); ++i) {
    const nlohmann::json& per_rank = state["loader_positions"][i];
    TESSERA_CHECK(per_rank.is_array() && per_rank.size() == saved_world, where,
                  ": \"loader_positions\" must hold one position per process");
    const uint64_t global_batch = static_cast<uint64_t>(replicas) * loaders[i]->options().batch;
    const bool same_global_batch = !state.contains("loader_global_batch") ||
                                   state["loader_global_batch"].size() <= i ||
                                   state["loader_global_batch"][i] == global_batch;
    if (saved_world == static_cast<uint64_t>(world) && same_global_batch) {
      positions.push_back(count_at(per_rank[rank], where, "loader_positions"));
      continue;
    }
    const uint64_t k = count_at(per_rank[0], where, "loader_positions");
    for (const nlohmann::json& p : per_rank)
      TESSERA_CHECK(count_at(p, where, "loader_positions") == k, where, ": loader ", i,
                    " stood at different positions on the ", saved_world,
                    " processes that saved it; it resumes only on as many");
    TESSERA_CHECK(state.contains("loader_global_batch") &&
                      state["loader_global_batch"].size() == loaders.size(),
                  where, " was saved by ", saved_world,
                  " processes without \"loader_global_batch\"; it "
                  "resumes only on as many (this job has ",
                  world, ")");
    const uint64_t rows =
        k * count_at(state["loader_global_batch"][i], where, "loader_global_batch");
    TESSERA_CHECK(rows % global_batch == 0, where, ": loader ", i, " had taken ", rows, " rows (",
                  k, " micro-steps on ", saved_world, " processes); ", replicas,
                  " data-parallel ranks of ", loaders[i]->options().batch, " rows (", global_batch,
                  " per micro-step) cannot continue from there");
    positions.push_back(rows / global_batch);
  }
  for (size_t i = 0; i < loaders.size(); ++i)
    TESSERA_CHECK(positions[i] <= loaders[i]->max_position(), where,
                  ": \"loader_positions\" holds ", positions[i],
                  ", past the largest position the loader can address (",
                  loaders[i]->max_position(), ")");
  return positions;
}

// Checks an optimizer state against the optimizer it is loaded into before anything is
// copied: every state tensor belongs to a parameter, has its shape and a floating dtype,
// every updated parameter has the same set of state tensors, and steps are counts.
void check_optimizer_state(const optim::OptimizerStateDict& state, const optim::Optimizer& opt,
                           const std::string& where) {
  const std::vector<Tensor> params = opt.parameters();
  std::map<size_t, std::set<std::string>> names;
  std::set<std::string> all_names;
  for (const auto& [key, t] : state.tensors) {
    const auto parsed = optim::parse_optimizer_state_key(key);
    TESSERA_CHECK(parsed.has_value(), where, ": unexpected tensor \"", key, "\"");
    const auto& [index, field] = *parsed;
    TESSERA_CHECK(index < params.size(), where, ": tensor \"", key, "\" names parameter ", index,
                  " but the optimizer has ", params.size());
    TESSERA_CHECK(t.shape() == params[index].shape(), where, ": tensor \"", key, "\" has shape ",
                  shape_str(t.shape()), " but parameter ", index, " has shape ",
                  shape_str(params[index].shape()));
    TESSERA_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::f64, where, ": tensor \"", key,
                  "\" has dtype ", dtype_name(t.dtype()),
                  "; optimizer state is f32 (f64 for f64 parameters)");
    names[index].insert(field);
    all_names.insert(field);
  }
  for (const auto& [key, value] : state.scalars) {
    if (!key.starts_with(optim::kOptimizerStateKeyPrefix)) continue;
    const auto parsed = optim::parse_optimizer_state_key(key);
    TESSERA_CHECK(parsed && parsed->second == "step", where, ": unexpected scalar \"", key, "\"");
    TESSERA_CHECK(is_count(value), where, ": \"", key,
                  "\" must be a whole number from 0 to 2^53, got ", value);
    for (const std::string& name : all_names)
      TESSERA_CHECK(names[parsed->first].count(name), where, ": tensor \"",
                    optim::optimizer_state_key(parsed->first, name),
                    "\" is missing (the other parameters have it)");
  }
  for (const auto& [index, n] : names) {
    const std::string step = optim::optimizer_state_key(index, "step");
    TESSERA_CHECK(state.scalars.count(step), where, ": parameter ", index,
                  " has state tensors but no \"", step, "\"");
  }
}

// Checks a saved model against the module before it is loaded: same names, shapes and
// floating-point-ness (values convert between floating dtypes, never from integers).
void check_model_state(const std::map<std::string, Tensor>& saved, const nn::Module& model,
                       const std::string& where) {
  for (const auto& [name, t] : model.state_dict()) {
    auto it = saved.find(name);
    TESSERA_CHECK(it != saved.end(), where, ": tensor \"", name, "\" is missing");
    TESSERA_CHECK(it->second.shape() == t.shape(), where, ": tensor \"", name, "\" has shape ",
                  shape_str(it->second.shape()), " but the model's is ", shape_str(t.shape()));
    TESSERA_CHECK(is_floating(it->second.dtype()) == is_floating(t.dtype()), where, ": tensor \"",
                  name, "\" has dtype ", dtype_name(it->second.dtype()), " but the model's is ",
                  dtype_name(t.dtype()));
  }
}
// The ranks that write a sharded save of a model trained under `s`: every rank, or under hybrid
// sharding shard group 0 (the other groups hold the same values); null on the others.
std::shared_ptr<ProcessGroup> writers(const DataParallelStrategy& s) {
  const auto* zero = dynamic_cast<const ZeroStrategy*>(&s);
  return zero ? zero->checkpoint_group() : world_ptr();
}

// The model a strategy trains as a split model of the device mesh, or null.
const MeshParallelModel* split_model(const nn::Module& model) {
  return dynamic_cast<const MeshParallelModel*>(&model);
}
std::vector<std::string> optimizer_names(const DataParallelStrategy& s,
                                         const optim::Optimizer& opt) {
  std::vector<std::string> names;
  for (const auto& slice : s.optimizer_slices(opt)) names.push_back(slice.name);
  return names;
}
// What save_state writes for the split models (dist/checkpoint.h): each one's full model and
// each optimizer training one its full-format state, gathered over the model's group on every
// rank (collective); the names of every optimizer's parameters in the order it saves them.
struct FullFormat {
  std::vector<std::unique_ptr<nn::CausalLM>> models;  // null: not split
  std::vector<std::optional<optim::OptimizerStateDict>> optimizers;
  std::vector<std::vector<std::string>> names;
};
FullFormat gather_full_format(const std::vector<nn::Module*>& models,
                              const std::vector<optim::Optimizer*>& optimizers,
                              const std::vector<const DataParallelStrategy*>& trains) {
  FullFormat out;
  for (nn::Module* m : models)
    out.models.push_back(split_model(*m) ? split_model(*m)->gather_full_model() : nullptr);
  for (size_t i = 0; i < optimizers.size(); ++i) {
    const std::vector<std::string> names = optimizer_names(*trains[i], *optimizers[i]);
    const MeshParallelModel* split = split_model(trains[i]->module());
    out.optimizers.emplace_back();
    out.names.push_back(names);
    if (!split) continue;
    const size_t model =
        std::find(models.begin(), models.end(), &trains[i]->module()) - models.begin();
    out.names.back() = trainable_parameters(*out.models.at(model)).second;
    if (const auto* zero = dynamic_cast<const ZeroStrategy*>(trains[i])) {
      // ZeRO-1/2 on the dp axis: this rank's slices made whole over dp first, then gathered over
      // the model's group as DDP's whole moments are.
      std::vector<std::string> whole_names;
      const optim::OptimizerStateDict whole =
          whole_state_of_slices(optimizers[i]->state_dict(), zero->optimizer_slices(*optimizers[i]),
                                zero->module(), *zero->shard_group(), whole_names);
      out.optimizers.back() =
          gather_full_optimizer_state(whole, whole_names, *split, out.names.back());
      continue;
    }
    out.optimizers.back() =
        gather_full_optimizer_state(*optimizers[i], names, *split, out.names.back());
  }
  return out;
}

void refuse_sharded_split_model(const nn::Module& model, int zero_stage, const char* what) {
  TESSERA_CHECK(!split_model(model) || zero_stage <= 2, "Accelerator::", what,
                ": a model split over the device mesh (tensor or pipeline parallel) is "
                "checkpointed under DDP, ZeRO-1 or ZeRO-2 on the dp axis; zero_stage is ",
                zero_stage);
}
// Whether a ZeRO save writes shards: not for split models, whose checkpoints are the full
// model's format (each rank's slices made whole over dp, then gathered over the model's group).
bool any_split_model(const std::vector<nn::Module*>& models) {
  return std::any_of(models.begin(), models.end(),
                     [](const nn::Module* m) { return split_model(*m) != nullptr; });
}
}  // namespace

// The layout (one folder, written by the main process, verified before anything loads):
//   model.safetensors (model_1.safetensors, ...)  each prepared model's state_dict, as
//       Hugging Face names it for GPT (so with config.json the folder is a model directory);
//       under ZeRO also model_shards.json + model_shards/ (dist/checkpoint.h): every
//       process writes the slices it keeps, nothing is gathered, and the main process
//       streams model.safetensors from them; load_state reads the shards
//   optimizer.safetensors (optimizer_1, ...)      optimizer moments and steps
//   accelerator_state.json                        micro-step, every process's RNG state and
//       loader positions, schedules, loss scaler
//   checksums.json                                size and CRC-32 of each file, written last
void Accelerator::save_state(const std::string& dir) {
  // Measured apart (save_memory()): the training steps' peak window is left as it was.
  std::optional<MemoryPeakWindow> window;
  if (memory_categories_enabled()) window.emplace(device_.type);
  // Per-process values (RNG, loader positions) are gathered so the main process can
  // write them all.
  Generator& gen = default_generator();
  Tensor mine = from_vector(
      std::vector<int64_t>{static_cast<int64_t>(gen.seed()), static_cast<int64_t>(gen.offset())},
      {2}, {.dtype = DType::i64});
  std::vector<int64_t> rng_signed = gather(mine.view({1, 2})).to_vector<int64_t>();
  std::vector<uint64_t> rng(rng_signed.begin(), rng_signed.end());
  std::vector<std::vector<int64_t>> positions;
  for (data::DataLoader* l : loaders_) {
    Tensor p = full({1}, static_cast<double>(l->position()), {.dtype = DType::i64});
    positions.push_back(gather(p).to_vector<int64_t>());
  }
  // Under ZeRO every process writes the parameter and optimizer slices it holds
  // (dist/checkpoint.h): the model is never gathered.
  // Hybrid sharding: shard group 0 writes (the other groups hold the same values).
  const bool sharded = zero_stage_ > 0 && !any_split_model(model_order_);
  for (nn::Module* m : model_order_) refuse_sharded_split_model(*m, zero_stage_, "save_state");
  std::vector<const DataParallelStrategy*> trains;
  for (optim::Optimizer* opt : optimizers_) trains.push_back(&strategy_training(*opt));
  const FullFormat whole = gather_full_format(model_order_, optimizers_, trains);
  const auto& [full_models, full_optimizers, saved_names] = whole;
  if (sharded) {
    for (size_t i = 0; i < model_order_.size(); ++i) {
      DataParallelStrategy& strategy = *models_.at(model_order_[i]);
      if (auto group = writers(strategy)) save_sharded_model(dir, i, strategy, *group);
    }
    for (optim::Optimizer* opt : optimizers_)
      if (auto group = writers(strategy_training(*opt)))
        save_sharded_optimizer(dir, strategy_training(*opt), *opt, *group);
  }
  if (is_main_process()) {
    fs::create_directories(dir);
    // What an older save of the other kind left would be read instead of this one's.
    if (!sharded) fs::remove(fs::path(dir) / "optimizer_shards.json");
    for (size_t i = 0; i < model_order_.size(); ++i) {
      const std::string weights_file = (fs::path(dir) / numbered("model", i, ".safetensors")).string();
      if (sharded) {  // streamed from the shards just written, a range at a time
        write_whole_model(read_sharded_model_index(dir, i), weights_file);
        continue;
      }
      fs::remove(fs::path(dir) / sharded_model_index_name(i));
      const nn::Module& whole = full_models[i] ? *full_models[i] : *model_order_[i];
      save_safetensors(weights_file, whole.state_dict(), {{"format", "pt"}});
    }
    for (size_t i = 0; i < optimizers_.size() && !sharded; ++i)
      optim::save_optimizer_state(
          full_optimizers[i] ? *full_optimizers[i] : optimizers_[i]->state_dict(),
          (fs::path(dir) / numbered("optimizer", i, ".safetensors")).string());
    nlohmann::json state;
    state["micro_step"] = micro_step_;
    state["num_processes"] = num_processes();
    if (!mesh_->data_parallel_only())  // the moments are the full model's, by name
      state["mesh"] = {{"dp_size", mesh_->dp_size()},
                       {"tp_size", mesh_->tp_size()},
                       {"pp_size", mesh_->pp_size()}};
    state["rng"] = rng;  // seed, offset for each process in turn
    state["loader_positions"] = positions;
    // Rows of one micro-step of the whole world per loader: what makes a position valid
    // at another world size (the data order numbers rows globally).
    state["loader_global_batch"] = nlohmann::json::array();
    for (data::DataLoader* l : loaders_)
      state["loader_global_batch"].push_back(mesh_->dp_size() * l->options().batch);
    // Which model parameter each optimizer tensor is, so a whole optimizer state can be
    // re-sliced under a ZeRO stage (sharded saves carry this in their index).
    state["optimizer_parameters"] = nlohmann::json::array();
    for (size_t i = 0; i < optimizers_.size(); ++i)
      state["optimizer_parameters"].push_back(sharded ? nlohmann::json::array()
                                                      : nlohmann::json(saved_names[i]));
    state["schedules"] = nlohmann::json::array();
    for (optim::LRSchedule* s : schedules_) state["schedules"].push_back(s->state_dict());
    state["loss_scaler"] = scaler_.state_dict();
    write_file_atomically(fs::path(dir) / kStateFile,
                                nlohmann::json{{"state", state}}.dump(2));
  }
  wait_for_everyone();  // every rank's optimizer shards are written
  if (is_main_process()) write_folder_checksums(dir);
  wait_for_everyone();
  if (window) keep_memory_apart("save", window->stats());  // a finished save only
}

// Model i's weights read from dir and checked; the returned function loads them. A sharded
// save is read in the slices this process keeps; a whole one (DDP) is loaded whole (under
// ZeRO-3 into the gathered parameters, which are sliced again after).
std::function<void()> Accelerator::stage_model_weights(const std::string& dir, size_t i) {
  const std::string where = "Accelerator::load_state: '" + dir + "'";
  nn::Module& model = *model_order_[i];
  DataParallelStrategy& strategy = *models_.at(&model);
  if (has_sharded_model(dir, i)) {
    try {
      return stage_sharded_model(read_sharded_model_index(dir, i), strategy,
                                 where + ": " + sharded_model_index_name(i));
    } catch (const Error& e) {
      TESSERA_FAIL("Accelerator::load_state: ", e.what());
    }
  }
  const std::string name = numbered("model", i, ".safetensors");
  refuse_sharded_split_model(model, zero_stage_, "load_state");
  if (const MeshParallelModel* split = split_model(model)) {
    // The full model's tensors; this rank keeps its pieces of them.
    const std::map<std::string, Tensor> weights =
        load_safetensors((fs::path(dir) / name).string(), {.memory_map = false}).tensors;
    std::vector<std::pair<Tensor, Tensor>> copies;
    for (const auto& [parameter, p] : model.named_parameters()) {
      auto it = weights.find(parameter);
      TESSERA_CHECK(it != weights.end(), where, ": ", name, ": tensor \"", parameter,
                    "\" is missing");
      TESSERA_CHECK(is_floating(it->second.dtype()), where, ": ", name, ": tensor \"", parameter,
                    "\" has dtype ", dtype_name(it->second.dtype()));
      try {
        copies.emplace_back(p, split->piece_of(parameter, it->second));
      } catch (const Error& e) {
        TESSERA_FAIL(where, ": ", name, ": ", e.what());
      }
    }
    return [copies = std::move(copies), &strategy] {
      autograd::NoGradGuard no_grad;
      for (const auto& [p, piece] : copies) ops::copy_(p, ops::to(piece, p.device(), p.dtype()));
      strategy.after_parameters_loaded();
    };
  }
  strategy.gather_full_parameters();
  std::map<std::string, Tensor> weights =
      load_safetensors((fs::path(dir) / name).string(), {.memory_map = false}).tensors;
  check_model_state(weights, model, where + ": " + name);
  return [&model, &strategy, weights = std::move(weights)] {
    model.load_state_dict(weights);
    strategy.after_parameters_loaded();
  };
}

void Accelerator::save_model(nn::Module& model, const std::string& dir) {
  const fs::path weights = fs::path(dir) / "model.safetensors";
  const bool sharded = zero_stage_ > 0 && models_.count(&model) && !split_model(model);
  refuse_sharded_split_model(model, zero_stage_, "save_model");
  // A split model: the full model, gathered over its group (collective), as one process saves it.
  std::unique_ptr<nn::CausalLM> full;
  if (const MeshParallelModel* split = split_model(model)) full = split->gather_full_model();
  if (sharded)
    if (auto group = writers(*models_.at(&model)))
      save_sharded_model(dir, 0, *models_.at(&model), *group);
  if (is_main_process()) {
    fs::create_directories(dir);
    if (sharded) {
      write_whole_model(read_sharded_model_index(dir, 0), weights.string());
      remove_sharded_model(dir, 0);
    } else {
      save_safetensors(weights.string(), (full ? *full : model).state_dict(), {{"format", "pt"}});
    }
  }
  wait_for_everyone();
}

void Accelerator::load_state(const std::string& dir) {
  const std::string where = "Accelerator::load_state: '" + dir + "'";
  // Any number of processes at any stage may load it (optimizer states are re-sliced, data
  // positions re-counted): nothing here depends on how many processes saved it.
  std::vector<std::string> files = {kStateFile};
  for (size_t i = 0; i < model_order_.size(); ++i)
    files.push_back(has_sharded_model(dir, i) ? sharded_model_index_name(i)
                                              : numbered("model", i, ".safetensors"));
  for (size_t i = 0; i < optimizers_.size() && !has_sharded_optimizer(dir); ++i)
    files.push_back(numbered("optimizer", i, ".safetensors"));
  try {
    verify_folder_checksums(dir, files);
  } catch (const Error& e) {
    TESSERA_FAIL("Accelerator::load_state: ", e.what());
  }
  const std::string state_where = where + ": " + kStateFile;
  nlohmann::json file;
  try {
    file = nlohmann::json::parse(read_file(fs::path(dir) / kStateFile));
  } catch (const nlohmann::json::exception& e) {
    TESSERA_FAIL(state_where, " is not valid JSON: ", e.what());
  }
  TESSERA_CHECK(file.is_object() && file.contains("state") && file["state"].is_object(),
                state_where, " has no \"state\" object");
  const nlohmann::json& state = file["state"];
  for (const char* key : {"micro_step", "num_processes", "rng", "loader_positions", "schedules"})
    TESSERA_CHECK(state.contains(key), state_where, ": \"", key, "\" is missing");
  const uint64_t saved_world = count_at(state["num_processes"], state_where, "num_processes");
  const uint64_t micro_step = count_at(state["micro_step"], state_where, "micro_step");
  TESSERA_CHECK(state["schedules"].is_array() && state["schedules"].size() == schedules_.size() &&
                    state["loader_positions"].is_array() &&
                    state["loader_positions"].size() == loaders_.size(),
                where, " holds ", state["schedules"].size(), " schedules and ",
                state["loader_positions"].size(), " loaders, but this Accelerator prepared ",
                schedules_.size(), " and ", loaders_.size());
  const auto [rng_seed, rng_offset] =
      saved_rng_state(state, saved_world, process_index(), state_where);
  const std::vector<uint64_t> positions =
      saved_loader_positions(state, saved_world, loaders_, num_processes(), process_index(),
                             mesh_->dp_size(), state_where);
  std::vector<std::map<std::string, double>> schedules;
  for (const nlohmann::json& s : state["schedules"]) {
    TESSERA_CHECK(s.is_object(), state_where, ": a schedule state must be an object, got ",
                  s.dump());
    for (const auto& [key, value] : s.items())
      TESSERA_CHECK(value.is_number() && std::isfinite(value.get<double>()), state_where,
                    ": schedule \"", key, "\" must be a finite number, got ", value.dump());
    if (s.contains("step"))  // a whole number (schedule states are stored as doubles)
      TESSERA_CHECK(is_count(s["step"].get<double>()), state_where,
                    ": schedule \"step\" must be a whole number from 0 to 2^53, got ",
                    s["step"].dump());
    schedules.push_back(s.get<std::map<std::string, double>>());
  }
  std::map<std::string, double> scaler_state;
  if (state.contains("loss_scaler")) {
    for (const auto& [key, value] : state["loss_scaler"].items())
      TESSERA_CHECK(
          value.is_number() && std::isfinite(value.get<double>()) && value.get<double>() >= 0,
          state_where, ": loss_scaler \"", key, "\" must be a non-negative number, got ",
          value.dump());
    scaler_state = state["loss_scaler"].get<std::map<std::string, double>>();
    for (const char* key : {"growth_tracker", "growth_interval"})
      TESSERA_CHECK(!scaler_state.count(key) || is_count(scaler_state[key]), state_where,
                    ": loss_scaler \"", key, "\" must be a whole number from 0 to 2^53, got ",
                    scaler_state[key]);
  }
  // Everything is read and checked before the first object changes.
  std::vector<std::function<void()>> load_models;
  for (size_t i = 0; i < model_order_.size(); ++i)
    load_models.push_back(stage_model_weights(dir, i));
  // Optimizer states are re-sliced to what this rank's strategy updates: ZeRO shards by
  // their index, a whole (DDP) state by the parameter names saved beside it.
  std::vector<optim::OptimizerStateDict> optimizer_states;
  const bool sharded = has_sharded_optimizer(dir);
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    const std::string name =
        sharded ? "optimizer_shards.json" : numbered("optimizer", i, ".safetensors");
    const DataParallelStrategy& strategy = strategy_training(*optimizers_[i]);
    if (sharded) {
      optimizer_states.push_back(read_sharded_optimizer(dir, strategy, *optimizers_[i]));
    } else {
      optimizer_states.push_back(optim::load_optimizer_state((fs::path(dir) / name).string()));
      const MeshParallelModel* split = split_model(strategy.module());
      if (split || state.contains("mesh")) {
        // A full-format state (a mesh run's): each parameter takes its piece, by name; under
        // ZeRO-1/2 the pieces of this rank's (stage, tp slice) are then sliced on the dp axis.
        const nlohmann::json& names = state.value("optimizer_parameters", nlohmann::json::array());
        TESSERA_CHECK(names.is_array() && names.size() == optimizers_.size() && !names[i].empty(),
                      where, ": ", name,
                      " holds an optimizer state without \"optimizer_parameters\" in ", kStateFile,
                      "; a model split over the device mesh cannot take its pieces");
        const std::vector<std::string> mine = zero_stage_ > 0
                                                  ? trainable_parameters(strategy.module()).second
                                                  : optimizer_names(strategy, *optimizers_[i]);
        optimizer_states.back() = pieces_of_whole_optimizer_state(
            optimizer_states.back(), names[i].get<std::vector<std::string>>(), mine, split,
            where + ": " + name);
        if (zero_stage_ > 0)
          optimizer_states.back() = reslice_whole_optimizer(optimizer_states.back(), mine, strategy,
                                                            *optimizers_[i], where + ": " + name);
      } else if (zero_stage_ > 0) {
        const nlohmann::json& names = state.value("optimizer_parameters", nlohmann::json::array());
        TESSERA_CHECK(names.is_array() && names.size() == optimizers_.size() && !names[i].empty(),
                      where, ": ", name,
                      " holds a whole optimizer state without \"optimizer_parameters\" in ",
                      kStateFile, "; it cannot be sliced for ZeRO stage ", zero_stage_);
        optimizer_states.back() = reslice_whole_optimizer(
            optimizer_states.back(), names[i].get<std::vector<std::string>>(), strategy,
            *optimizers_[i], where + ": " + name);
      }
    }
    check_optimizer_state(optimizer_states.back(), *optimizers_[i], where + ": " + name);
  }
  for (const auto& load : load_models) load();
  for (size_t i = 0; i < optimizer_states.size(); ++i)
    optimizers_[i]->load_state_dict(optimizer_states[i]);
  for (size_t i = 0; i < schedules_.size(); ++i) schedules_[i]->load_state_dict(schedules[i]);
  for (size_t i = 0; i < loaders_.size(); ++i) loaders_[i]->set_position(positions[i]);
  default_generator().set_state(rng_seed, rng_offset);
  micro_step_ = static_cast<int64_t>(micro_step);
  if (!scaler_state.empty()) scaler_.load_state_dict(scaler_state);
  sync_gradients_ = *gate_open_ = true;
  wait_for_everyone();
}


}  // namespace tessera::dist
