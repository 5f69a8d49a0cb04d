"""tessera.data's labelled examples from Python: ExampleDataset over CSV / JSON Lines (the
cache, the labels, a refused row), DataCollatorWithPadding and
DataCollatorForLanguageModeling(mlm=False) equal to transformers' (skipped without it), and
the ExampleLoader over an ExampleDataset, a dict of lists / NumPy arrays and a list of dicts."""
import numpy as np
import pytest

from tessera import data

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "cat", "dog", "sat", "on",
         "mat", "good", "bad", "film", "!"]


@pytest.fixture
def tokenizer(tmp_path):
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in VOCAB), encoding="utf-8")
    return data.load_tokenizer(str(tmp_path))


def test_dataset_reads_tokenises_and_caches(tokenizer, tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('text,label\n"the cat, sat",good\na dog!,bad\n', encoding="utf-8")
    first = data.ExampleDataset(str(path), tokenizer)
    assert len(first) == 2 and not first.loaded_from_cache and first.tokenized_examples == 2
    assert first[0]["input_ids"] == tokenizer.encode("the cat, sat")
    assert first[0]["label"] == 1 and first[1]["label"] == 0
    assert first.label_names == ["bad", "good"] and first.id2label == {0: "bad", 1: "good"}
    assert first.problem_type == "single_label_classification"
    second = data.ExampleDataset(str(path), tokenizer)
    assert second.loaded_from_cache and second.tokenized_examples == 0
    assert [second[i] for i in range(2)] == [first[i] for i in range(2)]
    assert first.lengths() == [len(first[0]["input_ids"]), len(first[1]["input_ids"])]
    mapped = data.ExampleDataset(str(path), tokenizer, label_list={"good": 0, "bad": 1})
    assert [mapped[0]["label"], mapped[1]["label"]] == [0, 1] and mapped.label_names == ["good", "bad"]


def test_dataset_refuses_a_bad_row_naming_file_line_and_column(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "the cat", "label": 0}\n{"text": "a dog", "label": 3}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: label 3 in column 'label'"):
        data.ExampleDataset(str(path), tokenizer, num_labels=2)


def features(tokenizer, numpy=False):
    """Encoded texts; `numpy`: token_type_ids as NumPy arrays (transformers pads lists only)."""
    texts = ["the cat sat on the mat", "a dog", "good film !"]
    out = []
    for i, text in enumerate(texts):
        enc = tokenizer(text)
        out.append({"input_ids": enc["input_ids"], "token_type_ids": np.array(enc["token_type_ids"]) if numpy else enc["token_type_ids"],
                    "label": i})
    return out


def test_collator_with_padding_equals_transformers(tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    reference = transformers.BertTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    for kwargs in ({}, {"pad_to_multiple_of": 8}, {"padding": "max_length", "max_length": 12}):
        theirs = transformers.DataCollatorWithPadding(reference, return_tensors="np", **kwargs)(
            features(tokenizer))
        ours = data.DataCollatorWithPadding(tokenizer, **kwargs)(features(tokenizer, numpy=True))
        assert sorted(ours) == sorted(theirs)
        for key, value in theirs.items():
            assert ours[key].numpy().tolist() == value.tolist(), (kwargs, key)
            assert ours[key].numpy().dtype == np.int64


def test_lm_collator_labels_equal_transformers(tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    reference = transformers.BertTokenizerFast.from_pretrained(str(tmp_path / "tok"))
    docs = [{"input_ids": [5, 7, 9, 11]}, {"input_ids": [6]}, {"input_ids": [8, 0, 10]}]
    theirs = transformers.DataCollatorForLanguageModeling(reference, mlm=False, return_tensors="np")(docs)
    ours = data.DataCollatorForLanguageModeling(tokenizer, mlm=False)(docs)
    assert ours["labels"].numpy().tolist() == theirs["labels"].tolist()
    assert ours["input_ids"].numpy().tolist() == theirs["input_ids"].tolist()
    with pytest.raises(ValueError, match="mlm=False"):
        data.DataCollatorForLanguageModeling(tokenizer)  # transformers' default mlm=True


def test_loader_accepts_datasets_dicts_of_columns_and_lists_of_dicts(tokenizer, tmp_path):
    rows = features(tokenizer, numpy=True) * 3  # 9 rows
    collate = data.DataCollatorWithPadding(tokenizer)
    columns = {"input_ids": [r["input_ids"] for r in rows],
               "token_type_ids": [r["token_type_ids"] for r in rows],
               "label": np.array([r["label"] for r in rows])}
    loaders = [data.ExampleLoader(rows, 4, collate_fn=collate, shuffle=True, seed=3),
               data.ExampleLoader(columns, 4, collate_fn=collate, shuffle=True, seed=3)]
    for loader in loaders:
        assert len(loader) == 3
        batches = list(loader)
        assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 1]
        assert [b["labels"].numpy().tolist() for b in batches] == \
            [b["labels"].numpy().tolist() for b in loader]  # re-iterable, same order
    seen = [i for k in range(len(loaders[0])) for i in loaders[0].batch_info(k)[0]]
    assert sorted(seen) == list(range(9))
    # Evaluation on 2 ranks: every example once after dropping the padding rows.
    gathered = []
    evals = [data.ExampleLoader(rows, 2, collate_fn=collate, rank=r, world_size=2, evaluation=True)
             for r in range(2)]
    for k in range(len(evals[0])):
        for loader in evals:
            indices, real = loader.batch_info(k)
            gathered += indices[:real]
    assert gathered == list(range(9))
    with pytest.raises(TypeError):
        data.ExampleLoader(42, 2, collate_fn=collate)


def test_samplers_from_python():
    sampler = data.DistributedSampler(10, num_replicas=3, rank=1, seed=5)
    sampler.set_epoch(2)
    perm = data.seeded_permutation(10, 5, 2)
    assert list(sampler) == [perm[p % 10] for p in range(1, 12, 3)]
    assert len(sampler) == 4
    assert data.EvalSampler(5, 2, rank=1, num_replicas=2).batch(1) == ([1, 2], 0)
