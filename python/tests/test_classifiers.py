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
    assert tiny_bert(id2label={0: "a", 1: "b"}).num_labels == 2
