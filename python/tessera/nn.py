"""tessera.nn: Module, the layers, GPT and Llama (Hugging Face model directories), and the
sequence classifiers (BertForSequenceClassification, AutoModelForSequenceClassification)."""
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
    def from_pretrained(model_dir, device=None, dtype=None):
        return _native._load_sequence_classifier(str(model_dir), device, dtype)
