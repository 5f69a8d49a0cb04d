"""The sequence classifiers from Python against transformers: the same directory gives the same
logits and loss; from_pretrained returns eval mode; the call returns transformers' output."""
import numpy as np
import pytest

import tessera
from tessera import nn
from conftest import have_torch

RNG = np.random.default_rng(11)


def tiny_bert(**overrides):
    settings = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                    max_position_embeddings=32, num_labels=3)
    settings.update(overrides)
    return nn.BertForSequenceClassification(nn.BertConfig(**settings))


@pytest.mark.skipif(not have_torch(), reason="PyTorch is not installed")
def test_bert_classifier_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch
    model = tiny_bert()
    model.save_pretrained(str(tmp_path / "bert"))
    reference = transformers.BertForSequenceClassification.from_pretrained(str(tmp_path / "bert")).eval()
    ids = RNG.integers(1, 40, (3, 7))
    mask = np.ones((3, 7), dtype=np.int64)
    mask[1, 5:] = 0
    labels = np.array([0, 2, 1])
    loaded = nn.AutoModelForSequenceClassification.from_pretrained(tmp_path / "bert")
    assert not loaded.training and isinstance(loaded, nn.BertForSequenceClassification)
    out = loaded(tessera.tensor(ids.tolist()), attention_mask=tessera.tensor(mask.tolist()),
                 labels=tessera.tensor(labels.tolist()))
    with torch.no_grad():
        expected = reference(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    np.testing.assert_allclose(np.asarray(out.logits), expected.logits.numpy(), atol=2e-5)
    assert out["loss"].item() == pytest.approx(expected.loss.item(), abs=2e-5)


def test_classifier_config_errors_name_the_field():
    with pytest.raises(ValueError, match="hidden_act"):
        nn.BertConfig(hidden_act="swish2")
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_label'"):
        nn.BertConfig(num_label=3)
    assert nn.BertConfig(id2label={0: "a", 1: "b", 2: "c"}).num_labels == 3  # transformers: from id2label
    with pytest.raises(ValueError, match="id2label names 2 labels but num_labels is 3"):
        tiny_bert(id2label={0: "a", 1: "b"})


def _reviews(path, rows, seed):
    rng = np.random.default_rng(seed)
    words = ["good", "bad", "film", "plot"]
    with open(path, "w") as f:
        for _ in range(rows):
            label = int(rng.integers(0, 2))
            text = " ".join([words[label]] * int(rng.integers(1, 4)) + list(rng.choice(words[2:], 3)))
            f.write('{"text": "%s", "label": %d}\n' % (text, label))


@pytest.fixture
def review_sets(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad",
                                                   "film", "plot"]) + "\n")
    tokenizer = tessera.data.WordPieceTokenizer.from_vocab_file(str(tmp_path / "vocab.txt"))
    _reviews(tmp_path / "train.jsonl", 48, 1)
    _reviews(tmp_path / "eval.jsonl", 21, 2)
    return (tokenizer, tessera.data.ExampleDataset(str(tmp_path / "train.jsonl"), tokenizer),
            tessera.data.ExampleDataset(str(tmp_path / "eval.jsonl"), tokenizer))


def test_trainer_fine_tunes_a_classifier_with_hugging_faces_arguments(review_sets, tmp_path):
    tokenizer, train_set, eval_set = review_sets
    seen = []

    def compute_metrics(eval_pred):
        logits, labels = eval_pred
        seen.append((logits.shape, labels.tolist()))
        return {"accuracy": float(np.mean(np.argmax(logits, axis=-1) == labels)), "rows": float(len(labels))}

    class Recorder:
        logs = []

        def on_log(self, logs):
            self.logs.append(logs)

    recorder = Recorder()
    args = tessera.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=12, per_device_train_batch_size=8,
                                     per_device_eval_batch_size=8, learning_rate=5e-3, eval_strategy="steps",
                                     eval_steps=6, logging_steps=3, report_to="none", save_strategy="no")
    trainer = tessera.Trainer(model=tiny_bert(num_labels=2, vocab_size=tokenizer.vocab_size), args=args,
                              train_dataset=train_set, eval_dataset=eval_set,
                              data_collator=tessera.data.DataCollatorWithPadding(tokenizer), tokenizer=tokenizer,
                              compute_metrics=compute_metrics, callbacks=[recorder])
    trainer.train()
    assert trainer.state["global_step"] == 12
    evaluations = [entry for entry in recorder.logs if "eval_accuracy" in entry]
    assert len(evaluations) == 2 and all(entry["eval_rows"] == 21 for entry in evaluations)
    assert any("loss" in entry and "learning_rate" in entry for entry in recorder.logs)
    # The EvalPrediction is the whole evaluation set in dataset order.
    expected_labels = [eval_set[i]["label"] for i in range(len(eval_set))]
    assert seen[-1] == ((21, 2), expected_labels)
    metrics = trainer.evaluate()
    assert metrics["eval_rows"] == 21 and 0 <= metrics["eval_accuracy"] <= 1 and "eval_loss" in metrics
    out = trainer.predict(eval_set)
    assert out.predictions.shape == (21, 2) and out.label_ids.tolist() == expected_labels
    assert out.metrics["test_accuracy"] == pytest.approx(
        float(np.mean(np.argmax(out.predictions, axis=-1) == out.label_ids)))
    assert out.metrics["test_accuracy"] == metrics["eval_accuracy"]


def test_trainer_refuses_wrong_dataset_and_collator_types(review_sets, tmp_path):
    tokenizer, train_set, _ = review_sets
    args = tessera.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=1, report_to="none")
    model = tiny_bert(num_labels=2, vocab_size=tokenizer.vocab_size)
    with pytest.raises(TypeError, match="train_dataset must be a tessera.data.ExampleDataset"):
        tessera.Trainer(model=model, args=args, train_dataset={"text": ["a"]}, tokenizer=tokenizer)
    with pytest.raises(TypeError, match="data_collator must be a tessera.data.DataCollatorWithPadding"):
        tessera.Trainer(model=model, args=args, train_dataset=train_set, data_collator=lambda rows: rows)
    with pytest.raises(ValueError, match="needs data_collator or tokenizer"):
        tessera.Trainer(model=model, args=args, train_dataset=train_set)
    with pytest.raises((ValueError, RuntimeError), match="metric_for_best_model.*eval_f2"):
        tessera.Trainer(model=model, train_dataset=train_set, tokenizer=tokenizer,
                        args=tessera.TrainingArguments(output_dir=str(tmp_path / "r2"), max_steps=1, report_to="none",
                                                       metric_for_best_model="f2"))


@pytest.mark.skipif(not have_torch(), reason="PyTorch is not installed")
def test_a_language_models_directory_with_from_pretrained_overrides_gets_a_head_transformers_reads(tmp_path):
    """transformers' from_pretrained(dir, num_labels=..., id2label=..., pad_token_id=...) over a
    GPT-2 language model: a new score head with those classes; what it saves, transformers loads
    with the same logits on right-padded rows (each row read at its last token before the pad)."""
    transformers = pytest.importorskip("transformers")
    import torch
    tessera.manual_seed(5)
    nn.GPT(nn.GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16)).save_pretrained(
        str(tmp_path / "lm"))
    model = nn.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "lm", id2label={0: "neg", 1: "neu", 2: "pos"}, pad_token_id=0)
    assert model.num_labels == 3 and "score.weight" in model.newly_initialized_keys
    model.save_pretrained(str(tmp_path / "clf"))
    reference = transformers.GPT2ForSequenceClassification.from_pretrained(str(tmp_path / "clf")).eval()
    assert reference.config.id2label == {0: "neg", 1: "neu", 2: "pos"} and reference.config.pad_token_id == 0
    ids = RNG.integers(1, 50, (3, 9))
    ids[0, 4:] = 0
    ids[2, 7:] = 0
    mask = (ids != 0).astype(np.int64)
    out = nn.AutoModelForSequenceClassification.from_pretrained(tmp_path / "clf")(
        tessera.tensor(ids.tolist()), attention_mask=tessera.tensor(mask.tolist()))
    with torch.no_grad():
        expected = reference(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(np.asarray(out.logits), expected, rtol=1e-5, atol=1e-6)
    # The lm directory itself is untouched, and contradictory overrides are refused.
    assert "id2label" not in (tmp_path / "lm" / "config.json").read_text()
    with pytest.raises(ValueError, match="num_labels=4 but id2label names 3 labels"):
        nn.AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=4,
                                                              id2label={0: "a", 1: "b", 2: "c"})
