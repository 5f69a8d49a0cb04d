"""tessera.nn, tessera.optim and tessera.data against independent references: NumPy float64
for layers, PyTorch's optimizers step for step, the llm.c data-order contract by hand, and the
GPT's logits against the C++ library's own (a separate C++ program) bit for bit."""
import os

import numpy as np
import pytest

import tessera
from tessera import nn, optim, data
from conftest import read_safetensors, reference_program, run

RNG = np.random.default_rng(99)


def test_linear_embedding_layernorm_against_numpy():
    lin = nn.Linear(5, 3, generator=tessera.Generator(1), dtype=tessera.float64)
    x = RNG.standard_normal((2, 4, 5))
    np.testing.assert_allclose(np.asarray(lin(tessera.tensor(x))),
                               x @ np.asarray(lin.weight) + np.asarray(lin.bias), rtol=1e-12, atol=1e-12)
    emb = nn.Embedding(10, 4, generator=tessera.Generator(2))
    idx = np.array([[3, 9, 0], [3, 1, 2]])
    np.testing.assert_array_equal(np.asarray(emb(tessera.tensor(idx))), np.asarray(emb.weight)[idx])
    ln = nn.LayerNorm(6, eps=1e-5, dtype=tessera.float64)
    y = RNG.standard_normal((3, 6)) * 4 + 1
    ref = (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(ln(tessera.tensor(y))), ref, rtol=1e-10, atol=1e-10)
    assert [n for n, _ in ln.named_parameters()] == ["weight", "bias"]


class TwoLayer(nn.Module):
    """A module written in Python: children registered by assignment, forward in Python."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 8, generator=tessera.Generator(3))
        self.fc2 = nn.Linear(8, 2, generator=tessera.Generator(4))
        self.scale = self.register_parameter("scale", tessera.ones(2))

    def forward(self, x):
        return self.fc2(self.fc1(x).gelu()) * self.scale


def test_python_subclass_of_module():
    m = TwoLayer()
    names = [n for n, _ in m.named_parameters()]
    assert names == ["scale", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    x = tessera.randn(3, 4, generator=tessera.Generator(5))
    out = m(x)  # through the C++ module call (hooks, GIL released) back into Python
    assert out.shape == (3, 2) and m.type_name() == "TwoLayer"
    out.sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    state = m.state_dict()
    m2 = TwoLayer()
    m2.load_state_dict(state)
    np.testing.assert_array_equal(np.asarray(m2(x)), np.asarray(out.detach()))


def _torch_pair(shapes):
    torch = pytest.importorskip("torch")
    values = [RNG.standard_normal(s) for s in shapes]
    ours = [tessera.tensor(v).requires_grad_() for v in values]
    theirs = [torch.tensor(v, requires_grad=True) for v in values]
    return torch, ours, theirs


def _run_steps(torch, ours, theirs, opt, topt, steps=5):
    for step in range(steps):
        g = [RNG.standard_normal(p.shape) for p in ours]
        for p, gi in zip(ours, g):
            p.grad = tessera.tensor(gi)
        for p, gi in zip(theirs, g):
            p.grad = torch.tensor(gi)
        opt.step()
        topt.step()
    for p, q in zip(ours, theirs):
        np.testing.assert_allclose(np.asarray(p.detach()), q.detach().numpy(), rtol=1e-12, atol=1e-13)


def test_adamw_matches_torch():
    torch, ours, theirs = _torch_pair([(4, 3), (3,)])
    opt = optim.AdamW(ours, lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # Tessera decays tensors of rank >= 2 only: the same groups for PyTorch.
    topt = torch.optim.AdamW([{"params": [theirs[0]], "weight_decay": 0.1},
                              {"params": [theirs[1]], "weight_decay": 0.0}], lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    _run_steps(torch, ours, theirs, opt, topt)


def test_sgd_matches_torch():
    torch, ours, theirs = _torch_pair([(5, 2), (2,)])
    opt = optim.SGD(ours, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)
    topt = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)
    _run_steps(torch, ours, theirs, opt, topt)


def test_cosine_schedule_by_hand():
    p = tessera.zeros(2, 2, requires_grad=True)
    opt = optim.AdamW([p], lr=1.0)
    sched = optim.CosineSchedule(opt, warmup=4, total=20, min_lr=0.1)
    lrs = []
    for _ in range(25):
        lrs.append(opt.lr)
        sched.step()
    for step, lr in enumerate(lrs):
        if step < 4:
            expected = (step + 1) / 4
        elif step >= 20:
            expected = 0.1
        else:
            expected = 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * (step - 4) / 16))
        assert lr == pytest.approx(expected, rel=1e-12), step


def test_token_file_and_loader_follow_the_data_order():
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tessera_py_{os.getpid()}.bin")
    tokens = RNG.integers(0, 70000, 1001)  # > 65,535: version 2 (uint32)
    data.write_token_file(path, tokens)
    try:
        f = data.TokenFile(path)
        assert len(f) == 1001 and f.version == 2 and f[17] == tokens[17]
        B, T = 3, 8
        loader = data.DataLoader(f, batch_size=B, seq_len=T, max_batches=5, rank=1, world_size=2)
        seen = list(loader)
        assert len(seen) == 5
        for k, (x, y) in enumerate(seen):
            start = (k * 2 + 1) * B * T
            window = np.array([tokens[(start + i) % 1001] for i in range(B * T + 1)])
            np.testing.assert_array_equal(np.asarray(x), window[:-1].reshape(B, T))
            np.testing.assert_array_equal(np.asarray(y), window[1:].reshape(B, T))
        # A second pass is the next epoch: the stream goes on (batches 5..9).
        again = list(loader)
        assert len(again) == 5 and len(loader) == 5
        np.testing.assert_array_equal(np.asarray(again[0][0]), np.asarray(loader.batch_at(5)[0]))
        with pytest.raises(RuntimeError, match="nonexistent"):
            data.TokenFile("/nonexistent/file.bin")
    finally:
        os.remove(path)


def test_tokenizers_round_trip():
    text = "héllo wörld, hello world! 12345 " * 20
    byte = data.ByteTokenizer()
    assert byte.encode("hé") == [104, 195, 169] and byte.decode(byte.encode(text)) == text
    bpe = data.BpeTokenizer.train(text, 300)
    ids = bpe.encode(text)
    assert bpe.vocab_size > 256 and len(ids) < len(text.encode()) and bpe.decode(ids) == text


def _small_gpt(seed=0):
    return nn.GPT(nn.GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=24),
                  generator=tessera.Generator(seed))


def test_gpt_logits_equal_the_cpp_program_bit_for_bit(tmp_path):
    model = _small_gpt()
    model.save_pretrained(str(tmp_path / "model"))
    loaded = nn.GPT.from_pretrained(str(tmp_path / "model"))
    loaded.eval()
    idx = RNG.integers(0, 50, (3, 11)).astype(np.int64)
    with tessera.no_grad():
        logits = np.asarray(loaded(tessera.tensor(idx)))
    idx.tofile(tmp_path / "tokens.bin")
    run([reference_program("python_reference_logits"), tmp_path / "model", 3, 11, tmp_path / "tokens.bin",
         tmp_path / "logits.bin"])
    reference = np.fromfile(tmp_path / "logits.bin", dtype=np.float32).reshape(3, 11, 50)
    assert np.array_equal(logits, reference)
    # The weights on disk are the model's, under Hugging Face's names.
    weights = read_safetensors(tmp_path / "model" / "model.safetensors")
    np.testing.assert_array_equal(weights["transformer.wte.weight"], np.asarray(model.parameter("transformer.wte.weight")))


def test_gpt_loss_is_cross_entropy_of_the_logits():
    model = _small_gpt(1)
    idx = tessera.tensor(RNG.integers(0, 50, (2, 16)))
    targets = tessera.tensor(RNG.integers(0, 50, (2, 16)))
    logits = np.asarray(model(idx).detach(), dtype=np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    expected = -np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1).mean()
    loss = model.loss(idx, targets)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert model.parameter("transformer.wte.weight").grad is not None
    out = model.generate(idx[:, :4], 5, temperature=0)
    assert out.shape == (2, 9) and out[:, :4].tolist() == idx[:, :4].tolist()


def _checkpointed_step(model, idx, targets):
    model.zero_grad()
    tessera.manual_seed(7)
    loss = model.loss(idx, targets)
    loss.backward()
    return loss.item(), [np.asarray(p.grad).copy() for p in model.parameters()]


def test_gradient_checkpointing_enable_takes_transformers_kwargs():
    # Every policy gives the plain step's loss and gradients bit for bit (GPT with dropout, so
    # the recompute replays the draws; Llama with grouped-query attention), on 3 blocks.
    gpt = nn.GPT(nn.GPTConfig(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=24),
                 generator=tessera.Generator(3))
    gpt.set_dropout(0.1)
    llama = nn.Llama(nn.LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=40, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))
    idx = tessera.tensor(RNG.integers(0, 50, (3, 13)))
    targets = tessera.tensor(RNG.integers(0, 50, (3, 13)))
    for model in (gpt, llama):
        model.train()
        assert not model.is_gradient_checkpointing and model.gradient_checkpointing_policy == "none"
        plain_loss, plain_grads = _checkpointed_step(model, idx, targets)
        for kwargs, policy in ((None, "full"), ({"use_reentrant": False}, "full"),
                               ({"policy": "every_k:2"}, "every_k:2"),
                               ({"policy": "attention", "use_reentrant": True}, "attention"),
                               ({"policy": "mlp"}, "mlp")):
            if kwargs is None:
                model.gradient_checkpointing_enable()
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            assert model.is_gradient_checkpointing and model.gradient_checkpointing_policy == policy
            loss, grads = _checkpointed_step(model, idx, targets)
            assert loss == plain_loss, policy
            for got, want in zip(grads, plain_grads):
                assert np.array_equal(got, want), policy
        # Refused naming the value; the model keeps the policy it had.
        with pytest.raises(ValueError, match="'every_k:0'"):
            model.gradient_checkpointing_enable({"policy": "every_k:0"})
        with pytest.raises(ValueError, match="'every_k:4'.*3 blocks"):
            model.gradient_checkpointing_enable({"policy": "every_k:4"})
        with pytest.raises(ValueError, match="'sometimes'"):
            model.gradient_checkpointing_enable({"policy": "sometimes"})
        with pytest.raises(ValueError, match="preserve_rng_state"):
            model.gradient_checkpointing_enable({"preserve_rng_state": True})
        with pytest.raises(ValueError, match="dict"):
            model.gradient_checkpointing_enable(True)
        assert model.gradient_checkpointing_policy == "mlp"
        model.gradient_checkpointing_disable()
        assert not model.is_gradient_checkpointing


def test_training_arguments_take_gradient_checkpointing_kwargs(tmp_path):
    args = tessera.TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True,
                                     gradient_checkpointing_kwargs={"policy": "every_k:2", "use_reentrant": False})
    assert args.gradient_checkpointing_kwargs == {"policy": "every_k:2", "use_reentrant": False}
    for bad in ("every_k:0", "every_k:x", "every_k:9", "bogus"):
        with pytest.raises(ValueError, match="gradient_checkpointing_kwargs.*'" + bad + "'"):
            tessera.TrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True,
                                      gradient_checkpointing_kwargs={"policy": bad})


def test_module_errors():
    with pytest.raises(ValueError, match="n_head"):
        nn.GPTConfig(n_embd=30, n_head=4)
    model = _small_gpt()
    with pytest.raises(ValueError, match="missing|unexpected"):
        model.load_state_dict({"bogus": tessera.zeros(1)})
