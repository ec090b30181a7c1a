"""Every kernel of the test session, rendered for CUDA through the GPU stages and compiled by nvcc for sm_90 in two calls
(the kernels that need CUDA's headers, and the self-contained rest).

The file is named to run last (pytest runs files in name order): it takes every kernel compiled so far in this
session from runtime.realize's kernel cache (whatever device it was built for), plus the kernels of a set of
representative Tensor programs of its own, so that it means something when run alone. The programs are scheduled
with the GPU's schedule stage too (`gpu_fuse`), without a GPU. It needs nvcc, not a GPU: skipped with the reason
where nvcc is absent (`pytest -rs` shows it).
"""
import itertools
import numpy as np
import pytest

from rewrite import Ops
from rules.gpu import MAX_GRID, MAX_THREADS, MULTIPROCESSORS, launch_dims
from rules.split import split_reduction_plan, split_reduction
from rules.pipeline import Run, lower_kernel, schedule
from rules.realize import normalize
from runtime import cuda
from runtime.device import CompileError

try: NVCC = cuda.find_nvcc()
except CompileError: NVCC = None
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (not on PATH, $CUDA_HOME/bin or "
                                                     "/usr/local/cuda/bin): CUDA kernels not compiled")

ARCH = "sm_90"


def random_tensors():
  from tensor import Tensor
  rng = np.random.default_rng(0)
  return lambda *shape, dtype=np.float32: Tensor(rng.standard_normal(shape).astype(dtype), device="CPU")


def long_reductions():
  """Reductions of few, long rows: the ones a GPU may split into partials and their combine."""
  t = random_tensors()
  long, wide = t(1024, 1024), t(4, 65536)
  return [long.sum(), long.max(), t(8192, 96).sum(0), wide.sum(1), wide.mean(1), (long > 0).any(), long.half().sum(),
          (long * 4).int().sum()]


def programs():
  """Tensor programs covering the kernel shapes the GPU stages tell apart, on the CPU (no GPU needed to schedule)."""
  from tensor import Tensor
  t = random_tensors()
  x, y, odd, big = t(32, 48), t(32, 48), t(7, 37), t(3, 5000)
  img, w = t(2, 3, 9, 9), t(4, 3, 3, 3)
  return [
    [((x * y + 1).exp() - x).relu(), x.sin() / y.sqrt().abs(), (x < y).where(x, y), x.maximum(y).clip(-1, 1), t(129, 200) * 2],
    [x.sum(1), x.sum(0), x.sum(), x.max(1), x.min(0), x.mean(), x.var(1), x.argmax(1), odd.sum(1), big.sum(1)],
    [x.softmax(1), x.log_softmax(0), x.layernorm(), big.softmax(1), odd.layernorm(), big.layernorm()],
    [x.log_softmax(1), odd.softmax(1), t(300, 7).var(1), t(5, 3).layernorm(), x - x.mean(1, keepdim=True)],
    # long rows in registers, read and written in runs of 4 floats (floatx4: rules/gpu_vector.py)
    [(long_rows := t(64, 4096)).softmax(1), long_rows.layernorm(), t(8, 2048).sum(1), t(64, 4097)[:, 1:].softmax(1)],
    [x @ y.T, x[::2, 3:40:3].flip(0).pad(((1, 2), (0, 1))), x.reshape(48, 32).permute(1, 0).contiguous() * 2],
    [img.conv2d(w, padding=1), img.max_pool2d(2), img.avg_pool2d(3)],
    [(att := t(2, 130, 16)) @ att.transpose(-1, -2) / 4, ((att @ att.transpose(-1, -2)).softmax(-1) @ att)],
    [x.half() * 2, x.half().sum(1), x.half().max(1), x.int().sum(1), (x > 0).any(1), (x > 0).all(0),
     x.cast(np.int8).max(1), x.double().sum(0), x.long() + 3, Tensor.arange(1000, device="CPU").float().sum()],
    [Tensor.rand(64, 33, seed=1, device="CPU"), Tensor.eye(5, device="CPU")],
    # products whose sizes divide a tile: shared-memory tiles, register tiles, fused epilogues and prologues
    [t(2048, 64) @ t(64, 2048), ((t(1024, 64) @ t(64, 512)) + t(512)).gelu(), t(256, 32) @ t(128, 32).T,
     t(4, 128, 32) @ t(4, 32, 64), (t(256, 64) * 2).relu() @ t(64, 256), (t(256, 64) @ t(64, 256)).half(),
     (t(256, 64).layernorm(1) * t(64)) @ t(64, 256) + t(256),
     # a product of few tiles (the GPT forward's projection and residual): also split into partials and their combine
     t(1024, 768) + (t(1024, 768) @ t(768, 768) + t(768))],
    # few, long rows, one a group (reductions of one shape would share a kernel): each also split into partials and
    # their combine (below)
    *([r] for r in long_reductions()),
  ]


def gpu_schedule(tensors) -> list:
  run = Run("CPU", parallel=False, device_loops=True)
  kernels, _ = schedule([u.uop for u in tensors], [u.device for u in tensors], run)
  return [k for k in kernels if k.op is Ops.KERNEL]


def gpu_kernels_of(tensors) -> list:
  """The kernels of the tensors scheduled for a GPU, and for each reduction the GPU may split, its two kernels too."""
  kernels = gpu_schedule(tensors)
  split = [k2 for k in kernels if (opt := split_reduction_plan(k)) is not None for k2 in split_reduction(k, opt)[:2]]
  return [normalize(k)[0] for k in kernels + split]


def test_the_long_reductions_are_split_so_their_two_kernels_are_compiled_too():
  assert all(any(split_reduction_plan(k) is not None for k in gpu_schedule([r])) for r in long_reductions())


def test_every_kernel_compiles_for_cuda(tmp_path):
  from runtime import realize as rr
  from renderers.cuda import renderer
  kernels = list(dict.fromkeys(key[0] for key in list(rr._kernels)))  # keys: (normalized kernel, device, pipeline version)
  session = len(kernels)
  for group in programs(): kernels += gpu_kernels_of(group)
  bodies: dict[str, None] = {}
  # each kernel planned for the default GPU and for one of a single multiprocessor, where a thread takes several
  # elements of even a small kernel
  for norm, sms in itertools.product(kernels, (MULTIPROCESSORS, 1)):
    linear = lower_kernel(norm, Run("CUDA", parallel=False, device_loops=True, multiprocessors=sms))
    dims = launch_dims(linear)
    if dims is not None:
      (blocks, *_), (threads, *_) = dims
      assert 1 <= threads <= MAX_THREADS and 1 <= blocks <= MAX_GRID, (dims, norm)
      if any(u.op is Ops.BARRIER for u in linear.src): assert threads % 32 == 0, "a row combine needs whole warps"
    bodies.setdefault(renderer.render("KERNEL_NAME", linear), None)
  names = [f"k{i}" for i in range(len(bodies))]
  named = [b.replace("KERNEL_NAME", n) for b, n in zip(bodies, names)]
  # as a realize compiles them: those that need none of CUDA's headers as one self-contained source (renderers/cuda.py
  # DECLARATIONS), the others with the headers (tests/test_cuda_declarations.py compiles a source both ways)
  light = [k for k in named if renderer.source([k]).startswith(cuda.SELF_CONTAINED)]
  heavy = [k for k in named if k not in light]
  for part, kernels in (("with_headers", heavy), ("self_contained", light)):
    src, out = tmp_path / f"{part}.cu", tmp_path / f"{part}.cubin"
    src.write_text(renderer.source(kernels))
    printed = cuda._run_nvcc(NVCC, ARCH, src, out)   # one nvcc call; CompileError with nvcc's message fails the test
    assert "C7514" not in printed and "serialized" not in printed, printed   # no kernel's wgmma serialized by ptxas
    assert out.stat().st_size > 0
    for k, n in zip(named, names):
      if k in kernels: assert n.encode() in out.read_bytes(), f"kernel {n} is not in the cubin"
  assert light and heavy
  print(f"{len(names)} distinct CUDA kernels ({session} from this session's cache, {len(light)} self-contained) "
        f"compiled for {ARCH}")
