// tessera.Trainer and tessera.TrainingArguments: Hugging Face's names over train::Trainer.
// Arguments are given as keywords (any name the config file or `tessera train` accepts) and
// checked by the library; Python callbacks see logs, evaluations and saves. The model picks
// the task: a causal LM (GPT, Llama) on token files, or a sequence classifier on
// ExampleDatasets with a collator and compute_metrics over transformers' EvalPrediction.
#include <cmath>

#include "bindings.h"
#include "tessera/train/trainer.h"
#include "tessera/train/metrics.h"
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
  void on_evaluate(const train::TrainingArguments&, train::TrainerState& s,
                   train::TrainerControl& c, const train::Metrics& metrics) override {
    // transformers logs an evaluation too: on_log sees the eval_* metrics with epoch and step.
    call(c, "on_log", [&] {
      nlohmann::json logs(metrics);
      logs["epoch"] = s.epoch;
      logs["step"] = s.global_step;
      return python_of(logs);
    });
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

// A Python compute_metrics(eval_pred) -> dict as the C++ hook: eval_pred is transformers'
// EvalPrediction (tessera._trainer) of NumPy arrays. Copies of the hook travel without the
// GIL, so the callable is held through hold_python_object.
train::ComputePredictionMetrics python_compute_metrics(py::object fn) {
  if (fn.is_none()) return {};
  if (!PyCallable_Check(fn.ptr()))
    throw py::type_error("Trainer: compute_metrics must be callable, got " +
                         std::string(py::str(py::type::of(fn).attr("__name__"))));
  std::shared_ptr<void> held = hold_python_object(fn);
  return [held](const train::EvalPrediction& p) {
    py::gil_scoped_acquire gil;
    py::object numpy_array = py::module_::import("numpy").attr("array");
    py::object labels = p.label_ids.defined() ? numpy_array(py::cast(p.label_ids)) : py::none();
    py::object eval_pred = py::module_::import("tessera._trainer")
                               .attr("EvalPrediction")(numpy_array(py::cast(p.predictions)), labels);
    py::object result = (*static_cast<py::object*>(held.get()))(eval_pred);
    if (!py::isinstance<py::dict>(result))
      throw py::type_error("Trainer: compute_metrics must return a dict of name -> number, got " +
                           std::string(py::str(py::type::of(result).attr("__name__"))));
    train::Metrics metrics;
    for (auto [name, value] : py::reinterpret_borrow<py::dict>(result))
      metrics[std::string(py::str(name))] =
          py::module_::import("builtins").attr("float")(value).cast<double>();
    return metrics;
  };
}

data::Collator collator_of(py::handle collator) {
  if (!py::isinstance<data::DataCollatorWithPadding>(collator))
    throw py::type_error(
        "Trainer: data_collator must be a tessera.data.DataCollatorWithPadding for a sequence "
        "classifier, got " + std::string(py::str(py::type::of(collator).attr("__name__"))));
  auto padding = collator.cast<data::DataCollatorWithPadding>();
  return [padding](std::span<const data::Example> examples) { return padding(examples); };
}

data::ExampleDataset example_dataset(py::handle dataset, const char* argument) {
  if (!py::isinstance<data::ExampleDataset>(dataset))
    throw py::type_error(std::string("Trainer: ") + argument +
                         " must be a tessera.data.ExampleDataset for a sequence classifier, got " +
                         std::string(py::str(py::type::of(dataset).attr("__name__"))));
  return dataset.cast<data::ExampleDataset>();
}

data::TokenFile token_file(py::handle f) {
  return runtime_call([&] {
    return py::isinstance<data::TokenFile>(f) ? f.cast<data::TokenFile>()
                                              : data::TokenFile(f.cast<std::string>());
  });
}

// The Trainer of a causal language model (GPT, Llama) on token files.
std::unique_ptr<train::Trainer> language_model_trainer(train::TrainingArguments args,
                                                       nn::CausalLM& model, py::handle train_data,
                                                       py::handle eval_data) {
  std::optional<data::TokenFile> eval;
  if (!eval_data.is_none()) eval = token_file(eval_data);
  data::TokenFile train_file = token_file(train_data);
  args.data = train_file.path().string();
  if (eval) args.val_data = eval->path().string();
  train::validate(args);
  py::gil_scoped_release release;
  return runtime_call([&] {
    return std::make_unique<train::Trainer>(args, model, std::move(train_file), std::move(eval));
  });
}

std::unique_ptr<train::Trainer> classifier_trainer(train::TrainingArguments args,
                                                   nn::SequenceClassifier& model,
                                                   py::handle train_data, py::handle eval_data,
                                                   py::handle collator, py::object compute_metrics) {
  data::ExampleDataset train_set = example_dataset(train_data, "train_dataset");
  std::optional<data::ExampleDataset> eval_set;
  if (!eval_data.is_none()) eval_set = example_dataset(eval_data, "eval_dataset");
  data::Collator collate = collator_of(collator);
  train::ComputePredictionMetrics metrics = python_compute_metrics(std::move(compute_metrics));
  train::validate(args, /*needs_token_file=*/false);
  py::gil_scoped_release release;
  return runtime_call([&] {
    return std::make_unique<train::Trainer>(args, model, std::move(train_set), std::move(eval_set),
                                            std::move(collate), std::move(metrics));
  });
}

py::tuple prediction_tuple(const train::PredictionOutput& out) {
  py::object numpy_array = py::module_::import("numpy").attr("array");
  return py::make_tuple(numpy_array(py::cast(out.predictions)),
                        out.label_ids.defined() ? numpy_array(py::cast(out.label_ids)) : py::none(),
                        py::cast(out.metrics));
}

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
                       py::object eval_data, py::object collator, py::object compute_metrics) {
             auto self = std::make_unique<PythonTrainer>();
             self->model = model;
             if (py::isinstance<nn::SequenceClassifier>(model)) {
               self->trainer = classifier_trainer(args, model.cast<nn::SequenceClassifier&>(),
                                                  train_data, eval_data, collator,
                                                  std::move(compute_metrics));
             } else if (py::isinstance<nn::GPT>(model) || py::isinstance<nn::Llama>(model)) {
               nn::CausalLM& lm = py::isinstance<nn::GPT>(model)
                                      ? static_cast<nn::CausalLM&>(model.cast<nn::GPT&>())
                                      : static_cast<nn::CausalLM&>(model.cast<nn::Llama&>());
               self->trainer = language_model_trainer(args, lm, train_data, eval_data);
             } else {
               throw py::type_error(
                   "Trainer: model must be a tessera.nn.GPT, Llama or a sequence classifier "
                   "(BertForSequenceClassification, ...), got " +
                   std::string(py::str(py::type::of(model).attr("__name__"))));
             }
             const TrainingArguments& run_args = self->trainer->args();
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
           py::arg("eval_dataset") = py::none(), py::arg("data_collator") = py::none(),
           py::arg("compute_metrics") = py::none())
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
      .def(
          "_predict",
          [](PythonTrainer& t, py::object dataset) {
            data::ExampleDataset examples = example_dataset(dataset, "predict's test_dataset");
            train::PredictionOutput out;
            {
              py::gil_scoped_release release;
              out = runtime_call([&] { return t.trainer->predict(examples); });
            }
            return prediction_tuple(out);
          },
          py::arg("test_dataset"))
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
