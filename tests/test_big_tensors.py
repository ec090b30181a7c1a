"""Big tensors: 64-bit indices exactly where 32 bits overflow, and clear errors for sizes that cannot be.

Three kinds of test: kernels really run on the CPU over 2**31 + 64 int8 elements (2 GiB, compared with numpy); the
index_width rules on small graphs; and the generated source (CPU and CUDA, rendered but not run) of kernels over
buffers past 2**32 elements, which are never allocated (a Buffer takes memory on first use only).
"""
import math
import numpy as np
import pytest

from rewrite import UOp, Ops, dtypes, graph_rewrite
from rules.gpu import MAX_GRID, launch_dims
from rules.index_width import index_width_rules
from rules.pipeline import Run, lower_kernel, schedule
from rules.realize import normalize
from rules.strided_view import View
from runtime import cuda
from runtime.buffer import Buffer
from runtime.device import CompileError, get_device
from tensor import Tensor

N = (1 << 31) + 64  # int8 elements: past what an int can count, 2 GiB
i32, i64 = dtypes.int32, dtypes.int64


def available_memory() -> int:
  with open("/proc/meminfo") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


@pytest.fixture
def two_gib_buffers():
  """Skip where the machine cannot hold a 2 GiB buffer and its 2 GiB numpy copy; give the memory back after."""
  if available_memory() < 5 << 30: pytest.skip(f"needs 5 GiB of free memory, {available_memory() >> 20} MiB free")
  yield
  get_device("CPU").allocator.clear_pool()


# ---- real kernels over 2**31 + 64 elements ----

def test_a_sum_whose_loop_counts_past_2_31_terminates():
  # the issue's case: with an int counter this loop never ended
  assert Tensor.ones(N, dtype=np.int8).cast(np.int64).sum().item() == N


def test_elementwise_and_sum_over_2_31_plus_64_int8_elements(two_gib_buffers):
  y = (Tensor.arange(N).cast(np.int8) * 3 + 1).realize()   # stores at offsets past 2**31
  total = y.cast(np.int64).sum()                           # loads them back
  # numpy's values repeat every 256 elements: compare one period with every stretch of the result
  period = np.arange(256).astype(np.int8) * np.int8(3) + np.int8(1)
  assert total.item() == period.sum(dtype=np.int64) * (N // 256) + period[:N % 256].sum(dtype=np.int64)
  got = y.numpy()
  del y
  assert got.shape == (N,) and got.dtype == np.int8
  # 8 bytes at a time (N is a multiple of 8), one 64 MiB stretch after another
  words, want = got.view(np.uint64), np.tile(period, 1 << 18).view(np.uint64)
  for lo in range(0, words.size, want.size):
    assert np.array_equal(words[lo:lo + want.size], want[:words.size - lo]), f"elements from {8 * lo} on"


def test_arange_past_int32_is_int64_like_numpy():
  t = Tensor.arange(2**31 - 2, 2**31 + 2)
  assert t.dtype is dtypes.int64 and t.tolist() == list(range(2**31 - 2, 2**31 + 2))
  assert Tensor.arange(5).dtype is dtypes.int32


# ---- the rules on small graphs ----

def loop(n: int, name: str = "i") -> UOp: return UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, n),), (name, 0))


def widths(u: UOp) -> UOp: return graph_rewrite(u, index_width_rules)


def test_indices_that_fit_stay_int32():
  i, j = loop(4096, "i"), loop(4096, "j")
  out = widths(i * 4096 + j)
  assert out.dtype is i32 and all(n.dtype in (i32, dtypes.void) for n in out.toposort)


def test_a_loop_is_int64_when_its_trip_count_is_past_int32():
  assert widths(loop(2**31 - 1)).dtype is i32   # i < 2147483647: i stays an int to the end
  assert widths(loop(2**31)).dtype is i64       # i < 2147483648: i++ would overflow an int


def test_a_product_past_int32_widens_its_int32_sources():
  row, col = loop(2**20, "row"), loop(4097, "col")
  out = widths(row * 4097 + col)
  assert out.dtype is i64
  product = out.src[0]
  assert product.op is Ops.MUL and product.src[0] is widths(row).cast(i64) and product.src[1] is UOp.const(i64, 4097)
  assert widths(row).dtype is i32 and widths(col).dtype is i32


def test_what_is_computed_from_an_int64_index_stays_int64():
  big = loop(2**33)
  assert widths(big // 2**20).dtype is i64                      # its value fits, but computing it needs 64 bits
  cmp = widths(big < loop(10, "small"))                         # a comparison of int64 with int32 compares in int64
  assert cmp.dtype is dtypes.bool and cmp.src[0].dtype is i64 and cmp.src[1] is widths(loop(10, "small")).cast(i64)


@pytest.mark.parametrize("gpu", [False, True])
def test_kernels_of_ordinary_sizes_have_no_64_bit_index(gpu):
  x, w = Tensor.ones(512, 300), Tensor.ones(200, 300)
  for linear in gpu_or_cpu_linear(x.softmax(1), x @ w.T, (x + 1).sum(0), Tensor.arange(100_000) * 2, gpu=gpu):
    counters = {u.dtype for u in linear.src if u.op in (Ops.RANGE, Ops.SPECIAL)}
    offsets = {u.src[1].dtype for u in linear.src if u.op is Ops.INDEX}
    assert counters <= {i32} and offsets == {i32}, render(linear, gpu)


def test_no_index_dtype_is_left_for_the_renderer():
  k = (Tensor.ones(3, 5) + Tensor.arange(5)).sum(1)
  linear = gpu_or_cpu_linear(k, gpu=False)[0]
  assert not any(u.dtype is dtypes.index for u in linear.toposort)


# ---- generated source past 2**32 elements, not run ----

def unallocated(*shape, dtype=dtypes.int8) -> Tensor:
  """A tensor over a Buffer that is never allocated (memory is taken on first use, and these are only rendered)."""
  buf = UOp(Ops.BUFFER, dtype, (), Buffer("CPU", math.prod(shape), dtype))
  return Tensor._from_uop(UOp(Ops.VIEW, dtype, (buf,), View.contiguous(shape)), shape, "CPU")


def gpu_or_cpu_linear(*tensors: Tensor, gpu: bool) -> list[UOp]:
  """The linear kernels of `tensors` through the CPU's or the GPU's stages (nothing allocated, compiled or run)."""
  kernels, _ = schedule([t.uop for t in tensors], ["CPU"] * len(tensors), Run("CPU", parallel=not gpu, device_loops=gpu))
  return [lower_kernel(normalize(k)[0], Run("CPU", parallel=not gpu, device_loops=gpu)) for k in kernels]


def render(linear: UOp, gpu: bool) -> str:
  from renderers.c import renderer as c
  from renderers.cuda import renderer as cu
  return (cu if gpu else c).render("k", linear)


def loop_types(linear: UOp) -> dict[int, str]:
  """Trip count -> dtype name of each loop."""
  return {u.src[0].arg: u.dtype.name for u in linear.src if u.op is Ops.RANGE}


def offset_types(linear: UOp) -> dict[str, set[str]]:
  """'load' / 'store' -> dtype names of the offsets into buffers."""
  out: dict[str, set[str]] = {"load": set(), "store": set()}
  for u in linear.src:
    if u.op in (Ops.LOAD, Ops.STORE): out[u.op.name.lower()].add(u.src[0].src[1].dtype.name)
  return out


def test_cpu_row_sums_of_a_matrix_past_2_32_elements():
  x = unallocated(2**20, 4097)                  # 4.3e9 elements: row * 4097 + col needs 64 bits, row and col do not
  (linear,) = gpu_or_cpu_linear(x.cast(np.int32).sum(1), gpu=False)
  assert loop_types(linear) == {2**20: "int32", 4097: "int32"}
  assert offset_types(linear) == {"load": {"int64"}, "store": {"int32"}}
  src = render(linear, gpu=False)
  assert "for (int " in src and "for (long long" not in src and "((long long)(ridx" in src and "*4097LL)" in src


def test_cpu_elementwise_over_2_32_elements_counts_in_64_bits():
  x = unallocated(2**32 + 8)
  (linear,) = gpu_or_cpu_linear(x + 1, gpu=False)
  assert loop_types(linear) == {2**32 + 8: "int64"}
  assert offset_types(linear) == {"load": {"int64"}, "store": {"int64"}}
  src = render(linear, gpu=False)
  assert "for (long long ridx" in src and "< 4294967304LL" in src
  get_device("CPU").build(src.replace("void k(", "void big_add("), ["big_add"])   # gcc takes it


def test_cuda_elementwise_over_2_32_elements_has_64_bit_offsets_and_32_bit_thread_indices():
  (linear,) = gpu_or_cpu_linear(unallocated(2**32 + 8) + 1, gpu=True)
  (blocks, _, _), (threads, _, _) = launch_dims(linear)
  # a thread takes up to 4 elements where the grid still fills the GPU (rules/gpu.py rows_per_thread)
  assert blocks * threads * 4 >= 2**32 + 8 and blocks <= MAX_GRID
  assert {u.dtype.name for u in linear.src if u.op is Ops.SPECIAL} == {"int32"}
  assert offset_types(linear) == {"load": {"int64"}, "store": {"int64"}}
  src = render(linear, gpu=True)
  assert "int v" in src and "long long v" in src and "((long long)(" in src
  nvcc_compiles(src)


def test_cuda_row_sums_past_the_grid_limit_loop_over_blocks():
  # 2**31 + 5 rows: one block per row would be more blocks than a grid launches, so the blocks take turns
  (linear,) = gpu_or_cpu_linear(unallocated(2**31 + 5, 128).cast(np.int32).sum(1), gpu=True)
  (blocks, _, _), _ = launch_dims(linear)
  assert blocks <= MAX_GRID and loop_types(linear) == {2: "int32"}   # 2 turns of the grid
  assert offset_types(linear) == {"load": {"int64"}, "store": {"int64"}}
  nvcc_compiles(render(linear, gpu=True))


def test_a_grid_stride_loop_computes_the_same_values(monkeypatch):
  # the grid-stride loop, run on the model GPU of test_gpu_stages with a grid of at most 3 blocks
  import rules.gpu
  from test_gpu_stages import run_on_model_gpu
  monkeypatch.setattr(rules.gpu, "MAX_GRID", 3)
  x = Tensor(np.random.default_rng(0).standard_normal((37, 300)).astype(np.float32))
  flat, rows = run_on_model_gpu(x * 2 + 1, x.sum(1))
  np.testing.assert_allclose(flat, x.numpy() * 2 + 1)
  np.testing.assert_allclose(rows, x.numpy().sum(1), rtol=1e-5)


def nvcc_compiles(src: str) -> None:
  """nvcc takes the kernel (where nvcc is installed; the rendering was checked already)."""
  try: nvcc = cuda.find_nvcc()
  except CompileError: return
  import tempfile
  from pathlib import Path
  from renderers.cuda import renderer
  with tempfile.TemporaryDirectory() as d:
    cu, out = Path(d) / "k.cu", Path(d) / "k.cubin"
    cu.write_text(renderer.source([src]))
    cuda._run_nvcc(nvcc, "sm_90", cu, out)


# ---- sizes that cannot be ----

def test_a_buffer_larger_than_the_machine_is_a_memory_error_before_compiling(on_cpu):
  from runtime import realize as rr
  compiled = len(rr._kernels)
  total = get_device("CPU").memory_bytes
  n = total // 4 + 1                         # float32: one element more than the machine's memory
  with pytest.raises(MemoryError, match=rf"cannot allocate a buffer of shape \({n},\) and dtype float32 "
                                        rf"\(.* {4 * n} bytes\) on CPU: the device has .* of memory in all"):
    (Tensor.zeros(n) + 1).numpy()
  assert len(rr._kernels) == compiled        # nothing was compiled


def test_the_issues_four_tib_zeros():
  if get_device("CPU").memory_bytes >= 1 << 42: pytest.skip("this machine holds 4 TiB")
  with pytest.raises(MemoryError, match=r"shape \(1099511627776,\) and dtype float32 \(4.0 TiB, 4398046511104 bytes\)"):
    Tensor.zeros(1 << 40).numpy()


def test_a_size_past_64_bits_is_a_value_error():
  with pytest.raises(ValueError, match=r"shape \(4611686018427387904,\) and dtype float32 .* does not fit in 64 bits"):
    Tensor.zeros(2**62).numpy()   # 2**64 bytes
  with pytest.raises(ValueError, match=r"Tensor.zeros: shape \(18446744073709551616,\) has 18446744073709551616 elements"):
    Tensor.zeros(2**64)
  with pytest.raises(ValueError, match=r"expand of a tensor of shape \(4294967296, 1\): .* more than a 64-bit index"):
    Tensor.zeros(2**32, 1).expand(2**32, 2**32)
  with pytest.raises(ValueError, match=r"pad .* more than a 64-bit index"):
    Tensor.zeros(2**62).pad(((0, 2**62),))
  with pytest.raises(ValueError, match=r"arange\(0, 18446744073709551616, 1\): .* more than a 64-bit index"):
    Tensor.arange(2**64)
  with pytest.raises(ValueError, match=r"Buffer of 2305843009213693952 float64 elements: .* do not fit in 64 bits"):
    Buffer("CPU", 2**61, dtypes.float64)


def test_a_broadcast_error_names_each_operand_once():
  a, b = Tensor.ones(3, 4), Tensor.ones(4, 3)
  with pytest.raises(ValueError, match=r"^shapes \(3, 4\) and \(4, 3\) cannot be broadcast together$"): a + b
  with pytest.raises(ValueError, match=r"^shapes \(4, 3\) and \(3, 4\) cannot be broadcast together$"): 1 - b * a
  with pytest.raises(ValueError, match=r"^shapes \(3, 4\) and \(3, 4\) and \(4, 3\) cannot be broadcast together$"):
    (a > 0).where(a, b)   # condition, x, y
