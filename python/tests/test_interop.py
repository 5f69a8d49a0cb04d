"""Zero-copy exchange: NumPy through the buffer protocol and from_numpy, PyTorch and NumPy
through DLPack. 'Zero-copy' is checked as the same data pointer, and lifetimes by dropping
the producer before reading the consumer."""
import gc

import numpy as np
import pytest

import tessera

RNG = np.random.default_rng(7)


def test_numpy_view_shares_memory_and_keeps_tensor_alive():
    t = tessera.randn(4, 6, generator=tessera.Generator(3))
    a = np.asarray(t)
    assert a.ctypes.data == t.data_ptr() and a.dtype == np.float32 and a.shape == (4, 6)
    a[1, 2] = 123.0
    assert t[1, 2].item() == 123.0
    expected = a.copy()
    view = t[:, 1::2].T  # non-contiguous: the array carries the strides
    av = view.numpy()
    assert av.ctypes.data == view.data_ptr()
    assert av.strides == (8, 24)
    del t, view
    gc.collect()
    np.testing.assert_array_equal(a, expected)  # the arrays keep the storage alive
    np.testing.assert_array_equal(av, expected[:, 1::2].T)
    assert np.asarray(tessera.tensor([1, 2], dtype=tessera.int32)).dtype == np.int32
    assert np.asarray(tessera.tensor([True])).dtype == np.bool_


def test_numpy_refuses_what_it_cannot_hold():
    with pytest.raises(TypeError, match="bfloat16"):
        tessera.zeros(3, dtype=tessera.bfloat16).numpy()
    with pytest.raises(BufferError, match="bfloat16"):
        memoryview(tessera.zeros(3, dtype=tessera.bfloat16))


def test_from_numpy_shares_memory_and_keeps_array_alive():
    x = RNG.standard_normal((5, 8))
    t = tessera.from_numpy(x)
    assert t.data_ptr() == x.ctypes.data and t.dtype == tessera.float64
    x[0, 0] = 42.0
    assert t[0, 0].item() == 42.0
    strided = tessera.from_numpy(x[:, ::3])
    assert strided.stride() == (8, 3) and strided.data_ptr() == x.ctypes.data
    expected = x.copy()
    del x
    gc.collect()
    np.testing.assert_array_equal(np.asarray(t), expected)
    np.testing.assert_array_equal(np.asarray(strided), expected[:, ::3])
    with pytest.raises(ValueError, match="negative strides"):
        tessera.from_numpy(expected[::-1])


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int64", "int32", "uint8"])
def test_dlpack_round_trip_with_torch_is_zero_copy(dtype):
    torch = pytest.importorskip("torch")
    from torch.utils import dlpack as torch_dlpack
    t = tessera.tensor(RNG.integers(0, 100, (6, 5)), dtype=dtype)
    tt = torch_dlpack.from_dlpack(t)
    assert tt.data_ptr() == t.data_ptr() and str(tt.dtype) == "torch." + dtype
    np.testing.assert_array_equal(tt.numpy(), np.asarray(t))
    back = tessera.from_dlpack(tt)
    assert back.data_ptr() == t.data_ptr() and back.dtype == t.dtype


def test_dlpack_views_and_lifetimes_with_torch():
    torch = pytest.importorskip("torch")
    from torch.utils import dlpack as torch_dlpack
    # tessera -> torch: a transposed slice keeps its strides; torch keeps the storage alive.
    base = tessera.randn(7, 9, generator=tessera.Generator(11))
    view = base[1:6, ::2].T
    expected = view.numpy().copy()
    tt = torch_dlpack.from_dlpack(view)
    assert tt.data_ptr() == view.data_ptr() and tt.stride() == view.stride()
    del base, view
    gc.collect()
    np.testing.assert_array_equal(tt.numpy(), expected)
    # torch -> tessera: the tensor keeps torch's memory alive after torch lets it go.
    src = torch.arange(24, dtype=torch.float64).reshape(4, 6)[:, 1:5]
    ours = tessera.from_dlpack(src)
    assert ours.data_ptr() == src.data_ptr() and ours.stride() == src.stride()
    src.add_(1)
    expected = src.numpy().copy()
    del src
    gc.collect()
    np.testing.assert_array_equal(np.asarray(ours), expected)
    # bfloat16 crosses too (no NumPy type holds it).
    b = tessera.from_dlpack(torch.ones(3, dtype=torch.bfloat16) * 1.5)
    assert b.dtype == tessera.bfloat16 and b.float().tolist() == [1.5] * 3


def test_dlpack_with_numpy():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    t = tessera.from_dlpack(x)
    assert t.data_ptr() == x.ctypes.data
    a = np.from_dlpack(t)
    assert a.ctypes.data == t.data_ptr()
    assert tessera.tensor([1.0]).__dlpack_device__() == (1, 0)


def test_gradients_flow_into_dlpack_tensors():
    torch = pytest.importorskip("torch")
    w = tessera.from_dlpack(torch.linspace(-1, 1, 6, dtype=torch.float64)).requires_grad_()
    (w * w).sum().backward()
    np.testing.assert_allclose(np.asarray(w.grad), 2 * np.linspace(-1, 1, 6), rtol=0, atol=1e-15)


def test_dlpack_cuda_round_trip():
    torch = pytest.importorskip("torch")
    if not (tessera.cuda_is_available() and torch.cuda.is_available()):
        pytest.skip("no CUDA device visible to both tessera and torch")
    from torch.utils import dlpack as torch_dlpack
    t = tessera.randn(64, 33, generator=tessera.Generator(5), device="cuda")
    tt = torch_dlpack.from_dlpack(t)
    assert tt.is_cuda and tt.data_ptr() == t.data_ptr()
    np.testing.assert_array_equal(tt.cpu().numpy(), t.cpu().numpy())
    src = torch.randn(16, 8, device="cuda", dtype=torch.float32)[:, ::2]
    ours = tessera.from_dlpack(src)
    assert ours.device == tessera.device("cuda:0") and ours.data_ptr() == src.data_ptr()
    np.testing.assert_array_equal(ours.cpu().numpy(), src.cpu().numpy())
    expected = src.cpu().numpy()
    del src
    gc.collect()
    torch.cuda.synchronize()
    np.testing.assert_array_equal(ours.cpu().numpy(), expected)
