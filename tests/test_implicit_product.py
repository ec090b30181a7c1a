"""A convolution on a GPU as an implicit product (rules/opt/implicit.py): its rows (image, output row, output column)
one loop and its reduction (channel, kernel row, kernel column) one loop, so that the GPU's product tile plan
(rules/opt/gpu_tile.py) stages its input's tile in shared memory, each element gathered from the windows as the tile
is filled: no im2col buffer. Checked without a GPU: the plan and the CUDA text, the numbers in the numpy model of a
grid (tests/test_gpu_stages.py), nvcc for sm_90; on a GPU (DEVICE=CUDA runs), the numbers against numpy."""
import numpy as np
import pytest
from numpy.testing import assert_allclose

from rules.pipeline import Run, lower_kernel, schedule
from rules.realize import normalize
from tensor import Tensor
from test_gpu_stages import run_on_model_gpu, gpu
from test_tensor_nn import _conv2d


def pair(v): return v if isinstance(v, tuple) else (v, v)


@pytest.fixture(autouse=True)
def implicit_product_plans(monkeypatch):
  """The convolutions here on the implicit product's plans: with the tensor-core stage on, the strict float32 ones
  that fit its FMA tile take that (tests/test_tensor_cores.py); the others, as this file's smallest, come here."""
  monkeypatch.setenv("GRAFT_TC", "0")


def conv(n=2, c=16, o=64, hw=(16, 16), stride=1, padding=1, bias=True, seed=0, device="CPU"):
  """(a float32 convolution with a bias and a ReLU, numpy's answer in float64)."""
  rng = np.random.default_rng(seed)
  x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((n, c, *hw), (o, c, 3, 3), (o,)))
  t = Tensor(x, device=device).conv2d(Tensor(w, device=device), Tensor(b, device=device) if bias else None, stride, padding)
  want = _conv2d(x, w, pair(stride), pair(padding)) + (b.reshape(1, o, 1, 1) if bias else 0)
  return t.relu(), np.maximum(want, 0)


def gpu_plan(t: Tensor) -> str:
  kernels, _ = schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))
  run = Run("CPU", parallel=False, device_loops=True, opt=gpu())
  lower_kernel(normalize(kernels[-1])[0], run)
  return str(run.opt.plan)


def test_a_convolution_takes_the_products_tile_plan_over_one_row_loop_and_one_reduction_loop():
  t, _ = conv()
  # axis 0: the 2 x 16 x 16 output positions, 1: the 64 filters, 2: the 16 x 3 x 3 reduction, in slices staged in shared memory
  assert gpu_plan(t).startswith("upcast(0, ") and "split(2, 16) pack(2)" in gpu_plan(t)
  src = t.kernel_sources(device="CUDA")
  assert len(src) == 2 and "__shared__" in src[1] and "__syncthreads()" in src[1]   # the padded copy, then the product
  assert "%16)" in src[1] and "/9)" in src[1]   # the flat rows (16 columns) and reduction (9 a channel) split back
  assert "<0.0f)" in src[1] and src[1].count("*(data0+") == 4   # each of a lane's 2 x 2 outputs through the ReLU


@pytest.mark.parametrize("n, c, o, hw, stride, padding", [
  (2, 16, 64, (16, 16), 1, 1), (2, 8, 32, (15, 15), 2, 1), (1, 4, 32, (9, 13), (1, 2), (2, 0)), (3, 5, 8, (7, 9), 1, 0),
], ids=["pad1", "stride2-odd", "mixed", "untiled"])
def test_convolutions_give_numpys_values_in_the_model_grid(n, c, o, hw, stride, padding):
  t, want = conv(n, c, o, hw, stride, padding)
  (got,) = run_on_model_gpu(t)
  assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def implicit_rewrites(t: Tensor) -> int:
  """How often the implicit_product stage rewrote the kernel of t as the GPU plans it."""
  from rewrite import stats
  with stats.collect() as s: gpu_plan(t)
  return s.stages["implicit_product"].rewrites


def test_a_product_with_one_reduction_loop_is_left_as_it_is():
  rng = np.random.default_rng(1)
  a, b = (Tensor(rng.standard_normal(s).astype(np.float32)) for s in ((256, 64), (64, 128)))
  assert gpu_plan(a @ b).startswith("upcast(0, ")
  assert implicit_rewrites(a @ b) == 0 and implicit_rewrites(conv()[0]) == 1


def test_the_convolution_kernels_compile_for_sm_90(tmp_path):
  from runtime import cuda
  from runtime.device import CompileError
  from renderers.cuda import renderer
  try: nvcc = cuda.find_nvcc()
  except CompileError: pytest.skip("nvcc not found: CUDA kernels not compiled")
  kernels = [k for case in [conv(), conv(2, 8, 32, (15, 15), 2, 1, bias=False)] for k in case[0].kernel_sources(device="CUDA")]
  src, out = tmp_path / "conv.cu", tmp_path / "conv.cubin"
  src.write_text(renderer.source(kernels))
  cuda._run_nvcc(nvcc, "sm_90", src, out)
  assert out.stat().st_size > 0


@pytest.mark.parametrize("n, c, o, hw, stride, padding", [(4, 32, 128, (28, 28), 1, 1), (2, 16, 64, (31, 31), 2, 1), (3, 5, 8, (7, 9), 1, 0)])
def test_convolutions_on_the_gpu_match_numpy(n, c, o, hw, stride, padding, monkeypatch):
  from runtime.device import get_device
  from runtime.cuda import CUDAUnavailable
  try: get_device("CUDA")
  except CUDAUnavailable as e: pytest.skip(f"no usable CUDA GPU here: {str(e).split(' (')[0]}")
  t, want = conv(n, c, o, hw, stride, padding, device="CUDA")
  assert_allclose(t.numpy(), want, rtol=1e-4, atol=1e-4)   # strict float32
  monkeypatch.delenv("GRAFT_TC")   # the FMA tile where one fits (the first two), the same numbers
  t, want = conv(n, c, o, hw, stride, padding, device="CUDA")
  assert ("g_fma_tile" in t.kernel_sources()[-1]) == (c != 5)
  assert_allclose(t.numpy(), want, rtol=1e-4, atol=1e-4)
