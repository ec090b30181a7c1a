"""A CUDA source of kernels that need no half, bfloat16 or tensor-core header declares itself the little it uses of
CUDA (renderers/cuda.py DECLARATIONS), and nvcc compiles it without cuda_runtime.h (runtime/cuda.py SELF_CONTAINED),
the header whose parse was most of a small kernel's compile. The same source still compiles with a plain `nvcc`
(cuda_runtime.h included: the declarations step aside). Checked without a GPU: the sources' structure, and nvcc's PTX
of one source both ways, which must be the same code."""
import re
import subprocess
import numpy as np
import pytest

from renderers.cuda import DECLARATIONS, renderer
from runtime import cuda
from runtime.device import CompileError
from tensor import Tensor

try: NVCC = cuda.find_nvcc()
except CompileError: NVCC = None
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources not compiled")


def t(*shape, dtype=np.float32):
  return Tensor(np.random.default_rng(len(shape)).standard_normal(shape).astype(dtype), device="CPU")


def kernels_of(*tensors) -> list[str]:
  return [k for x in tensors for k in x.kernel_sources(device="CUDA")]


def light_kernels() -> list[str]:
  """Kernels of every kind the renderer writes without headers, but for row combines of 64-bit values (below): math
  of float32 and float64, row combines over a warp and over a block of 32-bit values (an int8 and a bool widened to
  int32), NaN and infinity literals, a product through shared tiles and a register tile."""
  x, odd, row = t(32, 48), t(7, 37), t(3, 5000)
  return kernels_of((x.exp() * x.sin() + x.abs().sqrt().log()).floor(), x.double().exp() * 2, x.softmax(1),
                    row.layernorm(), odd.max(1), x.int().sum(1), x.long() + 3, (row > 0).any(1),
                    x.cast(np.int8).max(1), t(256, 64) @ t(64, 256))




def test_a_float32_program_is_one_self_contained_source_with_no_include():
  source = renderer.source(kernels_of(t(32, 48).softmax(1)))
  assert source.startswith(cuda.SELF_CONTAINED) and "#include" not in source
  assert "-I" in cuda.target_flags(source, "sm_90")   # compiled with the empty cuda_runtime.h first on the path
  stand_in = (cuda.NO_RUNTIME_HEADER / "cuda_runtime.h").read_text()
  assert re.sub(r"/\*.*?\*/", "", stand_in, flags=re.S).strip() == ""   # it declares nothing


def test_a_half_kernel_takes_the_cuda_headers_and_the_real_cuda_runtime_h():
  source = renderer.source(kernels_of(t(32, 48).half() * 2))
  assert source.startswith("#include <cuda_fp16.h>") and cuda.SELF_CONTAINED not in source
  assert "-I" not in cuda.target_flags(source, "sm_90")


def ptx(source: str, tmp_path, headers: bool) -> str:
  """nvcc's PTX of `source`, less its comments (they name the file): with the flags the CUDA device gives it, or
  with those of a plain `nvcc -arch=sm_90`, which includes cuda_runtime.h."""
  name = "headers" if headers else "declarations"
  src, out = tmp_path / f"{name}.cu", tmp_path / f"{name}.ptx"
  src.write_text(source)
  flags = ["-arch=sm_90"] if headers else cuda.target_flags(source, "sm_90")
  subprocess.run([NVCC, "-ptx", *flags, "-o", str(out), str(src)], check=True, capture_output=True, text=True)
  return "\n".join(line for line in out.read_text().splitlines() if not line.startswith("//"))


@needs_nvcc
def test_the_declarations_give_the_code_the_cuda_headers_give(tmp_path):
  kernels = light_kernels()
  light = renderer.source(kernels)
  assert light.startswith(DECLARATIONS)
  light_ptx, headers_ptx = ptx(light, tmp_path, headers=False), ptx(light, tmp_path, headers=True)
  # the same code: every builtin reached what the headers reach (libdevice's functions, the shuffle, the indices)
  assert light_ptx == headers_ptx
  for used in ("shfl.sync.bfly", "bar.sync", "%tid.x", "%ctaid.x", "%ntid.x", "ex2.approx", "sqrt.rn.f32", ".shared"):
    assert used in light_ptx, used
  assert len(re.findall(r"\.entry", light_ptx)) == len(kernels)


@needs_nvcc
def test_a_64_bit_row_combine_shuffles_two_words_a_step_as_the_headers_do(tmp_path):
  # the headers split a double with inline asm, the declarations through a union: other PTX text, the same shuffles
  for kernels in (kernels_of(t(32, 48).double().sum(1)), kernels_of(t(3, 5000).long().max(1))):
    source = renderer.source(kernels)
    light_ptx, headers_ptx = ptx(source, tmp_path, headers=False), ptx(source, tmp_path, headers=True)
    shuffles = light_ptx.count("shfl.sync.bfly.b32")
    assert shuffles > 0 and shuffles % 2 == 0 and shuffles == headers_ptx.count("shfl.sync.bfly.b32")


def test_a_kernel_that_needs_an_undeclared_function_says_so():
  # a rule that renders a function the declarations lack fails at nvcc, with its name (not a silent wrong call)
  source = renderer.source(['extern "C" __global__ void k(float* __restrict__ data0) { *data0 = cbrtf(*data0); }'])
  assert source.startswith(cuda.SELF_CONTAINED)
  if NVCC is None: pytest.skip("nvcc not found")
  with pytest.raises(CompileError, match="cbrtf"): cuda.compile_cuda(source)


@needs_nvcc
def test_the_tiled_attention_kernel_is_self_contained_and_the_same_code_as_with_the_headers(tmp_path, monkeypatch):
  # renderers/attention_cuda.py: dynamic shared tiles, 16-byte vectors (floatx4), __syncthreads_or, fmaxf
  monkeypatch.setenv("GRAFT_ATTENTION", "1")   # fused at this size too (by default only where rows fill a GPU)
  q, k, v = t(2, 96, 64), t(2, 80, 64), t(2, 80, 64)
  source = renderer.source(kernels_of((q @ k.transpose(-1, -2) / 8).softmax(-1) @ v))
  assert source.startswith(DECLARATIONS) and "g_dynamic_shared" in source and "__syncthreads_or" in source
  light_ptx, headers_ptx = ptx(source, tmp_path, headers=False), ptx(source, tmp_path, headers=True)
  # the same instructions (the two front ends number a few virtual registers in another order)
  same = lambda ptx: re.sub(r"%[a-z]+\d+", "%r", ptx)
  assert same(light_ptx) == same(headers_ptx) and "bar.red.or" in light_ptx and "max.f32" in light_ptx
