"""tessera.nn: Module, the layers, GPT and Llama (Hugging Face model directories), and the
sequence classifiers (BertForSequenceClassification, AutoModelForSequenceClassification)."""
import json
import os
import pathlib
import tempfile
from dataclasses import dataclass

from ._tessera.nn import (  # noqa: F401
    Module, Linear, Embedding, LayerNorm, GELU, Dropout, GPT, GPTConfig, GPTTransformer,
    language_model_loss, Llama, LlamaConfig, SequenceClassifier, BertConfig, BertForSequenceClassification,
)
from ._tessera import nn as _native
from . import functional  # noqa: F401


@dataclass
class SequenceClassifierOutput:
    """transformers' output of a *ForSequenceClassification call (attribute or key access)."""
    loss: object = None
    logits: object = None

    def __getitem__(self, key):
        return getattr(self, key)


def _classify(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
    logits = self.logits(input_ids, attention_mask, token_type_ids)
    return SequenceClassifierOutput(loss=None if labels is None else self.loss(logits, labels), logits=logits)


SequenceClassifier.__call__ = _classify
SequenceClassifier.forward = _classify


class AutoModelForSequenceClassification:
    """transformers' auto class: the classifier a model directory's config.json names (bert,
    distilbert, gpt2, llama)."""

    def __init__(self):
        raise OSError("AutoModelForSequenceClassification is designed to be instantiated using "
                      "AutoModelForSequenceClassification.from_pretrained(model_dir)")

    @staticmethod
    def from_pretrained(model_dir, device=None, dtype=None, **config_overrides):
        """Loads model_dir's classifier. As in transformers, keyword arguments set config
        attributes first: num_labels, id2label, label2id, pad_token_id, problem_type, ... (a new
        head over a language model's or a bare encoder's weights gets its classes this way)."""
        if not config_overrides:
            return _native._load_sequence_classifier(str(model_dir), device, dtype)
        with tempfile.TemporaryDirectory(prefix="tessera-config-") as tmp:
            _overridden_copy(pathlib.Path(model_dir), pathlib.Path(tmp), config_overrides)
            return _native._load_sequence_classifier(tmp, device, dtype)


def _overridden_copy(source, target, overrides):
    """target: links to source's files with config.json rewritten as transformers'
    PretrainedConfig would read it with these keyword arguments."""
    config_path = source / "config.json"
    if not config_path.is_file():
        raise OSError(f"{source}: no config.json (not a model directory)")
    config = json.loads(config_path.read_text())
    overrides = dict(overrides)
    if "id2label" in overrides:
        id2label = {str(int(k)): str(v) for k, v in dict(overrides.pop("id2label")).items()}
        if "num_labels" in overrides and int(overrides["num_labels"]) != len(id2label):
            raise ValueError(f"from_pretrained: num_labels={overrides['num_labels']} but id2label names "
                             f"{len(id2label)} labels")
        overrides.setdefault("num_labels", len(id2label))
    elif "num_labels" in overrides:
        id2label = {str(i): f"LABEL_{i}" for i in range(int(overrides["num_labels"]))}
    else:
        id2label = None
    if id2label is not None:
        config["id2label"] = id2label
        config["label2id"] = {v: int(k) for k, v in id2label.items()}
    if "label2id" in overrides:
        config["label2id"] = {str(k): int(v) for k, v in dict(overrides.pop("label2id")).items()}
    config.update(overrides)
    for entry in source.iterdir():
        if entry.name != "config.json" and entry.is_file():
            os.symlink(entry.resolve(), target / entry.name)
    (target / "config.json").write_text(json.dumps(config, indent=2))
