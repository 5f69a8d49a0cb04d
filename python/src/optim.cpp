// tessera.optim: AdamW and SGD with PyTorch's argument names, the LR schedules and
// global-norm clipping. step() runs with the GIL released.
#include <unordered_map>

#include "bindings.h"

#include <tuple>

namespace tessera::python {
namespace {

py::dict state_dict_to_python(const optim::OptimizerStateDict& s) {
  py::dict out;
  out["tensors"] = s.tensors;
  out["scalars"] = s.scalars;
  return out;
}

// Refuses what torch.optim refuses before building an optimizer, with its messages: no
// parameters, a learning rate or weight decay below 0 (or NaN). A tensor listed twice is refused
// too: torch refuses it across parameter groups, and within one it only warns and then updates
// the tensor twice per step.
const std::vector<Tensor>& checked_params(const char* optimizer, const std::vector<Tensor>& params,
                                          double lr, double weight_decay) {
  const auto fail = [optimizer](const std::string& what) {
    throw py::value_error(std::string(optimizer) + ": " + what);
  };
  const auto shown = [](double v) { return std::string(py::str(py::float_(v))); };
  if (params.empty()) fail("optimizer got an empty parameter list");
  if (!(lr >= 0)) fail("Invalid learning rate: " + shown(lr));
  if (!(weight_decay >= 0)) fail("Invalid weight_decay value: " + shown(weight_decay));
  std::unordered_map<const void*, size_t> first_position;
  for (size_t i = 0; i < params.size(); ++i) {
    const auto [at, inserted] = first_position.emplace(params[i].impl_ptr().get(), i);
    if (!inserted)
      fail("some parameters appear more than once in the parameter list (parameter " +
           std::to_string(i) + " is parameter " + std::to_string(at->second) + ")");
  }
  return params;
}

// An Optimizer.state_dict() given back to load_state_dict.
optim::OptimizerStateDict state_dict_from_python(const py::dict& d) {
  const auto expected = [&d] {
    return py::value_error(
        "load_state_dict: expected what state_dict() returns, a dict with the keys 'tensors' "
        "(name -> tensor) and 'scalars' (name -> number), got one with the keys " +
        std::string(py::str(py::list(d.attr("keys")()))));
  };
  if (d.size() != 2 || !d.contains("tensors") || !d.contains("scalars")) throw expected();
  optim::OptimizerStateDict s;
  try {
    s.tensors = d["tensors"].cast<std::map<std::string, Tensor>>();
    s.scalars = d["scalars"].cast<std::map<std::string, double>>();
  } catch (const py::cast_error&) {
    throw expected();
  }
  return s;
}

void bind_optimizers(py::module_& om) {
  using namespace optim;
  py::class_<Optimizer>(om, "Optimizer")
      .def("step",
           [](Optimizer& o) {
             py::gil_scoped_release release;
             o.step();
           })
      .def("zero_grad", &Optimizer::zero_grad, py::arg("set_to_none") = true)
      .def_property("lr", &Optimizer::lr, &Optimizer::set_lr)
      .def("parameters", &Optimizer::parameters)
      .def_property_readonly("param_groups",
                             [](const Optimizer& o) {
                               py::list groups;
                               for (const ParamGroup& g : o.param_groups()) {
                                 py::dict d;
                                 d["name"] = g.name;
                                 d["lr"] = g.lr;
                                 d["initial_lr"] = g.initial_lr;
                                 d["weight_decay"] = g.weight_decay;
                                 d["params"] = g.params;
                                 groups.append(d);
                               }
                               return groups;
                             })
      .def("state_dict", [](const Optimizer& o) { return state_dict_to_python(o.state_dict()); })
      .def(
          "load_state_dict",
          [](Optimizer& o, py::dict d) { o.load_state_dict(state_dict_from_python(d)); },
          py::arg("state_dict"));
  py::class_<AdamW, Optimizer>(om, "AdamW")
      .def(py::init([](const std::vector<Tensor>& params, double lr,
                       std::pair<double, double> betas, double eps, double weight_decay) {
             return std::make_unique<AdamW>(checked_params("AdamW", params, lr, weight_decay),
                                            AdamWOptions{.lr = lr,
                                                         .beta1 = betas.first,
                                                         .beta2 = betas.second,
                                                         .eps = eps,
                                                         .weight_decay = weight_decay});
           }),
           py::arg("params"), py::arg("lr") = 1e-3, py::arg("betas") = std::pair{0.9, 0.999},
           py::arg("eps") = 1e-8, py::arg("weight_decay") = 0.01,
           "AdamW as torch.optim.AdamW; weight decay applies to tensors of rank >= 2 only");
  py::class_<SGD, Optimizer>(om, "SGD").def(
      py::init([](const std::vector<Tensor>& params, double lr, double momentum, double dampening,
                  double weight_decay, bool nesterov) {
        if (!(momentum >= 0))
          throw py::value_error("SGD: Invalid momentum value: " +
                                std::string(py::str(py::float_(momentum))));
        return std::make_unique<SGD>(checked_params("SGD", params, lr, weight_decay),
                                     SGDOptions{.lr = lr,
                                                .momentum = momentum,
                                                .dampening = dampening,
                                                .weight_decay = weight_decay,
                                                .nesterov = nesterov});
      }),
      py::arg("params"), py::arg("lr") = 1e-2, py::arg("momentum") = 0.0,
      py::arg("dampening") = 0.0, py::arg("weight_decay") = 0.0, py::arg("nesterov") = false);
}

// transformers' last_epoch resumes a LambdaLR; here load_state_dict does.
void no_last_epoch(int64_t last_epoch) {
  TESSERA_CHECK(last_epoch == -1, "last_epoch = ", last_epoch,
                " is not supported: build the schedule, then load_state_dict(saved) to resume");
}

// transformers.optimization's schedule functions, same names, arguments and defaults.
void bind_transformers_schedules(py::module_& om) {
  using namespace optim;
  using Schedule = std::unique_ptr<LRSchedule>;
  using OptInt = std::optional<int64_t>;
  using OptReal = std::optional<double>;
  om.def(
      "get_scheduler",
      [](const std::string& name, Optimizer& opt, OptInt warmup, OptInt total, std::optional<py::dict> kwargs) {
        SchedulerKwargs k;
        for (const auto& [key, value] : kwargs.value_or(py::dict())) {
          const std::string n = py::str(key);
          if (n == "num_cycles") k.num_cycles = value.cast<double>();
          else if (n == "min_lr") k.min_lr = value.cast<double>();
          else if (n == "min_lr_rate") k.min_lr_rate = value.cast<double>();
          else if (n == "lr_end") k.lr_end = value.cast<double>();
          else if (n == "power") k.power = value.cast<double>();
          else if (n == "timescale") k.timescale = value.cast<int64_t>();
          else throw py::type_error("get_scheduler: unexpected scheduler_specific_kwargs key '" + n + "'");
        }
        return get_scheduler(name, opt, warmup, total, k);
      },
      py::arg("name"), py::arg("optimizer"), py::arg("num_warmup_steps") = py::none(),
      py::arg("num_training_steps") = py::none(), py::arg("scheduler_specific_kwargs") = py::none(),
      py::keep_alive<0, 2>());
  om.def(
      "get_constant_schedule",
      [](Optimizer& opt, int64_t last_epoch) -> Schedule {
        no_last_epoch(last_epoch);
        return get_constant_schedule(opt);
      },
      py::arg("optimizer"), py::arg("last_epoch") = -1, py::keep_alive<0, 1>());
  om.def(
      "get_constant_schedule_with_warmup",
      [](Optimizer& opt, int64_t w, int64_t last_epoch) -> Schedule {
        no_last_epoch(last_epoch);
        return get_constant_schedule_with_warmup(opt, w);
      },
      py::arg("optimizer"), py::arg("num_warmup_steps"), py::arg("last_epoch") = -1, py::keep_alive<0, 1>());
  om.def(
      "get_linear_schedule_with_warmup",
      [](Optimizer& opt, int64_t w, int64_t t, int64_t last_epoch) -> Schedule {
        no_last_epoch(last_epoch);
        return get_linear_schedule_with_warmup(opt, w, t);
      },
      py::arg("optimizer"), py::arg("num_warmup_steps"), py::arg("num_training_steps"),
      py::arg("last_epoch") = -1, py::keep_alive<0, 1>());
  // The two cosines of (optimizer, warmup, total, num_cycles) differ in their default cycles.
  using Cycles = Schedule (*)(Optimizer&, int64_t, int64_t, double);
  for (const auto& [name, make, cycles] :
       {std::tuple<const char*, Cycles, double>{"get_cosine_schedule_with_warmup", &get_cosine_schedule_with_warmup, 0.5},
        {"get_cosine_with_hard_restarts_schedule_with_warmup",
         &get_cosine_with_hard_restarts_schedule_with_warmup, 1.0}})
    om.def(
        name,
        [make = make](Optimizer& opt, int64_t w, int64_t t, double num_cycles, int64_t last_epoch) -> Schedule {
          no_last_epoch(last_epoch);
          return make(opt, w, t, num_cycles);
        },
        py::arg("optimizer"), py::arg("num_warmup_steps"), py::arg("num_training_steps"),
        py::arg("num_cycles") = cycles, py::arg("last_epoch") = -1, py::keep_alive<0, 1>());
  om.def(
      "get_cosine_with_min_lr_schedule_with_warmup",
      [](Optimizer& opt, int64_t w, int64_t t, double cycles, int64_t last_epoch, OptReal min_lr,
         OptReal min_lr_rate) -> Schedule {
        no_last_epoch(last_epoch);
        return get_cosine_with_min_lr_schedule_with_warmup(opt, w, t, cycles, min_lr, min_lr_rate);
      },
      py::arg("optimizer"), py::arg("num_warmup_steps"), py::arg("num_training_steps"),
      py::arg("num_cycles") = 0.5, py::arg("last_epoch") = -1, py::arg("min_lr") = py::none(),
      py::arg("min_lr_rate") = py::none(), py::keep_alive<0, 1>());
  om.def(
      "get_polynomial_decay_schedule_with_warmup",
      [](Optimizer& opt, int64_t w, int64_t t, double lr_end, double power, int64_t last_epoch) -> Schedule {
        no_last_epoch(last_epoch);
        return get_polynomial_decay_schedule_with_warmup(opt, w, t, lr_end, power);
      },
      py::arg("optimizer"), py::arg("num_warmup_steps"), py::arg("num_training_steps"),
      py::arg("lr_end") = 1e-7, py::arg("power") = 1.0, py::arg("last_epoch") = -1, py::keep_alive<0, 1>());
  om.def(
      "get_inverse_sqrt_schedule",
      [](Optimizer& opt, int64_t w, OptInt timescale, int64_t last_epoch) -> Schedule {
        no_last_epoch(last_epoch);
        return get_inverse_sqrt_schedule(opt, w, timescale);
      },
      py::arg("optimizer"), py::arg("num_warmup_steps"), py::arg("timescale") = py::none(),
      py::arg("last_epoch") = -1, py::keep_alive<0, 1>());
}

void bind_schedules(py::module_& om) {
  using namespace optim;
  py::class_<LRSchedule>(om, "LRSchedule")
      .def("step", &LRSchedule::step)
      .def_property_readonly("current_step", &LRSchedule::current_step)
      .def("get_last_lr", [](const LRSchedule& s) { return std::vector<double>{s.last_lr()}; })
      .def("lr_at", &LRSchedule::lr_at, py::arg("step"))
      .def("factor", &LRSchedule::factor, py::arg("step"))
      .def("state_dict", &LRSchedule::state_dict)
      .def("load_state_dict", &LRSchedule::load_state_dict, py::arg("state_dict"));
  // Each schedule keeps a reference to its optimizer (keep_alive).
#define TESSERA_SCHEDULE(Class)                                                              \
  py::class_<Class, LRSchedule>(om, #Class)                                                  \
      .def(py::init([](Optimizer& opt, int64_t warmup, int64_t total, double min_lr) {       \
             return std::make_unique<Class>(                                                 \
                 opt, ScheduleOptions{.warmup = warmup, .total = total, .min_lr = min_lr});  \
           }),                                                                               \
           py::arg("optimizer"), py::kw_only(), py::arg("warmup") = 0, py::arg("total") = 0, \
           py::arg("min_lr") = 0.0, py::keep_alive<1, 2>())
  TESSERA_SCHEDULE(ConstantSchedule);
  TESSERA_SCHEDULE(CosineSchedule);
  TESSERA_SCHEDULE(LinearSchedule);
#undef TESSERA_SCHEDULE
  bind_transformers_schedules(om);
}

}  // namespace

void bind_optim(py::module_& m) {
  py::module_ om = m.def_submodule("optim", "AdamW, SGD, LR schedules, gradient clipping");
  bind_optimizers(om);
  bind_schedules(om);
  om.def(
      "clip_grad_norm_",
      [](const std::vector<Tensor>& params, double max_norm) {
        py::gil_scoped_release release;
        return optim::clip_grad_norm_(params, max_norm);
      },
      py::arg("parameters"), py::arg("max_norm"),
      "Scales gradients to global L2 norm <= max_norm; returns the norm");
  om.def("grad_norm", &optim::grad_norm, py::arg("parameters"));
}

}  // namespace tessera::python
