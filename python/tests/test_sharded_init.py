"""Accelerator.sharded_init (ZeRO-3 sharded construction, docs/distributed.md): the model a
builder creates under it is the eager one, bit for bit, once prepared; it is refused at
another stage, and an unprepared model built under it is refused by name."""
import numpy as np
import pytest

import tessera
from tessera import nn


def config():
    return nn.GPTConfig(vocab_size=31, block_size=8, n_layer=2, n_head=2, n_embd=10, dropout=0.0)


def trained_weights(sharded):
    acc = tessera.Accelerator(cpu=True, zero_stage=3)
    tessera.manual_seed(11)
    model = acc.sharded_init(lambda: nn.GPT(config())) if sharded else nn.GPT(config())
    opt = tessera.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    idx = tessera.tensor([[1, 2, 3, 4, 5, 6]])
    for _ in range(2):
        with acc.accumulate(model):
            acc.backward(model.loss(idx, idx))
            opt.step()
            opt.zero_grad()
    acc.unwrap_model(model)
    weights = {name: np.asarray(p.detach()).copy() for name, p in model.named_parameters()}
    acc.end_training()
    return weights


def test_sharded_init_builds_the_eager_model():
    eager, sharded = trained_weights(False), trained_weights(True)
    assert eager.keys() == sharded.keys()
    for name in eager:
        np.testing.assert_array_equal(sharded[name], eager[name], err_msg=name)


def test_sharded_init_is_refused_outside_stage_3():
    acc = tessera.Accelerator(cpu=True, zero_stage=2)
    with pytest.raises(Exception, match="needs ZeRO stage 3"):
        acc.sharded_init(lambda: nn.GPT(config()))


def test_an_unprepared_sharded_model_is_refused_by_name():
    acc = tessera.Accelerator(cpu=True, zero_stage=3)
    model = acc.sharded_init(lambda: nn.GPT(config()))
    idx = tessera.tensor([[1, 2, 3]])
    with pytest.raises(Exception, match="transformer.wte.weight' was built under sharded initialisation"):
        model.loss(idx, idx)
