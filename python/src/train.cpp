// tessera.Trainer and tessera.TrainingArguments: Hugging Face's names over train::Trainer.
// Arguments are given as keywords (any name the config file or `tessera train` accepts) and
// checked by the library; Python callbacks see logs, evaluations and saves.
#include <cmath>

#include "bindings.h"
#include "tessera/train/trainer.h"
#include "tessera/train/training_args.h"

namespace tessera::python {
namespace {

nlohmann::json json_of(py::handle value) {
  return nlohmann::json::parse(
      py::module_::import("json").attr("dumps")(value).cast<std::string>());
}

// JSON has no NaN or infinity (json.dumps would write NaN, which the parser then refuses
// without naming the setting): a non-finite number anywhere in `value` is refused here.
void check_finite(py::handle value, const std::string& key) {
  if (py::isinstance<py::float_>(value) && !std::isfinite(value.cast<double>()))
    throw py::value_error("TrainingArguments: " + key + " must be a finite number, got " +
                          std::string(py::repr(value)));
  if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value))
    for (py::handle item : value) check_finite(item, key);
  if (py::isinstance<py::dict>(value))
    for (auto [k, item] : py::reinterpret_borrow<py::dict>(value))
      check_finite(item, key + "." + std::string(py::str(k)));
}

// The callback object Trainer.add_callback was given, when it has a method the Trainer calls.
void check_callback(py::handle callback) {
  for (const char* method : {"on_log", "on_evaluate", "on_save", "on_step_end"})
    if (py::hasattr(callback, method)) return;
  throw py::type_error(
      "Trainer.add_callback: callback must have at least one of on_log, on_evaluate, on_save, "
      "on_step_end; got " +
      std::string(py::str(py::type::of(callback).attr("__name__"))));
}

py::object python_of(const nlohmann::json& j) {
  return py::module_::import("json").attr("loads")(j.dump());
}

// A Python object with any of on_log(logs), on_evaluate(metrics), on_save(path),
// on_step_end(state) as a TrainerCallback; a method returning True asks the Trainer to stop.
class PythonCallback : public train::TrainerCallback {
 public:
  explicit PythonCallback(py::object target) : target_(std::move(target)) {}
  ~PythonCallback() override {
    py::gil_scoped_acquire gil;
    target_ = py::object();
  }
  void on_log(const train::TrainingArguments&, train::TrainerState&, train::TrainerControl& c,
              const nlohmann::json& logs) override {
    call(c, "on_log", [&] { return python_of(logs); });
  }
  void on_evaluate(const train::TrainingArguments&, train::TrainerState&, train::TrainerControl& c,
                   const train::Metrics& metrics) override {
    call(c, "on_evaluate", [&] { return py::cast(metrics); });
  }
  void on_save(const train::TrainingArguments&, train::TrainerState&, train::TrainerControl& c,
               const std::filesystem::path& checkpoint) override {
    call(c, "on_save", [&] { return py::cast(checkpoint.string()); });
  }
  void on_step_end(const train::TrainingArguments&, train::TrainerState& s,
                   train::TrainerControl& c) override {
    call(c, "on_step_end", [&] { return python_of(s.to_json()); });
  }

 private:
  template <class MakeArgument>
  void call(train::TrainerControl& control, const char* method, MakeArgument make) {
    py::gil_scoped_acquire gil;
    if (!py::hasattr(target_, method)) return;
    py::object result = target_.attr(method)(make());
    if (py::isinstance<py::bool_>(result) && result.cast<bool>()) control.should_stop = true;
  }
  py::object target_;
};

// The Trainer with the Python objects it refers to kept alive.
struct PythonTrainer {
  py::object model;
  std::unique_ptr<train::Trainer> trainer;
};

}  // namespace

void bind_train(py::module_& m) {
  using train::TrainingArguments;
  py::class_<TrainingArguments>(m, "TrainingArguments")
      .def(py::init([](py::kwargs kwargs) {
             for (auto [key, value] : kwargs) check_finite(value, std::string(py::str(key)));
             TrainingArguments args;
             train::apply_config_values(args, json_of(kwargs), "TrainingArguments(...)");
             // As transformers does, a `deepspeed` file's settings are read here.
             train::apply_sharding_config(args);
             // An unknown tracker would otherwise be found only when training starts.
             for (const std::string& name : args.report_to)
               if (name != "none" && !train::tracker_available(name))
                 throw py::value_error("TrainingArguments: report_to names the tracker '" + name +
                                       "', which is not available in this build (jsonl, "
                                       "tensorboard, all or none)");
             // The training data is usually given to the Trainer rather than here.
             TrainingArguments checked = args;
             if (checked.data.empty()) checked.data = "(the Trainer's train_dataset)";
             train::validate(checked);
             return args;
           }),
           "Every setting by its Hugging Face name (output_dir, per_device_train_batch_size, "
           "learning_rate, "
           "max_steps, ...) or its `tessera train` name; checked before any work")
      .def("to_dict", [](const TrainingArguments& a) { return python_of(a.to_json()); })
      .def("__getattr__",
           [](const TrainingArguments& a, const std::string& name) -> py::object {
             nlohmann::json j = a.to_json();
             const std::string key = train::canonical_key(name);
             if (key.empty() || !j.contains(key))
               throw py::attribute_error("TrainingArguments has no setting '" + name + "'");
             return python_of(j.at(key));
           })
      .def("__repr__", [](const TrainingArguments& a) {
        return "TrainingArguments(" + a.to_json().dump() + ")";
      });

  py::class_<train::EarlyStoppingCallback, std::shared_ptr<train::EarlyStoppingCallback>>(
      m, "EarlyStoppingCallback",
      "transformers' EarlyStoppingCallback: stops when metric_for_best_model has not improved "
      "by more than early_stopping_threshold for early_stopping_patience evaluations")
      .def(py::init([](int64_t patience, double threshold) {
             return std::make_shared<train::EarlyStoppingCallback>(patience, threshold);
           }),
           py::arg("early_stopping_patience") = 1, py::arg("early_stopping_threshold") = 0.0)
      .def_property_readonly("early_stopping_patience_counter",
                             &train::EarlyStoppingCallback::patience_counter);

  py::class_<PythonTrainer>(m, "_Trainer")
      .def(py::init([](py::object model, const TrainingArguments& args, py::object train_data,
                       py::object eval_data) {
             if (!py::isinstance<nn::GPT>(model))
               throw py::type_error("Trainer: model must be a tessera.nn.GPT, got " +
                                    std::string(py::str(py::type::of(model).attr("__name__"))));
             auto to_file = [](py::handle f) {
               return py::isinstance<data::TokenFile>(f) ? f.cast<data::TokenFile>()
                                                         : data::TokenFile(f.cast<std::string>());
             };
             std::optional<data::TokenFile> eval;
             if (!eval_data.is_none()) eval = runtime_call([&] { return to_file(eval_data); });
             data::TokenFile train_file = runtime_call([&] { return to_file(train_data); });
             auto self = std::make_unique<PythonTrainer>();
             self->model = model;
             nn::GPT& gpt = model.cast<nn::GPT&>();
             TrainingArguments run_args = args;
             run_args.data = train_file.path().string();
             if (eval) run_args.val_data = eval->path().string();
             train::validate(run_args);
             py::gil_scoped_release release;
             self->trainer = runtime_call([&] {
               return std::make_unique<train::Trainer>(run_args, gpt, std::move(train_file),
                                                       std::move(eval));
             });
             // report_to's trackers (metrics.jsonl, TensorBoard), as `tessera train` has them.
             if (self->trainer->accelerator().is_main_process())
               self->trainer->add_callback(std::make_shared<train::TrackerCallback>());
             // As `tessera train` has it (transformers needs the callback given explicitly).
             if (run_args.early_stopping_patience > 0)
               self->trainer->add_callback(std::make_shared<train::EarlyStoppingCallback>(
                   run_args.early_stopping_patience, run_args.early_stopping_threshold));
             return self;
           }),
           py::arg("model"), py::arg("args"), py::arg("train_dataset"),
           py::arg("eval_dataset") = py::none())
      .def(
          "add_callback",
          [](PythonTrainer& t, py::object cb) {
            if (py::isinstance<train::EarlyStoppingCallback>(cb)) {
              t.trainer->add_callback(cb.cast<std::shared_ptr<train::EarlyStoppingCallback>>());
              return;
            }
            check_callback(cb);
            t.trainer->add_callback(std::make_shared<PythonCallback>(std::move(cb)));
          },
          py::arg("callback"))
      .def("train",
           [](PythonTrainer& t) {
             py::gil_scoped_release release;
             runtime_call([&] { t.trainer->train(); });
           })
      .def("evaluate",
           [](PythonTrainer& t) {
             py::gil_scoped_release release;
             return runtime_call([&] { return t.trainer->evaluate(); });
           })
      .def("save_checkpoint",
           [](PythonTrainer& t) {
             py::gil_scoped_release release;
             return runtime_call([&] { return t.trainer->save_checkpoint().string(); });
           })
      .def_property_readonly(
          "state", [](const PythonTrainer& t) { return python_of(t.trainer->state().to_json()); })
      .def_property_readonly("args", [](const PythonTrainer& t) { return t.trainer->args(); })
      .def_property_readonly("model", [](const PythonTrainer& t) { return t.model; });
}

}  // namespace tessera::python
