"""The GPU stages (rules/gpu.py) compute the right values, checked without a GPU: kernels lowered for a device whose
loops are its threads run in a small numpy model of a CUDA grid (every thread of every block at once, as arrays over
(block, thread); loops are uniform across threads; a BARRIER combines over the threads of a block), and must give
what numpy gives. Covers one thread per element and one block per row, sizes that do not divide (gated stores,
clamped indices), unrolled and looped thread loops, fused softmax and layer norm, and the launch limits."""
import math
import numpy as np
import pytest

from rewrite import Ops, dtypes
from rules.gpu import MAX_THREADS, launch_dims
from rules.pipeline import Run, lower_kernel, schedule
from rules.realize import NewBuffer, normalize
from tensor import Tensor

rng = np.random.default_rng(3)


def _cdiv(a, b):
  q = np.abs(a) // np.where(b == 0, 1, np.abs(b))
  return np.where((a < 0) != (b < 0), -q, q)


ALU = {Ops.ADD: np.add, Ops.MUL: np.multiply, Ops.MAX: np.maximum, Ops.FDIV: np.divide, Ops.CMPLT: np.less,
       Ops.CMPNE: np.not_equal, Ops.AND: np.bitwise_and, Ops.OR: np.bitwise_or, Ops.XOR: np.bitwise_xor,
       Ops.SHL: np.left_shift, Ops.SHR: np.right_shift, Ops.NEG: np.negative, Ops.RECIP: np.reciprocal,
       Ops.EXP2: np.exp2, Ops.LOG2: np.log2, Ops.SIN: np.sin, Ops.SQRT: np.sqrt, Ops.TRUNC: np.trunc,
       Ops.WHERE: np.where, Ops.MULACC: lambda a, b, c: a * b + c, Ops.IDIV: _cdiv, Ops.MOD: lambda a, b: a - b * _cdiv(a, b)}


def run_grid(linear, memory: dict[int, np.ndarray]) -> None:
  """Run one linear kernel over `memory` (argument slot -> flat array) on every thread of its grid at once."""
  dims = launch_dims(linear)
  shape = (dims[0][0], dims[1][0]) if dims else (1, 1)
  val: dict = {}
  def v(u): return np.array(u.arg, u.dtype.np) if u.op is Ops.CONST else val[u]
  loop_start: dict = {}
  pc, src = 0, linear.src
  with np.errstate(all="ignore"):
    while pc < len(src):
      u = src[pc]
      if u.op is Ops.DEFINE_GLOBAL: val[u] = memory[u.arg]
      elif u.op is Ops.SPECIAL: val[u] = np.arange(u.arg[1], dtype=np.int32).reshape((-1, 1) if u.arg[0][0] == "g" else (1, -1))
      elif u.op is Ops.INDEX: val[u] = (v(u.src[0]), np.broadcast_to(v(u.src[1]), shape))
      elif u.op is Ops.LOAD:
        buf, idx = v(u.src[0])
        if len(u.src) == 1: val[u] = buf[idx]
        else:
          ok = np.broadcast_to(v(u.src[1]), shape)
          val[u] = np.where(ok, buf[np.where(ok, idx, 0)], np.zeros((), buf.dtype))
      elif u.op is Ops.STORE:
        (buf, idx), x = v(u.src[0]), np.broadcast_to(v(u.src[1]), shape).astype(buf.dtype)
        gate = np.broadcast_to(v(u.src[2]), shape) if len(u.src) > 2 else np.ones(shape, bool)
        buf[idx[gate]] = x[gate]
      elif u.op is Ops.RANGE:
        if u not in loop_start: loop_start[u], val[u] = pc, np.array(0, np.int32)
      elif u.op is Ops.END:
        r = u.src[0]
        val[r] = val[r] + 1
        if val[r] < r.src[0].arg: pc = loop_start[r]
        else: del loop_start[r]
      elif u.op is Ops.DEFINE_ACC:
        red = u.src[0]
        val[red] = np.array(0 if red.arg is Ops.ADD else dtypes.min(red.dtype), red.dtype.np)
      elif u.op is Ops.ASSIGN:
        red = u.src[0]
        val[red] = ALU[red.arg](val[red], v(red.src[0])).astype(red.dtype.np)
      elif u.op is Ops.REDUCE: pass  # its value is its accumulator
      elif u.op is Ops.BARRIER:
        x = np.broadcast_to(v(u.src[0]), shape)
        val[u] = (x.sum(1, keepdims=True, dtype=x.dtype) if u.arg is Ops.ADD else x.max(1, keepdims=True)).astype(u.dtype.np)
      elif u.op is Ops.CAST: val[u] = np.asarray(v(u.src[0])).astype(u.dtype.np)
      else: val[u] = np.asarray(ALU[u.op](*[v(s) for s in u.src])).astype(u.dtype.np)
      pc += 1


def run_on_model_gpu(*tensors: Tensor) -> list[np.ndarray]:
  """The tensors computed through the GPU stages, in the model grid; inputs come from their CPU buffers."""
  run = Run("CPU", parallel=False, device_loops=True)
  kernels, realized = schedule([t.uop for t in tensors], ["CPU"] * len(tensors), run)
  arrays: dict = {}
  def array_of(b):
    if b not in arrays: arrays[b] = np.zeros(b.arg.size, b.dtype.np) if isinstance(b.arg, NewBuffer) else b.arg.numpy()
    return arrays[b]
  for k in kernels:
    assert k.op is Ops.KERNEL
    norm, bufs = normalize(k)
    linear = lower_kernel(norm, Run("CPU", parallel=False, device_loops=True))
    if (dims := launch_dims(linear)) is not None: assert dims[1][0] <= MAX_THREADS
    run_grid(linear, {i: array_of(b) for i, b in enumerate(bufs)})
  return [array_of(u.src[0]).reshape(t.shape) for u, t in zip(realized, tensors)]


def T(*shape): return Tensor(rng.standard_normal(shape).astype(np.float32), device="CPU")


def softmax(x, axis=-1):
  e = np.exp(x - x.max(axis, keepdims=True))
  return e / e.sum(axis, keepdims=True)


@pytest.mark.parametrize("shape", [(64, 2048), (5, 300), (3, 130), (2, 40000), (300, 7), (1, 1)])
def test_row_reductions_softmax_layernorm(shape):
  x = T(*shape)
  xn = x.numpy()
  got = run_on_model_gpu(x.sum(1), x.max(1), x.softmax(1), x.layernorm(1), x.sum(0), x.sum())
  want = [xn.sum(1), xn.max(1), softmax(xn, 1), (xn - xn.mean(1, keepdims=True)) / np.sqrt(xn.var(1, keepdims=True) + 1e-5),
          xn.sum(0), xn.sum()]
  for g, w in zip(got, want): np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-4)


def test_elementwise_views_and_odd_sizes():
  x, y = T(33, 45), T(45)
  xn, yn = x.numpy(), y.numpy()
  got = run_on_model_gpu(((x * y + 1).exp() - x).relu(), x.T.flip(0)[3:40:2] * 2, x.pad(((1, 2), (0, 1))))
  want = [np.maximum(np.exp(xn * yn + 1) - xn, 0), xn.T[::-1][3:40:2] * 2, np.pad(xn, ((1, 2), (0, 1)))]
  for g, w in zip(got, want): np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_matmul_conv_and_attention():
  a, b = T(17, 200), T(200, 9)
  img, w = T(2, 3, 8, 8), T(4, 3, 3, 3)
  q = T(2, 130, 16)
  got = run_on_model_gpu(a @ b, img.conv2d(w, padding=1), (q @ q.transpose(-1, -2) / 4).softmax(-1) @ q)
  qn = q.numpy()
  want = [a.numpy() @ b.numpy(), img.conv2d(w, padding=1).numpy(), softmax(qn @ qn.transpose(0, 2, 1) / 4) @ qn]
  for g, w_ in zip(got, want): np.testing.assert_allclose(g, w_, rtol=2e-4, atol=2e-4)


def test_softmax_and_layernorm_are_one_kernel_on_a_gpu():
  x = T(64, 2048)
  for t in (x.softmax(1), x.layernorm(1)):
    kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
    assert len(kernels) == 1
