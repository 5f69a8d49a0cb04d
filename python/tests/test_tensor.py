"""tessera.Tensor: creation, views, the ops against NumPy float64, gradients against PyTorch
(float64, CPU) and finite differences, and how C++ errors surface."""
import gc

import numpy as np
import pytest

import tessera

RNG = np.random.default_rng(1234)


def t64(a):
    return tessera.tensor(np.asarray(a, dtype=np.float64))


def close(t, expected, tol=1e-12):
    np.testing.assert_allclose(np.asarray(t), expected, rtol=tol, atol=tol)


# ---- creation, dtype, device, shape ----

def test_creation_from_lists_and_numpy():
    a = tessera.tensor([[1.5, 2.0, 3.0], [4.0, 5.0, 6.25]])
    assert a.shape == (2, 3) and a.dtype == tessera.float32 and str(a.device) == "cpu"
    assert a.tolist() == [[1.5, 2.0, 3.0], [4.0, 5.0, 6.25]]
    assert tessera.tensor([1, 2, 3]).dtype == tessera.int64
    assert tessera.tensor([True, False]).dtype == tessera.bool
    x = RNG.standard_normal((3, 5))
    b = tessera.tensor(x)
    assert b.dtype == tessera.float64
    np.testing.assert_array_equal(np.asarray(b), x)
    assert b.data_ptr() != x.ctypes.data  # tensor() copies, from_numpy shares
    c = tessera.tensor(x, dtype="float32")
    np.testing.assert_array_equal(np.asarray(c), x.astype(np.float32))
    h = tessera.tensor(x, dtype=tessera.bfloat16)
    assert h.dtype == tessera.bfloat16 and h.float().shape == (3, 5)


def test_factories_and_generator_seed():
    assert tessera.zeros(2, 3).tolist() == [[0.0] * 3] * 2
    assert tessera.ones((4,), dtype=tessera.float64).dtype == tessera.float64
    assert tessera.full([2], 7.5).tolist() == [7.5, 7.5]
    assert tessera.arange(5).tolist() == [0, 1, 2, 3, 4]
    a = tessera.randn(1000, 10, generator=tessera.Generator(42))
    b = tessera.randn(1000, 10, generator=tessera.Generator(42))
    c = tessera.randn(1000, 10, generator=tessera.Generator(43))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    v = np.asarray(a, dtype=np.float64)
    assert abs(v.mean()) < 0.05 and abs(v.std() - 1) < 0.05
    g = tessera.Generator(5)
    first = tessera.rand(7, generator=g)
    assert g.offset > 0
    g.manual_seed(5)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(tessera.rand(7, generator=g)))
    r = tessera.randint(3, 9, [500], generator=tessera.Generator(1))
    assert r.dtype == tessera.int64 and r.min().item() >= 3 and r.max().item() <= 8


# ---- views ----

def test_views_match_numpy_and_share_memory():
    x = RNG.standard_normal((4, 6, 5))
    t = t64(x)
    cases = {
        "slice": (lambda a: a[1:4, ::2, -3:], lambda a: a[1:4, ::2, -3:]),
        "int": (lambda a: a[2, :, 1], lambda a: a[2, :, 1]),
        "none_ellipsis": (lambda a: a[None, ..., 0], lambda a: a[None, ..., 0]),
        "transpose": (lambda a: a.transpose(0, 2), lambda a: a.transpose(2, 1, 0)),
        "permute": (lambda a: a.permute(1, 2, 0), lambda a: a.transpose(1, 2, 0)),
        "reshape": (lambda a: a.reshape(8, 15), lambda a: a.reshape(8, 15)),
        "T": (lambda a: a[0].T, lambda a: a[0].T),
    }
    for name, (ours, ref) in cases.items():
        np.testing.assert_array_equal(np.asarray(ours(t)), ref(x), err_msg=name)
    v = t[1:3, 2]
    v.fill_(9.0)
    assert np.all(np.asarray(t)[1:3, 2] == 9.0)
    assert not t.transpose(0, 1).is_contiguous()
    assert t.view(24, 5).shape == (24, 5)
    t[0, 0, 0] = -1.0
    assert t[0, 0, 0].item() == -1.0


def test_index_errors():
    t = tessera.zeros(3, 4)
    with pytest.raises(IndexError, match="out of bounds for dimension 0 with size 3"):
        t[3]
    with pytest.raises(IndexError, match="too many indices"):
        t[0, 0, 0]


# ---- ops against NumPy float64 ----

def test_binary_ops_broadcast_against_numpy():
    a, b = RNG.standard_normal((3, 1, 5)), RNG.standard_normal((4, 1)) + 3.0
    ta, tb = t64(a), t64(b)
    close(ta + tb, a + b)
    close(ta - tb, a - b)
    close(ta * tb, a * b)
    close(ta / tb, a / b)
    close(2.5 - ta, 2.5 - a)
    close(1.0 / tb, 1.0 / b)
    close(tb ** 1.5, b ** 1.5)
    close(tessera.maximum(ta, tb), np.maximum(a, b))
    np.testing.assert_array_equal(np.asarray(ta > tb), a > b)
    np.testing.assert_array_equal(np.asarray(ta <= 0.1), a <= 0.1)


def test_unary_and_reductions_against_numpy():
    x = RNG.standard_normal((5, 7))
    pos = np.abs(x) + 0.5
    t, tp = t64(x), t64(pos)
    for name, ref in [("exp", np.exp), ("tanh", np.tanh), ("sin", np.sin), ("abs", np.abs),
                      ("sigmoid", lambda v: 1 / (1 + np.exp(-v))), ("relu", lambda v: np.maximum(v, 0))]:
        close(getattr(t, name)(), ref(x), 1e-12)
    close(tp.log(), np.log(pos))
    close(tp.sqrt(), np.sqrt(pos))
    close(t.sum(), x.sum())
    close(t.sum(1), x.sum(1))
    close(t.mean(0, keepdim=True), x.mean(0, keepdims=True))
    close(t.var(1), x.var(1, ddof=1))
    close(t.std(), x.std(ddof=1))
    close(t.amax(1), x.max(1))
    values, indices = t.max(1)
    close(values, x.max(1))
    np.testing.assert_array_equal(np.asarray(indices), x.argmax(1))
    close(t.softmax(-1), np.exp(x) / np.exp(x).sum(-1, keepdims=True))
    close(t.log_softmax(0), x - np.log(np.exp(x).sum(0, keepdims=True)))
    close(t.cumsum(1), np.cumsum(x, 1))
    close(t.clamp(-0.5, 0.5), np.clip(x, -0.5, 0.5))


def test_matmul_on_non_contiguous_views():
    a, b = RNG.standard_normal((7, 5)), RNG.standard_normal((3, 7))
    ta, tb = t64(a), t64(b)
    close(ta.T @ tb.T, a.T @ b.T, 1e-12)  # both operands transposed views
    batch = RNG.standard_normal((2, 3, 4, 5))
    close(tessera.matmul(t64(batch), t64(batch).transpose(-1, -2)), batch @ batch.swapaxes(-1, -2), 1e-12)


# ---- gradients ----

def test_gradients_match_pytorch_float64():
    torch = pytest.importorskip("torch")
    a, b, c = RNG.standard_normal((6, 4)), RNG.standard_normal((6, 5)), RNG.standard_normal((4, 5))

    def f(lib, A, B, C):
        s = lib.softmax(A.transpose(0, 1) @ B, -1)  # A used through a transposed view
        return (s * C).sum() + (lib.tanh(A) ** 2).mean() + (B[1:, ::2].exp()).sum()

    ours = [t64(v).requires_grad_() for v in (a, b, c)]
    f(tessera, *ours).backward()
    ref = [torch.tensor(v, requires_grad=True) for v in (a, b, c)]
    f(torch, *ref).backward()
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(np.asarray(o.grad), r.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert ours[0].is_leaf and ours[0].grad_fn is None


def test_attention_with_a_key_padding_mask_matches_pytorch():
    torch = pytest.importorskip("torch")
    q, k, v = (RNG.standard_normal((2, 3, 5, 4)) for _ in range(3))
    keep = np.ones((2, 1, 1, 5), dtype=bool)
    keep[1, ..., 3:] = False  # row 1 has two pad keys
    ours = tessera.nn.functional.scaled_dot_product_attention(t64(q), t64(k), t64(v),
                                                              attn_mask=tessera.tensor(keep))
    tq, tk, tv = (torch.tensor(x) for x in (q, k, v))
    scores = (tq @ tk.transpose(-2, -1) / 2.0).masked_fill(~torch.tensor(keep), float("-inf"))
    close(ours, (torch.softmax(scores, -1) @ tv).numpy())


def test_gradient_matches_finite_differences():
    x = RNG.standard_normal((3, 4))
    w = RNG.standard_normal((4, 2))

    def loss_np(v):
        return np.sum(np.tanh(v @ w) ** 2)

    t = t64(x).requires_grad_()
    (tessera.tanh(t @ t64(w)) ** 2).sum().backward()
    eps, numeric = 1e-6, np.zeros_like(x)
    for i in np.ndindex(x.shape):
        d = np.zeros_like(x)
        d[i] = eps
        numeric[i] = (loss_np(x + d) - loss_np(x - d)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(t.grad), numeric, rtol=1e-6, atol=1e-8)


def test_no_grad_and_requires_grad():
    w = tessera.randn(3, requires_grad=True)
    with tessera.no_grad():
        y = w * 2
    assert not y.requires_grad
    assert (w * 2).requires_grad
    w.grad = tessera.ones(3)
    assert w.grad.tolist() == [1.0, 1.0, 1.0]
    w.grad = None
    assert w.grad is None


# ---- errors ----

def test_shape_errors_are_value_errors_with_the_library_message():
    with pytest.raises(ValueError, match=r"\[2, 3\].*\[4, 5\]"):
        tessera.zeros(2, 3) @ tessera.zeros(4, 5)
    with pytest.raises(ValueError, match="view"):
        tessera.zeros(2, 3).transpose(0, 1).view(6)


def test_out_of_memory_is_memory_error():
    with pytest.raises(MemoryError, match="out of memory"):
        tessera.empty(1 << 58)  # 2^60 bytes


def test_runtime_failures_are_runtime_errors():
    x = tessera.randn(3, requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="second time|retain_graph|released|freed"):
        y.backward()
    with pytest.raises(RuntimeError, match="no_such_model_dir"):
        tessera.nn.GPT.from_pretrained("/nonexistent/no_such_model_dir")


def test_tensor_outlives_nothing_it_needs():
    x = tessera.randn(50, 50)
    v = x[10:20].T
    del x
    gc.collect()
    assert v.shape == (50, 10) and np.isfinite(np.asarray(v)).all()
