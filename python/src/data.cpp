// tessera.data: token files, tokenizers and the DataLoader (iterable, like PyTorch's).
#include "bindings.h"
#include "tessera/data/wordpiece_vocab.h"

namespace tessera::python {

void bind_examples(py::module_& dm);  // data_examples.cpp

namespace {

// Python iteration over a DataLoader: the same bound as the C++ range-for (stops when the
// position reaches max_batches; endless when max_batches is 0).
struct LoaderIterator {
  data::DataLoader* loader;
  int64_t remaining;  // < 0: endless
};

py::tuple batch_tuple(const data::Batch& b) { return py::make_tuple(b.x, b.y); }

// transformers' __call__ arguments: truncation True/False or a strategy's name, padding
// True/False or "longest"/"max_length"/"do_not_pad", max_length None or a count.
data::EncodeOptions encode_options(bool add_special_tokens, py::handle truncation,
                                   py::handle max_length, py::handle padding,
                                   py::handle pad_to_multiple_of,
                                   const std::string& truncation_side,
                                   const std::string& padding_side) {
  data::EncodeOptions o;
  o.add_special_tokens = add_special_tokens;
  if (py::isinstance<py::str>(truncation)) {
    const std::string name = truncation.cast<std::string>();
    o.truncation = name != "do_not_truncate";
    if (o.truncation) o.truncation_strategy = data::parse_truncation_strategy(name);
  } else {
    o.truncation = truncation.cast<bool>();
  }
  if (py::isinstance<py::str>(padding))
    o.padding = data::parse_padding_strategy(padding.cast<std::string>());
  else
    o.padding =
        padding.cast<bool>() ? data::PaddingStrategy::Longest : data::PaddingStrategy::DoNotPad;
  if (!max_length.is_none()) o.max_length = max_length.cast<size_t>();
  if (!pad_to_multiple_of.is_none()) o.pad_to_multiple_of = pad_to_multiple_of.cast<size_t>();
  o.truncation_side = data::parse_side(truncation_side, "truncation_side");
  o.padding_side = data::parse_side(padding_side, "padding_side");
  return o;
}

// A dict of lists (one text) or of lists of lists (a batch), as transformers returns them.
py::dict encodings_dict(const std::vector<data::Encoding>& batch, bool single,
                        bool return_special_tokens_mask) {
  py::dict out;
  const auto column = [&](const char* key, std::vector<uint32_t> data::Encoding::*field) {
    py::list rows;
    for (const data::Encoding& e : batch) rows.append(py::cast(e.*field));
    out[key] = single ? rows[0] : py::object(rows);
  };
  column("input_ids", &data::Encoding::input_ids);
  column("token_type_ids", &data::Encoding::token_type_ids);
  column("attention_mask", &data::Encoding::attention_mask);
  if (return_special_tokens_mask)
    column("special_tokens_mask", &data::Encoding::special_tokens_mask);
  return out;
}

std::vector<std::string> texts_of(py::handle text, const char* what) {
  if (py::isinstance<py::str>(text)) return {text.cast<std::string>()};
  TESSERA_CHECK(py::isinstance<py::sequence>(text), what, " must be a str or a list of str");
  return text.cast<std::vector<std::string>>();
}

void bind_wordpiece(py::module_& dm) {
  using namespace data;
  py::class_<WordPieceTokenizer, Tokenizer> cls(dm, "WordPieceTokenizer");
  cls.def_static(
         "from_vocab_file",
         [](const std::string& vocab, std::optional<std::string> config) {
           return runtime_call([&] {
             return WordPieceTokenizer::from_vocab_file(
                 vocab, config ? std::optional<std::filesystem::path>(*config) : std::nullopt);
           });
         },
         py::arg("vocab_file"), py::arg("tokenizer_config") = py::none())
      .def(
          "__call__",
          [](const WordPieceTokenizer& t, py::handle text, py::handle text_pair,
             bool add_special_tokens, py::handle truncation, py::handle max_length,
             py::handle padding, py::handle pad_to_multiple_of, const std::string& truncation_side,
             const std::string& padding_side, bool return_special_tokens_mask) {
            const EncodeOptions o =
                encode_options(add_special_tokens, truncation, max_length, padding,
                               pad_to_multiple_of, truncation_side, padding_side);
            const std::vector<std::string> texts = texts_of(text, "text");
            const std::vector<std::string> pairs =
                text_pair.is_none() ? std::vector<std::string>() : texts_of(text_pair, "text_pair");
            std::vector<Encoding> batch;
            {
              py::gil_scoped_release release;
              batch = runtime_call([&] { return t.encode_batch(texts, pairs, o); });
            }
            return encodings_dict(batch, py::isinstance<py::str>(text), return_special_tokens_mask);
          },
          py::arg("text"), py::arg("text_pair") = py::none(), py::kw_only(),
          py::arg("add_special_tokens") = true, py::arg("truncation") = false,
          py::arg("max_length") = py::none(), py::arg("padding") = false,
          py::arg("pad_to_multiple_of") = py::none(), py::arg("truncation_side") = "right",
          py::arg("padding_side") = "right", py::arg("return_special_tokens_mask") = false,
          "transformers' tokenizer call: a dict of input_ids, token_type_ids, attention_mask")
      .def(
          "encode",
          [](const WordPieceTokenizer& t, const std::string& text, std::optional<std::string> pair,
             bool add_special_tokens) {
            EncodeOptions o;
            o.add_special_tokens = add_special_tokens;
            py::gil_scoped_release release;
            return (pair ? t.encode_pair(text, *pair, o) : t.encode(text, o)).input_ids;
          },
          py::arg("text"), py::arg("text_pair") = py::none(), py::arg("add_special_tokens") = true)
      .def(
          "decode",
          [](const WordPieceTokenizer& t, const std::vector<uint32_t>& ids, bool skip) {
            return runtime_call([&] { return t.decode(ids, skip); });
          },
          py::arg("ids"), py::arg("skip_special_tokens") = false)
      .def("token_to_id", &WordPieceTokenizer::token_to_id, py::arg("token"))
      .def("num_special_tokens_to_add", &WordPieceTokenizer::num_special_tokens_to_add,
           py::arg("pair") = false)
      .def_property_readonly(
          "model_max_length",
          [](const WordPieceTokenizer& t) { return t.config().model_max_length; })
      .def(
          "save_pretrained",
          [](const WordPieceTokenizer& t, const std::string& d) {
            runtime_call([&] { t.save_files(d); });
          },
          py::arg("save_directory"));
  // A vocabulary counted from text (data/wordpiece_vocab.h), for a model trained from scratch:
  // WordPieceTokenizer.from_vocab_list(build_wordpiece_vocab(texts)).
  dm.def(
      "build_wordpiece_vocab",
      [](const std::vector<std::string>& texts, int64_t vocab_size, int64_t min_frequency, bool lowercase) {
        py::gil_scoped_release release;
        return runtime_call([&] {
          return build_wordpiece_vocab(texts, {.vocab_size = vocab_size, .min_frequency = min_frequency,
                                               .lowercase = lowercase});
        });
      },
      py::arg("texts"), py::kw_only(), py::arg("vocab_size") = 4000, py::arg("min_frequency") = 2,
      py::arg("lowercase") = true);
  cls.def_static(
      "from_vocab_list",
      [](const std::vector<std::string>& vocab, bool lowercase) {
        return runtime_call([&] { return WordPieceTokenizer(WordPieceTokenizer::bert_config(vocab, lowercase)); });
      },
      py::arg("vocab"), py::kw_only(), py::arg("do_lower_case") = true,
      "a BERT tokenizer ([CLS] text [SEP], BertNormalizer) over this id -> token list");
  // transformers' cls_token / cls_token_id, ... (None when the tokenizer has none).
  for (const std::string role :
       {"cls_token", "sep_token", "pad_token", "unk_token", "mask_token"}) {
    cls.def_property_readonly(role.c_str(),
                              [role](const WordPieceTokenizer& t) { return t.role_token(role); });
    cls.def_property_readonly((role + "_id").c_str(),
                              [role](const WordPieceTokenizer& t) { return t.role_id(role); });
  }
}

void bind_tokenizers(py::module_& dm) {
  using namespace data;
  py::class_<Tokenizer>(dm, "Tokenizer")
      .def_property_readonly("type", &Tokenizer::type)
      .def_property_readonly("vocab_size", &Tokenizer::vocab_size)
      .def(
          "encode",
          [](const Tokenizer& t, const std::string& text) {
            py::gil_scoped_release release;
            return t.encode(text);
          },
          py::arg("text"))
      .def(
          "decode",
          [](const Tokenizer& t, const std::vector<uint32_t>& ids) {
            return py::bytes(t.decode(ids)).attr("decode")("utf-8", "replace");
          },
          py::arg("ids"))
      .def(
          "decode_bytes",
          [](const Tokenizer& t, const std::vector<uint32_t>& ids) {
            return py::bytes(t.decode(ids));
          },
          py::arg("ids"))
      .def(
          "token_bytes",
          [](const Tokenizer& t, uint32_t id) { return py::bytes(t.token_bytes(id)); },
          py::arg("id"))
      .def("to_json", &Tokenizer::to_json)
      .def(
          "save",
          [](const Tokenizer& t, const std::string& p) { runtime_call([&] { t.save(p); }); },
          py::arg("path"))
      .def(
          "save_files",
          [](const Tokenizer& t, const std::string& d) { runtime_call([&] { t.save_files(d); }); },
          py::arg("directory"));
  py::class_<ByteTokenizer, Tokenizer>(dm, "ByteTokenizer").def(py::init<>());
  py::class_<BpeTokenizer, Tokenizer>(dm, "BpeTokenizer")
      .def_static(
          "train",
          [](const std::string& corpus, int64_t vocab_size) {
            py::gil_scoped_release release;
            return BpeTokenizer::train(corpus, vocab_size);
          },
          py::arg("corpus"), py::arg("vocab_size"))
      .def_static(
          "from_gpt2_files",
          [](const std::string& encoder, const std::string& vocab) {
            return runtime_call([&] { return BpeTokenizer::from_gpt2_files(encoder, vocab); });
          },
          py::arg("encoder_json"), py::arg("vocab_bpe"))
      .def(
          "token_id", [](const BpeTokenizer& t, const std::string& b) { return t.token_id(b); },
          py::arg("token_bytes"));
  bind_wordpiece(dm);
  dm.def(
      "load_tokenizer",
      [](const std::string& path) {
        return runtime_call([&] {
          std::unique_ptr<Tokenizer> t = load_tokenizer_from(path);
          TESSERA_CHECK(t != nullptr, "load_tokenizer: '", path,
                        "' holds no tokenizer.json, vocab.json + merges.txt, ",
                        "encoder.json + vocab.bpe or vocab.txt");
          return t;
        });
      },
      py::arg("path"),
      "A tokenizer.json file, or a folder holding Hugging Face's, OpenAI's or BERT's tokenizer "
      "files");
}

void bind_token_files(py::module_& dm) {
  using namespace data;
  py::class_<TokenFile>(dm, "TokenFile")
      .def(py::init([](const std::string& path) {
             return runtime_call([&] { return TokenFile(path); });
           }),
           py::arg("path"))
      .def_property_readonly("path", [](const TokenFile& f) { return f.path().string(); })
      .def_property_readonly("version", &TokenFile::version)
      .def("__len__", &TokenFile::size)
      .def("__getitem__", &TokenFile::operator[], py::arg("index"))
      .def("max_token", &TokenFile::max_token);
  dm.def(
      "write_token_file",
      [](const std::string& path, py::handle tokens, int64_t vocab_size) {
        // Any sequence or array of non-negative integers below 2^32.
        py::array_t<int64_t, py::array::c_style | py::array::forcecast> values =
            py::module_::import("numpy").attr("asarray")(tokens, "int64");
        std::vector<uint32_t> ids(values.size());
        const int64_t* v = values.data();
        for (size_t i = 0; i < ids.size(); ++i) {
          TESSERA_CHECK(v[i] >= 0 && v[i] <= int64_t(UINT32_MAX), "write_token_file: token ", i,
                        " is ", v[i], "; tokens must be in [0, 2^32)");
          TESSERA_CHECK(vocab_size <= 0 || v[i] < vocab_size, "write_token_file: token ", i, " is ",
                        v[i], ", not below vocab_size ", vocab_size);
          ids[i] = static_cast<uint32_t>(v[i]);
        }
        runtime_call([&] { write_token_file(path, ids, vocab_size); });
      },
      py::arg("path"), py::arg("tokens"), py::arg("vocab_size") = 0);
}

void bind_loader(py::module_& dm) {
  using namespace data;
  py::class_<LoaderIterator>(dm, "_DataLoaderIterator")
      .def("__iter__", [](py::handle self) { return self; })
      .def("__next__", [](LoaderIterator& it) {
        if (it.remaining == 0) throw py::stop_iteration();
        if (it.remaining > 0) --it.remaining;
        Batch b;
        {
          py::gil_scoped_release release;
          b = it.loader->next();
        }
        return batch_tuple(b);
      });
  py::class_<DataLoader>(dm, "DataLoader")
      .def(py::init([](TokenFile file, int64_t batch, int64_t seq, bool shuffle, uint64_t seed,
                       const std::string& sampling, py::object dtype, py::object device,
                       int64_t max_batches, int rank, int world_size) {
             return DataLoader(std::move(file), {.batch = batch,
                                                 .seq = seq,
                                                 .rank = rank,
                                                 .world_size = world_size,
                                                 .sampling = parse_sampling(sampling),
                                                 .shuffle = shuffle,
                                                 .seed = seed,
                                                 .dtype = to_dtype(dtype, DType::i64),
                                                 .device = to_device(device, Device::cpu()),
                                                 .max_batches = max_batches});
           }),
           py::arg("token_file"), py::kw_only(), py::arg("batch_size"), py::arg("seq_len"),
           py::arg("shuffle") = false, py::arg("seed") = 0, py::arg("sampling") = "windows",
           py::arg("dtype") = py::none(), py::arg("device") = py::none(),
           py::arg("max_batches") = 0, py::arg("rank") = 0, py::arg("world_size") = 1)
      .def("next", [](DataLoader& l) { return batch_tuple(l.next()); })
      .def(
          "batch_at", [](const DataLoader& l, uint64_t k) { return batch_tuple(l.batch_at(k)); },
          py::arg("k"))
      .def("row_starts", &DataLoader::row_starts, py::arg("k"))
      .def_property("position", &DataLoader::position, &DataLoader::set_position)
      .def(
          "skip_first_batches",
          // Of the current epoch (Accelerate skips the first batches of the next iteration):
          // after load_state, which restored the position, this is the same position again.
          [](DataLoader& l, uint64_t n) -> DataLoader& {
            const int64_t per_epoch = l.options().max_batches;
            if (per_epoch <= 0) return runtime_call([&]() -> DataLoader& { return l.skip_first_batches(n); });
            if (n >= uint64_t(per_epoch))
              throw py::value_error("skip_first_batches: num_batches " + std::to_string(n) +
                                    " is not below the epoch's " + std::to_string(per_epoch) +
                                    " batches");
            const uint64_t epoch_start = l.position() - l.position() % uint64_t(per_epoch);
            return l.skip_first_batches(epoch_start + n);
          },
          py::arg("num_batches"), py::return_value_policy::reference_internal)
      .def("tokens_per_step", &DataLoader::tokens_per_step)
      .def_property_readonly("batch_size", [](const DataLoader& l) { return l.options().batch; })
      .def_property_readonly("seq_len", [](const DataLoader& l) { return l.options().seq; })
      .def_property_readonly("rank", [](const DataLoader& l) { return l.options().rank; })
      .def_property_readonly("world_size",
                             [](const DataLoader& l) { return l.options().world_size; })
      .def_property_readonly("max_batches",
                             [](const DataLoader& l) { return l.options().max_batches; })
      .def_property_readonly("file", &DataLoader::file)
      // PyTorch's epochs: with max_batches set, an epoch is max_batches micro-batches of
      // the stream; len() is that count and each `for` runs to the end of the epoch the
      // position is in (so a second `for` is the next epoch, and one after a resume or
      // skip_first_batches finishes the interrupted one).
      .def("__len__",
           [](const DataLoader& l) {
             if (l.options().max_batches <= 0)
               throw py::type_error("len(): this DataLoader is endless (max_batches = 0)");
             return l.options().max_batches;
           })
      .def_property_readonly("epoch",
                             [](const DataLoader& l) {
                               const int64_t per_epoch = l.options().max_batches;
                               return per_epoch > 0 ? int64_t(l.position()) / per_epoch : 0;
                             })
      .def(
          "set_epoch",
          [](DataLoader& l, int64_t epoch) {
            const int64_t per_epoch = l.options().max_batches;
            if (epoch < 0) throw py::value_error("set_epoch: epoch must be >= 0, got " +
                                                 std::to_string(epoch));
            if (per_epoch <= 0)
              throw py::value_error("set_epoch: this DataLoader is endless (max_batches = 0)");
            // Inside epoch `epoch` already (a resumed run): keep the position.
            if (int64_t(l.position()) / per_epoch != epoch) l.set_position(epoch * per_epoch);
          },
          py::arg("epoch"))
      .def(
          "__iter__",
          [](DataLoader& l) {
            const int64_t per_epoch = l.options().max_batches;
            const int64_t done = static_cast<int64_t>(l.position()) % std::max<int64_t>(1, per_epoch);
            return LoaderIterator{&l, per_epoch > 0 ? per_epoch - done : -1};
          },
          py::keep_alive<0, 1>());
}

}  // namespace

void bind_data(py::module_& m) {
  py::module_ dm = m.def_submodule("data", "Token files, tokenizers and the DataLoader");
  bind_tokenizers(dm);
  bind_token_files(dm);
  bind_loader(dm);
  bind_examples(dm);
}

}  // namespace tessera::python
