// tessera.data's datasets of labelled examples, samplers and collators (data/example_*.h,
// data/sampler.h, data/collator.h). Features come from Python as transformers gives them: a
// list of dicts (or a dict of lists) whose input_ids / token_type_ids / attention_mask are
// lists or NumPy arrays of ints and whose "label" ("labels", "label_ids") is an int (class
// id), a float (regression target) or None.
#include "bindings.h"

namespace tessera::python {
namespace {

// Features converted once: the Example views point into `storage`.
struct OwnedFeatures {
  std::vector<std::vector<uint32_t>> storage;
  std::vector<data::Example> examples;
};

std::vector<uint32_t> token_list(py::handle values, size_t row, const char* key) {
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> array =
      py::module_::import("numpy").attr("asarray")(values, "int64");
  TESSERA_CHECK(array.ndim() == 1, "feature ", row, ": '", key, "' must be one list of ints, not ",
                array.ndim(), "-dimensional");
  std::vector<uint32_t> out(static_cast<size_t>(array.size()));
  const int64_t* v = array.data();
  for (size_t i = 0; i < out.size(); ++i) {
    TESSERA_CHECK(v[i] >= 0 && v[i] <= int64_t(UINT32_MAX), "feature ", row, ": '", key, "'[", i,
                  "] is ", v[i], "; ids must be in [0, 2^32)");
    out[i] = static_cast<uint32_t>(v[i]);
  }
  return out;
}

std::variant<std::monostate, int64_t, double> label_of(py::handle feature, size_t row) {
  for (const char* key : {"label", "labels", "label_ids"}) {
    if (!feature.contains(key)) continue;
    py::object value = feature[key];
    if (value.is_none()) return std::monostate();
    if (py::hasattr(value, "item") && !py::isinstance<py::int_>(value) &&
        !py::isinstance<py::float_>(value))
      value = value.attr("item")();  // a NumPy scalar
    if (py::isinstance<py::float_>(value)) return value.cast<double>();
    TESSERA_CHECK(py::isinstance<py::int_>(value), "feature ", row, ": '", key,
                  "' must be an int (a class id) or a float (a regression target), not ",
                  std::string(py::str(value.get_type().attr("__name__"))));
    return value.cast<int64_t>();
  }
  return std::monostate();
}

// A list of mappings, or one mapping of equally long columns (a batch in column form).
std::vector<py::object> rows_of(py::handle features) {
  std::vector<py::object> rows;
  if (py::isinstance<py::dict>(features)) {
    py::dict columns = py::reinterpret_borrow<py::dict>(features);
    TESSERA_CHECK(columns.contains("input_ids"), "features: no 'input_ids' column");
    const size_t n = py::len(columns["input_ids"]);
    for (size_t i = 0; i < n; ++i) {
      py::dict row;
      for (const auto& [key, column] : columns) {
        TESSERA_CHECK(py::len(column) == n, "features: column '", std::string(py::str(key)),
                      "' has ", py::len(column), " rows, 'input_ids' has ", n);
        row[key] = column[py::int_(i)];
      }
      rows.push_back(row);
    }
    return rows;
  }
  for (py::handle f : features) rows.push_back(py::reinterpret_borrow<py::object>(f));
  return rows;
}

OwnedFeatures convert_features(py::handle features) {
  const std::vector<py::object> rows = rows_of(features);
  OwnedFeatures out;
  out.storage.reserve(rows.size() * 3);  // no reallocation: the views point into it
  for (size_t i = 0; i < rows.size(); ++i) {
    const py::object& f = rows[i];
    TESSERA_CHECK(py::isinstance<py::dict>(f) || py::hasattr(f, "keys"), "feature ", i,
                  " must be a dict (of input_ids, ...), not ",
                  std::string(py::str(f.get_type().attr("__name__"))));
    TESSERA_CHECK(f.contains("input_ids"), "feature ", i, " has no 'input_ids'");
    data::Example e;
    const auto column = [&](const char* key) -> std::span<const uint32_t> {
      if (!f.contains(key) || f[key].is_none()) return {};
      out.storage.push_back(token_list(f[key], i, key));
      return out.storage.back();
    };
    e.input_ids = column("input_ids");
    e.token_type_ids = column("token_type_ids");
    e.attention_mask = column("attention_mask");
    e.label = label_of(f, i);
    out.examples.push_back(e);
  }
  return out;
}

py::dict batch_dict(const data::ExampleBatch& b) {
  py::dict out;
  out["input_ids"] = b.input_ids;
  if (b.token_type_ids.defined()) out["token_type_ids"] = b.token_type_ids;
  out["attention_mask"] = b.attention_mask;
  if (b.labels.defined()) out["labels"] = b.labels;
  return out;
}

// transformers' padding= (True / "longest", "max_length", False / "do_not_pad") and the rest.
data::PaddingOptions padding_options(py::handle padding, py::handle max_length,
                                     py::handle pad_to_multiple_of, const std::string& side,
                                     py::handle pad_token_id) {
  data::PaddingOptions o;
  if (py::isinstance<py::str>(padding))
    o.padding = data::parse_padding_strategy(padding.cast<std::string>());
  else
    o.padding = padding.cast<bool>() ? data::PaddingStrategy::Longest : data::PaddingStrategy::DoNotPad;
  if (!max_length.is_none()) o.max_length = max_length.cast<size_t>();
  if (!pad_to_multiple_of.is_none()) o.pad_to_multiple_of = pad_to_multiple_of.cast<size_t>();
  o.padding_side = data::parse_side(side, "padding_side");
  if (!pad_token_id.is_none()) o.pad_token_id = pad_token_id.cast<uint32_t>();
  return o;
}

// The collator's pad token: pad_token_id when given, else the tokenizer's.
data::PaddingOptions with_pad_token(data::PaddingOptions o, const data::Tokenizer* tokenizer,
                                    py::handle pad_token_id, const char* who) {
  if (!pad_token_id.is_none()) return o;
  TESSERA_CHECK(tokenizer != nullptr, who, ": pass a tokenizer (its pad token pads) or pad_token_id");
  const std::optional<uint32_t> id = data::pad_token_id_of(*tokenizer);
  TESSERA_CHECK(id.has_value(), who, ": the ", tokenizer->type(),
                " tokenizer has no pad token; pass pad_token_id");
  o.pad_token_id = *id;
  if (o.padding == data::PaddingStrategy::MaxLength && o.max_length == 0)
    if (const auto* wp = dynamic_cast<const data::WordPieceTokenizer*>(tokenizer))
      o.max_length = wp->config().model_max_length;
  return o;
}

template <class Collator>
void bind_call(py::class_<Collator>& cls) {
  cls.def(
      "__call__",
      [](const Collator& c, py::handle features) {
        const OwnedFeatures owned = convert_features(features);
        data::ExampleBatch b;
        {
          py::gil_scoped_release release;
          b = c(owned.examples);
        }
        return batch_dict(b);
      },
      py::arg("features"),
      "A list of feature dicts (or a dict of columns) -> a dict of int64 [B, T] tensors");
  cls.def_property_readonly("pad_token_id",
                            [](const Collator& c) { return c.options().pad_token_id; });
}

py::dict example_dict(const data::Example& e) {
  py::dict out;
  out["input_ids"] = std::vector<uint32_t>(e.input_ids.begin(), e.input_ids.end());
  if (!e.token_type_ids.empty())
    out["token_type_ids"] = std::vector<uint32_t>(e.token_type_ids.begin(), e.token_type_ids.end());
  if (e.label.index() == 1) out["label"] = std::get<int64_t>(e.label);
  if (e.label.index() == 2) out["label"] = std::get<double>(e.label);
  return out;
}

data::ExampleDatasetOptions dataset_options(py::handle format, const std::string& text_column,
                                            py::handle text_pair_column, py::handle label_column,
                                            const std::string& label_type, py::handle label_list,
                                            int64_t num_labels, bool add_special_tokens,
                                            py::handle truncation, py::handle max_length,
                                            bool allow_empty_text, bool use_cache,
                                            py::handle cache_dir) {
  data::ExampleDatasetOptions o;
  if (!format.is_none()) o.format = data::parse_table_format(format.cast<std::string>());
  o.text_column = text_column;
  if (!text_pair_column.is_none()) o.text_pair_column = text_pair_column.cast<std::string>();
  o.label_column = label_column.is_none() ? "" : label_column.cast<std::string>();
  o.label_type = data::parse_label_type(label_type);
  if (py::isinstance<py::dict>(label_list)) {  // transformers' label2id: name -> id
    const auto label2id = label_list.cast<std::map<std::string, int64_t>>();
    o.label_list.resize(label2id.size());
    for (const auto& [name, id] : label2id) {
      TESSERA_CHECK(id >= 0 && id < static_cast<int64_t>(label2id.size()) &&
                        o.label_list[static_cast<size_t>(id)].empty(),
                    "label2id: the ids must be 0 .. ", label2id.size() - 1, " once each; '", name,
                    "' has ", id);
      o.label_list[static_cast<size_t>(id)] = name;
    }
  } else if (!label_list.is_none()) {
    o.label_list = label_list.cast<std::vector<std::string>>();
  }
  o.num_labels = num_labels;
  o.add_special_tokens = add_special_tokens;
  if (py::isinstance<py::str>(truncation)) {
    o.truncation_strategy = data::parse_truncation_strategy(truncation.cast<std::string>());
  } else {
    o.truncation = truncation.cast<bool>();
  }
  if (!max_length.is_none()) o.max_length = max_length.cast<size_t>();
  o.allow_empty_text = allow_empty_text;
  o.use_cache = use_cache;
  if (!cache_dir.is_none()) o.cache_dir = cache_dir.cast<std::string>();
  return o;
}

void bind_example_datasets(py::module_& dm) {
  using namespace data;
  py::class_<ExampleDataset>(dm, "ExampleDataset")
      .def(py::init([](const std::string& path, const Tokenizer& tokenizer, py::handle format,
                       const std::string& text_column, py::handle text_pair_column,
                       py::handle label_column, const std::string& label_type,
                       py::handle label_list, int64_t num_labels, bool add_special_tokens,
                       py::handle truncation, py::handle max_length, bool allow_empty_text,
                       bool use_cache, py::handle cache_dir) {
             const ExampleDatasetOptions o = dataset_options(
                 format, text_column, text_pair_column, label_column, label_type, label_list,
                 num_labels, add_special_tokens, truncation, max_length, allow_empty_text,
                 use_cache, cache_dir);
             py::gil_scoped_release release;
             return ExampleDataset::load(path, tokenizer, o);
           }),
           py::arg("path"), py::arg("tokenizer"), py::kw_only(), py::arg("format") = py::none(),
           py::arg("text_column") = "text", py::arg("text_pair_column") = py::none(),
           py::arg("label_column") = "label", py::arg("label_type") = "auto",
           py::arg("label_list") = py::none(), py::arg("num_labels") = 0,
           py::arg("add_special_tokens") = true, py::arg("truncation") = py::bool_(true),
           py::arg("max_length") = py::none(), py::arg("allow_empty_text") = false,
           py::arg("use_cache") = true, py::arg("cache_dir") = py::none())
      .def("__len__", &ExampleDataset::size)
      .def("__getitem__",
           [](const ExampleDataset& d, int64_t i) {
             if (i < 0) i += d.size();
             if (i < 0 || i >= d.size()) throw py::index_error("ExampleDataset index out of range");
             return example_dict(d[i]);
           })
      .def("lengths", &ExampleDataset::lengths)
      .def("source_line", &ExampleDataset::source_line, py::arg("index"))
      .def_property_readonly("num_labels", &ExampleDataset::num_labels)
      .def_property_readonly("label_names", &ExampleDataset::label_names)
      .def_property_readonly("label2id", &ExampleDataset::label2id)
      .def_property_readonly("id2label",
                             [](const ExampleDataset& d) {
                               std::map<int64_t, std::string> out;
                               for (size_t i = 0; i < d.label_names().size(); ++i)
                                 out[static_cast<int64_t>(i)] = d.label_names()[i];
                               return out;
                             })
      .def_property_readonly("problem_type",
                             [](const ExampleDataset& d) -> py::object {
                               if (d.label_kind() == LabelKind::Class)
                                 return py::str("single_label_classification");
                               if (d.label_kind() == LabelKind::Regression)
                                 return py::str("regression");
                               return py::none();
                             })
      .def_property_readonly("loaded_from_cache", &ExampleDataset::loaded_from_cache)
      .def_property_readonly("tokenized_examples", &ExampleDataset::tokenized_examples)
      .def_property_readonly("cache_rebuild_reason", &ExampleDataset::cache_rebuild_reason)
      .def_property_readonly("cache_path",
                             [](const ExampleDataset& d) { return d.cache_path().string(); });

  py::class_<DistributedSampler>(dm, "DistributedSampler")
      .def(py::init([](py::handle dataset, int num_replicas, int rank, bool shuffle,
                       uint64_t seed, bool drop_last, std::optional<std::vector<int64_t>> lengths,
                       int64_t batch_size) {
             // torch takes the dataset; a size does as well.
             const int64_t dataset_size = py::isinstance<py::int_>(dataset)
                                              ? dataset.cast<int64_t>()
                                              : static_cast<int64_t>(py::len(dataset));
             return DistributedSampler(dataset_size, {.num_replicas = num_replicas,
                                                      .rank = rank,
                                                      .shuffle = shuffle,
                                                      .seed = seed,
                                                      .drop_last = drop_last,
                                                      .lengths = lengths.value_or(std::vector<int64_t>{}),
                                                      .batch_size = batch_size});
           }),
           py::arg("dataset"), py::kw_only(), py::arg("num_replicas") = 1,
           py::arg("rank") = 0, py::arg("shuffle") = true, py::arg("seed") = 0,
           py::arg("drop_last") = false, py::arg("lengths") = py::none(),
           py::arg("batch_size") = 1)
      .def("set_epoch", &DistributedSampler::set_epoch, py::arg("epoch"))
      .def_property_readonly("epoch", &DistributedSampler::epoch)
      .def("indices", &DistributedSampler::indices)
      .def("__len__", &DistributedSampler::size)
      .def("__iter__", [](const DistributedSampler& s) {
        return py::iter(py::cast(s.indices()));
      });
  py::class_<EvalSampler>(dm, "EvalSampler")
      .def(py::init<int64_t, int64_t, int, int>(), py::arg("dataset_size"), py::arg("batch_size"),
           py::kw_only(), py::arg("rank") = 0, py::arg("num_replicas") = 1)
      .def("__len__", &EvalSampler::size)
      .def(
          "batch",
          [](const EvalSampler& s, int64_t k) {
            const EvalBatchIndices b = s.batch(k);
            return py::make_tuple(b.indices, b.real_examples);
          },
          py::arg("k"), "(indices, real_examples) of this rank's batch k");
  dm.def("seeded_permutation", &seeded_permutation, py::arg("n"), py::arg("seed"),
         py::arg("epoch") = 0);
}

}  // namespace

void bind_examples(py::module_& dm) {
  using namespace data;
  py::class_<DataCollatorWithPadding> padding(dm, "DataCollatorWithPadding");
  padding.def(py::init([](const Tokenizer* tokenizer, py::handle padding, py::handle max_length,
                          py::handle pad_to_multiple_of, const std::string& padding_side,
                          py::handle pad_token_id) {
                PaddingOptions o = padding_options(padding, max_length, pad_to_multiple_of,
                                                   padding_side, pad_token_id);
                return DataCollatorWithPadding(
                    with_pad_token(o, tokenizer, pad_token_id, "DataCollatorWithPadding"));
              }),
              py::arg("tokenizer") = nullptr, py::arg("padding") = py::bool_(true),
              py::arg("max_length") = py::none(), py::arg("pad_to_multiple_of") = py::none(),
              py::kw_only(), py::arg("padding_side") = "right",
              py::arg("pad_token_id") = py::none());
  bind_call(padding);
  py::class_<DataCollatorForLanguageModeling> lm(dm, "DataCollatorForLanguageModeling");
  // mlm defaults to True as in transformers, and only mlm=False (causal LMs) is supported.
  lm.def(py::init([](const Tokenizer* tokenizer, bool mlm, py::handle pad_to_multiple_of,
                     const std::string& padding_side, py::handle pad_token_id) {
           TESSERA_CHECK(!mlm, "DataCollatorForLanguageModeling: mlm=True (masked language ",
                         "modelling, transformers' default) is not supported; pass mlm=False");
           PaddingOptions o = padding_options(py::bool_(true), py::none(), pad_to_multiple_of,
                                              padding_side, pad_token_id);
           return DataCollatorForLanguageModeling(
               with_pad_token(o, tokenizer, pad_token_id, "DataCollatorForLanguageModeling"));
         }),
         py::arg("tokenizer") = nullptr, py::arg("mlm") = true,
         py::arg("pad_to_multiple_of") = py::none(), py::kw_only(),
         py::arg("padding_side") = "right", py::arg("pad_token_id") = py::none());
  bind_call(lm);
  bind_example_datasets(dm);
}

}  // namespace tessera::python
