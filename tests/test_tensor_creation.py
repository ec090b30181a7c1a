"""Tensor creation, properties, casts, devices and realizing, checked against numpy."""
import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from rewrite import Ops
from helpers import realize_and_check as check_all
from tensor import Tensor, dtypes


def realize_and_check(pairs, rtol=1e-6, atol=1e-6):
  return check_all(pairs, rtol=rtol, atol=atol)


# ---- from data ----
def test_from_numpy_keeps_dtype_and_values():
  rng = np.random.default_rng(0)
  for arr in (rng.standard_normal((3, 5)).astype(np.float32), rng.standard_normal(4), np.arange(6, dtype=np.int64),
              np.array([1, -2, 3], np.int8), np.array([0, 255], np.uint8), np.array([True, False]),
              rng.standard_normal((2, 1, 3)).astype(np.float16), np.int32(7), np.array(2.5)):
    t = Tensor(arr)
    assert t.shape == np.shape(arr) and t.dtype is dtypes.from_numpy(np.asarray(arr).dtype)
    assert t.numpy().dtype == np.asarray(arr).dtype
    assert_array_equal(t.numpy(), arr)


def test_from_lists_and_scalars_use_default_dtypes():
  assert Tensor([[1, 2], [3, 4]]).dtype is dtypes.int32
  assert Tensor([1, 2.5]).dtype is dtypes.float32
  assert Tensor([True, False]).dtype is dtypes.bool
  assert_array_equal(Tensor([[1, 2], [3, 4]]).numpy(), [[1, 2], [3, 4]])
  s = Tensor(3.5)
  assert s.shape == () and s.ndim == 0 and s.numel() == 1 and s.dtype is dtypes.float32
  assert s.uop.op is Ops.VIEW and s.uop.src[0].op is Ops.CONST  # a Python scalar is a constant, not a buffer
  assert s.item() == 3.5 and Tensor(7).item() == 7 and Tensor(True).item() is True


def test_dtype_argument_forms():
  for dt in (dtypes.float16, "float16", np.float16):
    t = Tensor([1.5, 2.0], dtype=dt)
    assert t.dtype is dtypes.float16 and t.numpy().dtype == np.float16
  assert_array_equal(Tensor(np.array([1.7, -2.2]), dtype=dtypes.int32).numpy(), [1, -2])


def test_unsupported_data_and_dtypes_raise():
  with pytest.raises(TypeError, match="complex64"): Tensor(np.zeros(3, np.complex64))
  with pytest.raises(TypeError, match="uint16"): Tensor(np.zeros(3, np.uint16))
  with pytest.raises(TypeError, match="not supported"): Tensor([1, 2], dtype=dtypes.uint32)
  with pytest.raises(TypeError, match="not a dtype"): Tensor([1, 2], dtype="floaty")
  with pytest.raises(TypeError): Tensor("hello")
  with pytest.raises(TypeError): Tensor({1: 2})
  with pytest.raises(ValueError, match="rectangular"): Tensor([[1, 2], [3]])
  with pytest.raises(OverflowError, match="300 out of bounds for int8"): Tensor(300, dtype=dtypes.int8)
  with pytest.raises(ValueError, match="NaN"): Tensor(np.array([np.nan]), dtype=dtypes.int32)


# ---- constants and ranges ----
def test_constants_are_zero_stride_views_of_const():
  for t in (Tensor.zeros(2, 3), Tensor.ones((4,)), Tensor.full((2, 2), 7), Tensor.zeros()):
    assert t.uop.op is Ops.VIEW and t.uop.src[0].op is Ops.CONST
    assert all(s == 0 for s in t.uop.arg.strides)
  assert Tensor.zeros(2, 3).shape == Tensor.zeros((2, 3)).shape == (2, 3)
  assert Tensor.full((2,), 7).dtype is dtypes.int32 and Tensor.full((2,), 1.5).dtype is dtypes.float32
  assert Tensor.ones(3, dtype=dtypes.int8).dtype is dtypes.int8
  assert Tensor.zeros(2).cast(dtypes.float16).uop.src[0].op is Ops.CONST  # a cast constant stays a constant


def test_constant_values():
  realize_and_check([
    (Tensor.zeros(2, 3), np.zeros((2, 3))),
    (Tensor.ones((1, 4)), np.ones((1, 4))),
    (Tensor.full((3,), -2.5), np.full(3, -2.5)),
    (Tensor.full((), 4), np.array(4)),
    (Tensor.ones(2, 2).zeros_like() + Tensor.ones(2, 2).full_like(3.0), np.full((2, 2), 3.0)),
  ])


def test_arange_and_eye():
  assert Tensor.arange(5).dtype is dtypes.int32 and Tensor.arange(0, 1, 0.25).dtype is dtypes.float32
  assert Tensor.arange(5).uop.op is Ops.IOTA  # a range is computed on the device, never stored
  realize_and_check([
    (Tensor.arange(5), np.arange(5)),
    (Tensor.arange(2, 11, 3), np.arange(2, 11, 3)),
    (Tensor.arange(5, -4, -2), np.arange(5, -4, -2)),
    (Tensor.arange(0, 1, 0.25), np.arange(0, 1, 0.25)),
    (Tensor.arange(1.5, 4.0), np.arange(1.5, 4.0)),
    (Tensor.arange(3, dtype=dtypes.float16), np.arange(3, dtype=np.float16)),
    (Tensor.eye(3), np.eye(3)),
    (Tensor.eye(2, 4, dtype=dtypes.int32), np.eye(2, 4)),
  ])
  with pytest.raises(ValueError, match="step"): Tensor.arange(0, 5, 0)


# ---- properties and casts ----
def test_properties():
  t = Tensor(np.zeros((2, 1, 3), np.float32))
  assert (t.shape, t.ndim, t.numel(), len(t), t.dtype) == ((2, 1, 3), 3, 6, 2, dtypes.float32)
  assert t.device in ("CPU", "CUDA")
  assert "shape=(2, 1, 3)" in repr(t)
  with pytest.raises(TypeError): len(Tensor(1.0))
  with pytest.raises(ValueError, match=r"\(2, 1, 3\)"): t.item()


def test_casts():
  x = np.array([[-2.7, -0.5, 0.0], [0.4, 1.5, 300.25]], np.float32)
  t = Tensor(x)
  assert (t.int().dtype, t.half().dtype, t.bool().dtype, t.float().dtype) == \
    (dtypes.int32, dtypes.float16, dtypes.bool, dtypes.float32)
  assert t.float() is t  # casting to the same dtype is no operation
  realize_and_check([
    (t.int(), x.astype(np.int32)),
    (t.half(), x.astype(np.float16)),
    (t.bool(), x.astype(bool)),
    (t.cast(dtypes.float64), x.astype(np.float64)),
    (t.int().cast(dtypes.int8), x.astype(np.int32).astype(np.int8)),
    (Tensor([True, False]).float(), [1.0, 0.0]),
    (Tensor([3, -4]).cast("float32"), [3.0, -4.0]),
  ])


def test_contiguous_of_a_view():
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  c = Tensor(x).T.contiguous()
  assert c.uop.op is Ops.CONTIGUOUS and c.shape == (4, 3)
  assert_array_equal(c.numpy(), x.T)
  assert c.contiguous() is c  # realized: nothing to do


def test_realize_gives_a_contiguous_buffer_view():
  t = (Tensor([1.0, 2.0]) * 3).realize()
  assert t.uop.op is Ops.VIEW and t.uop.src[0].op is Ops.BUFFER and t.uop.arg.is_contiguous
  assert t.tolist() == [3.0, 6.0]
  assert (t + 1).tolist() == [4.0, 7.0]  # a realized tensor feeds further graphs


def test_iterating_and_truth():
  t = Tensor([[1, 2], [3, 4]])
  assert [row.tolist() for row in t] == [[1, 2], [3, 4]]
  assert bool(Tensor([5])) and not bool(Tensor(0.0))
  with pytest.raises(ValueError, match="ambiguous"): bool(t)
  t[0] = 1  # an in-place update (tests/test_assign.py)
  assert t.tolist() == [[1, 1], [3, 4]]


# ---- devices ----
def test_device_names():
  t = Tensor([1.0], device="cpu")
  assert t.device == "CPU" and t.to("CPU") is t
  with pytest.raises(ValueError, match="TPU"): Tensor([1.0], device="TPU")
  with pytest.raises(ValueError, match="TPU"): Tensor.zeros(2, device="TPU")


def test_unknown_DEVICE_environment_variable(monkeypatch):
  monkeypatch.setenv("DEVICE", "QUANTUM")
  with pytest.raises(ValueError, match="QUANTUM"): Tensor([1.0])
  with pytest.raises(ValueError, match="QUANTUM"): Tensor.ones(3)


def _cuda_available() -> bool:
  from runtime.device import get_device
  try: get_device("CUDA"); return True
  except Exception: return False


def test_copy_between_devices():
  if not _cuda_available(): pytest.skip("no CUDA device on this machine")
  x = np.arange(6, dtype=np.float32).reshape(2, 3)
  on_cpu = Tensor(x, device="CPU")
  on_gpu = (on_cpu * 2).to("CUDA")
  assert on_gpu.uop.op is Ops.COPY and on_gpu.uop.arg == ("CPU", "CUDA") and on_gpu.device == "CUDA"
  back = (on_gpu + 1).to("CPU")
  assert back.device == "CPU"
  assert_array_equal(back.numpy(), x * 2 + 1)
  with pytest.raises(ValueError, match="devices"): on_cpu + on_gpu


def test_tensor_shapes_agree_with_the_graph():
  from rules.shapes import shape_of
  x = Tensor(np.ones((2, 3, 4), np.float32))
  for t in (x, x.sum(1), x.max((0, 2), keepdim=True), x.permute(2, 0, 1).reshape(4, 6), x[1, ::-2], x.pad(((1, 0), None, None), 2.0),
            x @ x.transpose(-1, -2), x.cat(x, axis=2), Tensor.arange(5), Tensor.rand(3, 2, seed=0), Tensor(1.0), x.to("CPU"),
            Tensor.ones(1, 2, 5, 5).conv2d(Tensor.ones(3, 2, 3, 3), padding=1), x.contiguous(), x.argmax(1)):
    assert shape_of(t.uop) == t.shape
