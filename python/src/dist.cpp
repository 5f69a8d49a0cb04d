// tessera.Accelerator (Hugging Face Accelerate's names), the process group and the DDP
// internals (buckets, gradient views) that the walk-through in examples/python shows.
// Collectives, backward and state I/O run with the GIL released.
#include "bindings.h"

namespace tessera::python {
namespace {

// The Accelerator as Python holds it: the C++ object plus the Python objects it was given
// in prepare() (it keeps pointers to them). `prepared` is declared first so the Accelerator
// goes before the objects it points at.
struct PythonAccelerator {
  std::vector<py::object> prepared;
  std::unique_ptr<dist::Accelerator> acc;
  std::unique_ptr<dist::AccumulateScope> scope;  // the open accumulate() micro-step
  // The open autocast() and no_sync() blocks, innermost last (they may nest).
  std::vector<std::unique_ptr<autograd::AutocastGuard>> autocasts;
  std::vector<dist::DataParallelStrategy::NoSyncGuard> no_syncs;
  bool training_ended = false;  // end_training() ran: a second call does nothing (Accelerate)
};

// `obj` as a Module for `method`, or a TypeError naming the argument.
nn::Module& module_argument(py::handle obj, const char* method, const char* argument) {
  if (!py::isinstance<nn::Module>(obj))
    throw py::type_error(std::string("Accelerator.") + method + ": " + argument +
                         " must be a tessera.nn.Module, got " +
                         std::string(py::str(py::type::of(obj).attr("__name__"))));
  return obj.cast<nn::Module&>();
}

dist::ReduceOp reduce_op(const std::string& name) {
  if (name == "sum") return dist::ReduceOp::Sum;
  if (name == "avg" || name == "mean") return dist::ReduceOp::Avg;
  if (name == "max") return dist::ReduceOp::Max;
  if (name == "min") return dist::ReduceOp::Min;
  TESSERA_FAIL("reduce op must be 'sum', 'avg', 'max' or 'min', got '", name, "'");
}

template <class Fn>
decltype(auto) collective(Fn&& fn) {
  py::gil_scoped_release release;
  return runtime_call(std::forward<Fn>(fn));
}

void prepare_one(PythonAccelerator& self, py::handle obj) {
  dist::Accelerator& acc = *self.acc;
  if (py::isinstance<nn::Module>(obj)) {
    nn::Module& m = obj.cast<nn::Module&>();
    collective([&] { acc.prepare_one(m); });
  } else if (py::isinstance<optim::Optimizer>(obj)) {
    acc.prepare_one(obj.cast<optim::Optimizer&>());
  } else if (py::isinstance<optim::LRSchedule>(obj)) {
    acc.prepare_one(obj.cast<optim::LRSchedule&>());
  } else if (py::isinstance<data::DataLoader>(obj)) {
    acc.prepare_one(obj.cast<data::DataLoader&>());
  } else {
    throw py::type_error("Accelerator.prepare: cannot prepare a " +
                         std::string(py::str(py::type::of(obj))) +
                         " (modules, optimizers, LR schedules and DataLoaders can be prepared)");
  }
  self.prepared.push_back(py::reinterpret_borrow<py::object>(obj));
}

void bind_accelerator(py::module_& m) {
  // The one default of the bucket size (dist/flat_buckets.h), for tessera.Accelerator's signature.
  m.attr("DEFAULT_BUCKET_BYTES") = dist::kDefaultBucketBytes;
  using dist::Accelerator;
  py::class_<dist::GeneralTracker>(m, "_GeneralTracker")
      .def_property_readonly("name", &dist::GeneralTracker::name)
      .def_property_readonly("requires_logging_directory",
                             &dist::GeneralTracker::requires_logging_directory)
      .def("_store_init_configuration",
           [](dist::GeneralTracker& t, const std::string& values) {
             runtime_call([&] { t.store_init_configuration(nlohmann::json::parse(values)); });
           })
      .def("_log",
           [](dist::GeneralTracker& t, const std::string& values, int64_t step) {
             runtime_call([&] { t.log(nlohmann::json::parse(values), step); });
           })
      .def("finish", [](dist::GeneralTracker& t) { runtime_call([&] { t.finish(); }); });
  py::class_<PythonAccelerator>(m, "_Accelerator")
      .def(py::init([](const std::string& mixed_precision, int accumulation,
                       const std::string& backend, size_t bucket_bytes, bool find_unused, bool cpu,
                       int zero_stage, const std::string& reduce_dtype, bool offload_optimizer,
                       bool offload_param, const std::string& deepspeed_config,
                       const std::string& fsdp_sharding_strategy,
                       const std::vector<std::string>& log_with, const std::string& project_dir,
                       const std::string& logging_dir) {
             // DDP/ZeRO would refuse it only at the first backward.
             if (bucket_bytes == 0)
               throw py::value_error("Accelerator: bucket_bytes must be > 0, got 0");
             auto self = std::make_unique<PythonAccelerator>();
             dist::AcceleratorOptions o{.mixed_precision = mixed_precision,
                                        .reduce_dtype = reduce_dtype,
                                        .gradient_accumulation_steps = accumulation,
                                        .backend = backend,
                                        .bucket_bytes = bucket_bytes,
                                        .find_unused_parameters = find_unused,
                                        .cpu = cpu,
                                        .zero_stage = zero_stage,
                                        .offload_optimizer = offload_optimizer,
                                        .offload_param = offload_param,
                                        .fsdp_sharding_strategy = fsdp_sharding_strategy,
                                        .deepspeed_config = deepspeed_config,
                                        .log_with = log_with,
                                        .project_dir = project_dir,
                                        .logging_dir = logging_dir};
             dist::resolve_tracker_names(log_with, "Accelerator: log_with");  // ValueError
             py::gil_scoped_release release;
             self->acc = runtime_call([&] { return std::make_unique<Accelerator>(o); });
             return self;
           }),
           py::kw_only(), py::arg("mixed_precision") = "",
           py::arg("gradient_accumulation_steps") = 1, py::arg("backend") = "auto",
           py::arg("bucket_bytes") = dist::kDefaultBucketBytes,
           py::arg("find_unused_parameters") = false, py::arg("cpu") = false,
           py::arg("zero_stage") = -1, py::arg("reduce_dtype") = "",
           py::arg("offload_optimizer") = false, py::arg("offload_param") = false,
           py::arg("deepspeed_config") = "", py::arg("fsdp_sharding_strategy") = "",
           py::arg("log_with") = std::vector<std::string>{}, py::arg("project_dir") = "",
           py::arg("logging_dir") = "")
      // The built-in trackers; python/tessera/tracking.py adds tracker objects and JSON.
      .def("_init_trackers",
           [](PythonAccelerator& self, const std::string& project, const std::string& config,
              const std::string& init_kwargs) {
             self.acc->init_trackers(project, nlohmann::json::parse(config),
                                     nlohmann::json::parse(init_kwargs));
           })
      .def("_log",
           [](PythonAccelerator& self, const std::string& values, std::optional<int64_t> step) {
             self.acc->log(nlohmann::json::parse(values), step);
           })
      .def("_get_tracker",
           [](PythonAccelerator& self, const std::string& name) -> dist::GeneralTracker& {
             return self.acc->get_tracker(name);
           },
           py::return_value_policy::reference_internal)
      .def_property_readonly("_builtin_tracker_names",
                             [](const PythonAccelerator& s) { return s.acc->log_with(); })
      .def("_prepare",
           [](PythonAccelerator& self, py::args objects) {
             for (py::handle o : objects) prepare_one(self, o);
           })
      .def(
          "_enter_accumulate",
          [](PythonAccelerator& self, nn::Module& model) {
            TESSERA_CHECK(
                !self.scope,
                "Accelerator.accumulate: a micro-step is already open (nested accumulate)");
            self.scope = std::make_unique<dist::AccumulateScope>(self.acc->accumulate(model));
            return self.scope->sync_gradients();
          },
          py::arg("model"))
      .def("_exit_accumulate", [](PythonAccelerator& self) { self.scope.reset(); })
      .def("_enter_autocast",
           [](PythonAccelerator& self) {
             self.autocasts.push_back(std::make_unique<autograd::AutocastGuard>(
                 self.acc->mixed_precision_policy().compute_dtype));
           })
      .def("_exit_autocast", [](PythonAccelerator& self) { self.autocasts.pop_back(); })
      .def(
          "_enter_no_sync",
          [](PythonAccelerator& self, const nn::Module& model) {
            dist::DataParallelStrategy* strategy = self.acc->strategy_of(model);
            if (!strategy) return false;  // not prepared: nothing synchronises its gradients
            self.no_syncs.push_back(strategy->no_sync());
            return true;
          },
          py::arg("model"))
      .def("_exit_no_sync", [](PythonAccelerator& self) { self.no_syncs.pop_back(); })
      .def(
          "backward",
          [](PythonAccelerator& self, const Tensor& loss) {
            collective([&] { self.acc->backward(loss); });
          },
          py::arg("loss"))
      .def(
          "clip_grad_norm_",
          [](PythonAccelerator& self, const std::vector<Tensor>& params, double max_norm) {
            return collective([&] { return self.acc->clip_grad_norm_(params, max_norm); });
          },
          py::arg("parameters"), py::arg("max_norm"))
      .def(
          "gather",
          [](PythonAccelerator& self, const Tensor& t) {
            return collective([&] { return self.acc->gather(t); });
          },
          py::arg("tensor"))
      .def(
          "gather_for_metrics",
          [](PythonAccelerator& self, const Tensor& t) {
            return collective([&] { return self.acc->gather_for_metrics(t); });
          },
          py::arg("input_data"))
      .def(
          "reduce",
          [](PythonAccelerator& self, const Tensor& t, const std::string& op) {
            return collective([&] { return self.acc->reduce(t, op); });
          },
          py::arg("tensor"), py::arg("reduction") = "sum")
      .def(
          "pad_across_processes",
          [](PythonAccelerator& self, const Tensor& t, int64_t dim, double pad, bool first) {
            return collective([&] { return self.acc->pad_across_processes(t, dim, pad, first); });
          },
          py::arg("tensor"), py::arg("dim") = 0, py::arg("pad_index") = 0.0,
          py::arg("pad_first") = false)
      .def("_split_between_processes",
           [](PythonAccelerator& self, const std::vector<py::object>& items, bool pad) {
             return self.acc->split_between_processes(items, pad);
           })
      .def("wait_for_everyone",
           [](PythonAccelerator& self) { collective([&] { self.acc->wait_for_everyone(); }); })
      .def(
          "save_state",
          [](PythonAccelerator& self, const std::string& dir) {
            collective([&] { self.acc->save_state(dir); });
          },
          py::arg("output_dir"))
      .def(
          "load_state",
          [](PythonAccelerator& self, const std::string& dir) {
            collective([&] { self.acc->load_state(dir); });
          },
          py::arg("input_dir"))
      .def("end_training",
           [](PythonAccelerator& self) {
             if (self.training_ended) return;
             collective([&] { self.acc->end_training(); });
             self.training_ended = true;
           })
      .def("free_memory",
           [](PythonAccelerator& self) {
             self.acc->free_memory();
             self.prepared.clear();
           })
      .def("set_trigger", [](PythonAccelerator& self) { self.acc->set_trigger(); })
      .def("check_trigger",
           [](PythonAccelerator& self) {
             return collective([&] { return self.acc->check_trigger(); });
           })
      .def(
          "sharded_init",
          [](PythonAccelerator& self, const py::function& build) {
            // build() runs with deferred initialisation on (Accelerator::sharded_init): the
            // parameters it creates hold recipes until prepare fills this rank's slices.
            return self.acc->sharded_init([&] { return build(); });
          },
          py::arg("build"))
      .def(
          "unwrap_model",
          [](PythonAccelerator& self, py::object model) {
            nn::Module& m = module_argument(model, "unwrap_model", "model");
            collective([&] { self.acc->unwrap_model(m); });
            return model;
          },
          py::arg("model"))
      .def(
          "ddp_of",
          [](PythonAccelerator& self, const nn::Module& model) { return self.acc->ddp_of(model); },
          py::arg("model"), py::return_value_policy::reference_internal)
      .def_property_readonly("is_main_process",
                             [](const PythonAccelerator& s) { return s.acc->is_main_process(); })
      .def_property_readonly(
          "is_local_main_process",
          [](const PythonAccelerator& s) { return s.acc->is_local_main_process(); })
      .def_property_readonly("process_index",
                             [](const PythonAccelerator& s) { return s.acc->process_index(); })
      .def_property_readonly(
          "local_process_index",
          [](const PythonAccelerator& s) { return s.acc->local_process_index(); })
      .def_property_readonly("num_processes",
                             [](const PythonAccelerator& s) { return s.acc->num_processes(); })
      .def_property_readonly("device", [](const PythonAccelerator& s) { return s.acc->device(); })
      .def_property_readonly("sync_gradients",
                             [](const PythonAccelerator& s) { return s.acc->sync_gradients(); })
      .def_property_readonly(
          "gradient_accumulation_steps",
          [](const PythonAccelerator& s) { return s.acc->gradient_accumulation_steps(); })
      .def_property_readonly("mixed_precision",
                             [](const PythonAccelerator& s) { return s.acc->mixed_precision(); })
      .def_property_readonly("reduce_dtype",
                             [](const PythonAccelerator& s) {
                               return dtype_name(s.acc->mixed_precision_policy().reduce_dtype);
                             })
      .def_property_readonly("zero_stage",
                             [](const PythonAccelerator& s) { return s.acc->zero_stage(); })
      .def_property_readonly("loss_scale",
                             [](const PythonAccelerator& s) { return s.acc->loss_scale(); })
      .def_property_readonly(
          "optimizer_step_was_skipped",
          [](const PythonAccelerator& s) { return s.acc->optimizer_step_was_skipped(); })
      .def_property_readonly("group", [](const PythonAccelerator& s) { return dist::world_ptr(); });
}

void bind_process_group(py::module_& dm) {
  using namespace dist;
  py::class_<Work, std::shared_ptr<Work>>(dm, "Work")
      .def("wait", [](Work& w) { collective([&] { w.wait(); }); })
      .def("is_completed", &Work::is_completed);
  py::class_<ProcessGroup, std::shared_ptr<ProcessGroup>>(dm, "ProcessGroup")
      .def("rank", &ProcessGroup::rank)
      .def("size", &ProcessGroup::size)
      .def_property_readonly("backend", &ProcessGroup::backend_name)
      .def(
          "all_reduce",
          [](ProcessGroup& g, const Tensor& t, const std::string& op) {
            return collective([&] { return g.all_reduce(t, reduce_op(op)); });
          },
          py::arg("tensor"), py::arg("op") = "sum")
      .def(
          "reduce_scatter",
          [](ProcessGroup& g, const Tensor& out, const Tensor& in, const std::string& op) {
            return collective([&] { return g.reduce_scatter(out, in, reduce_op(op)); });
          },
          py::arg("output"), py::arg("input"), py::arg("op") = "sum")
      .def(
          "all_gather",
          [](ProcessGroup& g, const Tensor& out, const Tensor& in) {
            return collective([&] { return g.all_gather(out, in); });
          },
          py::arg("output"), py::arg("input"))
      .def(
          "broadcast",
          [](ProcessGroup& g, const Tensor& t, int root) {
            return collective([&] { return g.broadcast(t, root); });
          },
          py::arg("tensor"), py::arg("src") = 0)
      .def("barrier", [](ProcessGroup& g) { return collective([&] { return g.barrier(); }); });
  dm.def(
      "init_process_group",
      [](const std::string& backend, bool cpu) {
        InitOptions init{.backend = backend};
        // A CPU-only run must not pick NCCL just because a GPU is visible.
        if (cpu || !cuda_is_available()) init.device = DeviceType::CPU;
        collective([&] { init_process_group(init); });
      },
      py::arg("backend") = "auto", py::arg("cpu") = false);
  dm.def("is_initialized", &is_initialized);
  dm.def("destroy_process_group", [] { collective([] { destroy_process_group(); }); });
  dm.def("world", &world_ptr,
         "The default process group (init_process_group or an Accelerator creates it)");
  dm.def(
      "read_env",
      [] {
        DistEnv e = read_dist_env();
        py::dict d;
        d["rank"] = e.rank;
        d["local_rank"] = e.local_rank;
        d["world_size"] = e.world_size;
        d["local_world_size"] = e.local_world_size;
        d["master_addr"] = e.master_addr;
        d["master_port"] = e.master_port;
        d["launcher"] = launcher_name(e.launcher);
        return d;
      },
      "Where this process sits in the job, from torchrun/tessera launch, mpirun or SLURM "
      "variables");
}

void bind_ddp(py::module_& dm) {
  using namespace dist;
  py::class_<FlatBuckets::Bucket>(dm, "Bucket")
      .def_readonly("params", &FlatBuckets::Bucket::params)
      .def_readonly("offsets", &FlatBuckets::Bucket::offsets)
      .def_readonly("numel", &FlatBuckets::Bucket::numel)
      .def_readonly("padded_numel", &FlatBuckets::Bucket::padded_numel)
      .def_readonly("dtype", &FlatBuckets::Bucket::dtype)
      .def_property_readonly("gradients", [](const FlatBuckets::Bucket& b) -> py::object {
        return b.gradients.defined() ? py::cast(b.gradients) : py::none();
      });
  py::class_<DistributedDataParallel, std::unique_ptr<DistributedDataParallel, py::nodelete>>(
      dm, "DistributedDataParallel")
      .def_property_readonly("name", &DistributedDataParallel::name)
      .def("parameters", &DistributedDataParallel::parameters)
      .def("parameter_names", &DistributedDataParallel::parameter_names)
      .def("buckets", &DistributedDataParallel::buckets)
      .def("gradient_slot", &DistributedDataParallel::gradient_slot, py::arg("index"))
      .def_property_readonly("gradient_sync", &DistributedDataParallel::gradient_sync);
}

}  // namespace

void bind_dist(py::module_& m) {
  bind_accelerator(m);
  // Accelerator.save_model's writer (one shard of named tensors, in the order given).
  m.def(
      "_save_safetensors",
      [](const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
         const std::map<std::string, std::string>& metadata) {
        collective([&] { save_safetensors(path, tensors, metadata); });
      },
      py::arg("path"), py::arg("tensors"), py::arg("metadata"));
  py::module_ dm = m.def_submodule("dist", "Process groups, collectives and DDP's buckets");
  bind_process_group(dm);
  bind_ddp(dm);
}

}  // namespace tessera::python
