"""Library calls in the host program (runtime/extern.py): the gemm family (sgemm, batched, half) from OpenBLAS
(scipy-openblas32) on the CPU and cuBLAS on CUDA (checked here against its header and library where they are
installed; the GPU tests skip without a GPU)."""
import glob, math, os, subprocess, sys
import numpy as np
import pytest
import cffi
from tensor import Tensor, dtypes
from rewrite import UOp, Ops, graph_rewrite
from rules.pipeline import schedule, Run
from rules.host import HostContext, host_rules
from runtime import extern, realize as rr
from runtime.realize import last_program

rng = np.random.default_rng(0)
a, b = rng.standard_normal((64, 40)).astype(np.float32), rng.standard_normal((40, 48)).astype(np.float32)
has_openblas = extern.routine("CPU", "sgemm") is not None
needs_openblas = pytest.mark.skipif(not has_openblas, reason="scipy-openblas32 is not installed (pip install scipy-openblas32)")


def normal(*shape, dtype=np.float32) -> np.ndarray: return rng.standard_normal(shape).astype(dtype)


# ---- which kernels the host stage makes library calls of (no library and no GPU needed: tensors on the CPU,
# scheduled as for a GPU, on a device said to offer cuBLAS's routines) ----
def host_steps(out: Tensor, routines=extern.CUDA_ROUTINES, gpu: bool = True) -> tuple[UOp, ...]:
  """The host program's steps for `out` on a device offering `routines`, scheduled as for a GPU (loops onto a grid)
  or, `gpu` False, as for the CPU."""
  kernels, realized = schedule([out.uop], ["CPU"], Run("CPU", parallel=not gpu, device_loops=gpu))
  ctx = HostContext(frozenset({realized[0].src[0]}), externs=lambda device: routines, extern_mode="on")
  return graph_rewrite(UOp(Ops.SINK, src=tuple(kernels), arg="steps"), host_rules, ctx, name="host").src


def library_calls(out: Tensor, routines=extern.CUDA_ROUTINES, gpu: bool = True) -> list[str]:
  """Each step for `out`: an EXTERN as its listing names it, a generated kernel as "call"."""
  return [str(s.arg) if s.op is Ops.EXTERN else "call" for s in host_steps(out, routines, gpu)]


T = lambda *shape, dtype=np.float32: Tensor(normal(*shape, dtype=dtype))
H = lambda *shape: T(*shape, dtype=np.float16)


@pytest.mark.parametrize("make, expect", [
  (lambda: T(4, 8, 6) @ T(4, 6, 5), "sgemm_batched 4x8x5x6 (A, B)"),
  (lambda: T(4, 8, 6) @ T(4, 5, 6).transpose(-1, -2), "sgemm_batched 4x8x5x6 (A, B^T)"),
  (lambda: T(4, 6, 8).transpose(-1, -2) @ T(4, 6, 5), "sgemm_batched 4x8x5x6 (A^T, B)"),
  (lambda: T(4, 6, 8).transpose(-1, -2) @ T(4, 5, 6).transpose(-1, -2), "sgemm_batched 4x8x5x6 (A^T, B^T)"),
  (lambda: T(2, 3, 8, 6) @ T(2, 3, 6, 5), "sgemm_batched 6x8x5x6 (A, B)"),               # batch axes merged
  (lambda: T(8, 6) @ T(4, 6, 5), "sgemm_batched 4x8x5x6 (A, B; A broadcast)"),
  (lambda: T(4, 6, 8).transpose(-1, -2) @ T(6, 5), "sgemm_batched 4x8x5x6 (A^T, B; B broadcast)"),
  (lambda: T(4, 8, 6) @ T(6, 5), "sgemm 32x5x6 (A, B)"),          # B shared, A's rows follow on: one product
  (lambda: T(1, 8, 6) @ T(6, 5), "sgemm 8x5x6 (A, B)"),
  (lambda: H(8, 6) @ H(6, 5), "hgemm 8x5x6 (A, B)"),
  (lambda: H(8, 6).matmul(H(6, 5), dtype=dtypes.float32), "hgemm 8x5x6 (A, B) -> float32"),
  (lambda: H(4, 8, 6) @ H(4, 5, 6).transpose(-1, -2), "hgemm_batched 4x8x5x6 (A, B^T)"),
])
def test_a_batch_of_products_or_a_half_product_becomes_one_library_call(on_cpu, make, expect):
  assert library_calls(make()) == [expect]


def test_attention_makes_both_its_products_strided_batched_calls(on_cpu):
  q, k, v = T(4, 32, 16), T(4, 32, 16), T(4, 32, 16)
  calls = library_calls((q @ k.transpose(-1, -2) / math.sqrt(16)).softmax(-1) @ v)
  # the scale is not in the product's kernel (the softmax's kernels divide as they read the scores)
  assert calls[0] == "sgemm_batched 4x32x32x16 (A, B^T)" and calls[-1] == "sgemm_batched 4x32x16x32 (A, B)"
  assert set(calls[1:-1]) == {"call"}


@pytest.mark.parametrize("make", [
  lambda: (T(8, 6) @ T(6, 5)).relu(),                    # work fused after the product
  lambda: T(8, 6) @ T(6, 5) * 2,
  lambda: T(3, 1, 8, 6) @ T(5, 6, 5),                    # batch axes no single stride walks
  lambda: T(8, 12)[:, ::2] @ T(6, 5),                    # a layout BLAS cannot read (every other column)
  lambda: T(6) @ T(6, 5),                                # a row times a matrix: not a matrix product
  lambda: T(8, 6) @ H(6, 5),                             # mixed dtypes: no variant
  lambda: T(8, 6).cast(dtypes.float16) @ H(6, 5),        # an operand computed in the kernel
])
def test_kernels_that_are_not_exactly_a_product_stay_generated(on_cpu, make):
  assert library_calls(make()) == ["call"]


def test_a_half_product_is_generated_code_on_the_cpu(on_cpu):
  assert library_calls(H(8, 6) @ H(6, 5), extern.CPU_ROUTINES, gpu=False) == ["call"]
  assert library_calls(T(4, 8, 6) @ T(4, 6, 5), extern.CPU_ROUTINES, gpu=False) == ["sgemm_batched 4x8x5x6 (A, B)"]


# ---- OpenBLAS on the CPU ----
@needs_openblas
@pytest.mark.parametrize("make", [
  lambda: (Tensor(a) @ Tensor(b), "(A, B)"),
  lambda: (Tensor(a) @ Tensor(b.T.copy()).T, "(A, B^T)"),
  lambda: (Tensor(a.T.copy()).T @ Tensor(b), "(A^T, B)"),
  lambda: (Tensor(a.T.copy()).T @ Tensor(b.T.copy()).T, "(A^T, B^T)"),
])
def test_graft_extern_1_runs_sgemm_and_matches_numpy(monkeypatch, make):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  out, layout = make()
  np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)
  assert f"extern sgemm 64x48x40 {layout}  out0 <- in0, in1" in str(last_program())


@needs_openblas
def test_graft_extern_0_runs_generated_code_with_the_same_result(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "0")
  out = (Tensor(a) @ Tensor(b)).numpy()
  assert "extern" not in str(last_program())
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), out, rtol=1e-4, atol=1e-4)


@needs_openblas
def test_a_matmul_fused_with_more_work_stays_generated(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  out = (Tensor(a) @ Tensor(b)).relu()
  np.testing.assert_allclose(out.numpy(), np.maximum(a @ b, 0), rtol=1e-4, atol=1e-4)
  assert "extern" not in str(last_program())


@needs_openblas
def test_a_matmul_between_other_kernels_takes_its_buffers_from_the_plan(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  x = (Tensor(a) * 2).contiguous()
  out = ((x @ Tensor(b)).contiguous() + 1).numpy()
  assert "extern sgemm" in str(last_program()) and "alloc" in str(last_program())
  np.testing.assert_allclose(out, (a * 2) @ b + 1, rtol=1e-4, atol=1e-4)


def operand(x: np.ndarray, transposed: bool, device: str) -> Tensor:
  """x as a tensor on `device`: its own buffer, or a transposed copy's viewed back (BLAS reads it transposed)."""
  return Tensor(np.swapaxes(x, -1, -2).copy(), device=device).transpose(-1, -2) if transposed else Tensor(x, device=device)


def product_operands(layout: str, sa: tuple, sb: tuple, device: str = "CPU", dtype=np.float32):
  x, y = normal(*sa, dtype=dtype), normal(*sb, dtype=dtype)
  return x, y, operand(x, "A^T" in layout, device), operand(y, "B^T" in layout, device)


LAYOUTS = ["(A, B)", "(A, B^T)", "(A^T, B)", "(A^T, B^T)"]
# (batch, m, k) @ (batch, k, n) in every layout, and with one operand shared by the batch
BATCHED = [(layout, (3, 24, 20), (3, 20, 16)) for layout in LAYOUTS] + [
  ("(A, B; A broadcast)", (24, 20), (3, 20, 16)), ("(A^T, B; B broadcast)", (3, 24, 20), (20, 16))]


@needs_openblas
@pytest.mark.parametrize("layout, sa, sb", BATCHED)
def test_a_batch_of_products_runs_as_one_openblas_call_and_matches_numpy(monkeypatch, on_cpu, layout, sa, sb):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  x, y, A, B = product_operands(layout, sa, sb)
  np.testing.assert_allclose((A @ B).numpy(), x @ y, rtol=1e-4, atol=1e-4)
  assert f"extern sgemm_batched 3x24x16x20 {layout}  out0 <- in0, in1" in str(last_program())


@needs_openblas
def test_without_a_strided_batch_routine_openblas_runs_one_sgemm_per_product(monkeypatch, on_cpu):
  # an older OpenBLAS exports no cblas_sgemm_batch_strided: the batch is a loop of sgemm calls
  with_batch_routine = extern._cpu_gemm
  monkeypatch.setattr(extern, "_cpu_gemm", lambda: with_batch_routine(batch_strided=False))
  assert extern.routine("CPU", "sgemm_batched") is not with_batch_routine()
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  for layout, sa, sb in BATCHED:
    x, y, A, B = product_operands(layout, sa, sb)
    np.testing.assert_allclose((A @ B).numpy(), x @ y, rtol=1e-4, atol=1e-4)
    assert "extern sgemm_batched" in str(last_program())


@needs_openblas
def test_attention_runs_its_two_products_as_library_calls(monkeypatch, on_cpu):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  q, k, v = normal(4, 32, 16), normal(4, 32, 16), normal(4, 32, 16)
  out = (Tensor(q) @ Tensor(k).transpose(-1, -2) / math.sqrt(16)).softmax(-1) @ Tensor(v)
  s = q @ k.transpose(0, 2, 1) / 4
  e = np.exp(s - s.max(-1, keepdims=True))
  np.testing.assert_allclose(out.numpy(), e / e.sum(-1, keepdims=True) @ v, rtol=1e-4, atol=1e-5)
  listing = str(last_program())
  assert "extern sgemm_batched 4x32x32x16 (A, B^T)  t0 <- in0, in1" in listing
  assert "extern sgemm_batched 4x32x16x32 (A, B)  out0 <- t" in listing


@needs_openblas
def test_a_batch_sharing_its_right_operand_is_one_product_of_all_rows(monkeypatch, on_cpu):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  x, w = normal(3, 24, 20), normal(20, 16)
  np.testing.assert_allclose((Tensor(x) @ Tensor(w)).numpy(), x @ w, rtol=1e-4, atol=1e-4)
  assert "extern sgemm 72x16x20 (A, B)  out0 <- in0, in1" in str(last_program())


@needs_openblas
def test_heads_written_back_between_a_sequences_rows_are_one_batched_call(monkeypatch, on_cpu):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  out, expect = heads_between_rows()
  np.testing.assert_allclose(out.numpy(), expect, rtol=1e-4, atol=1e-4)
  assert "extern sgemm_batched 4x32x16x32 (A, B)  out0 <- in0, in1" in str(last_program())


def test_without_the_package_there_is_no_routine_and_matmul_is_generated(monkeypatch, on_cpu):
  monkeypatch.setitem(sys.modules, "scipy_openblas32", None)  # import fails as if it were not installed
  extern._cpu_gemm.cache_clear()
  monkeypatch.setattr(rr, "_plans", {})   # as in a process without it: no program made with it
  try:
    assert extern.routines("CPU") == ()
    monkeypatch.setenv("GRAFT_EXTERN", "1")
    np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), a @ b, rtol=1e-4, atol=1e-4)
    assert "extern" not in str(last_program())
  finally:
    monkeypatch.undo()
    extern._cpu_gemm.cache_clear()


def test_a_bad_graft_extern_names_the_choices(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "yes")
  with pytest.raises(ValueError, match="GRAFT_EXTERN='yes'.*0.*1"): extern.mode()


# ---- cuBLAS: the declarations match the toolkit's header, and the library resolves them (no GPU needed) ----
def cublas_include() -> str | None:
  dirs = [os.environ.get("CUBLAS_INCLUDE", ""), *glob.glob("/usr/local/cuda*/include")]
  try:
    import nvidia   # NVIDIA's wheels: nvidia/cu13/include (CUDA 13), nvidia/cublas/include (CUDA 12)
    dirs += [os.path.join(p, sub, "include") for p in nvidia.__path__ for sub in ("cu13", "cublas")]
  except ImportError: pass
  return next((d for d in dirs if d and os.path.exists(os.path.join(d, "cublas_v2.h"))), None)


def test_cublas_gemm_declarations_match_the_header(tmp_path):
  inc = cublas_include()
  if inc is None: pytest.skip("no cublas_v2.h here (set CUBLAS_INCLUDE to the directory holding it)")
  cuda_inc = glob.glob("/usr/local/cuda*/include")
  # our cdef passes pointers as uintptr_t and enums as int (the same registers); the parameter order and the
  # enums' values must be the header's
  check = tmp_path / "check.c"
  check.write_text("#include <cublas_v2.h>\n"
                   "cublasStatus_t (*gemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,"
                   " const void *, cudaDataType, int, const void *, cudaDataType, int, const void *, void *, cudaDataType, int,"
                   " cublasComputeType_t, cublasGemmAlgo_t) = cublasGemmEx;\n"
                   "cublasStatus_t (*batched)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void *,"
                   " const void *, cudaDataType, int, long long int, const void *, cudaDataType, int, long long int, const void *,"
                   " void *, cudaDataType, int, long long int, int, cublasComputeType_t, cublasGemmAlgo_t) = cublasGemmStridedBatchedEx;\n"
                   "cublasStatus_t (*create)(cublasHandle_t *) = cublasCreate_v2;\n"
                   f"int ops[CUBLAS_OP_N == {extern.CUBLAS_OP_N} && CUBLAS_OP_T == {extern.CUBLAS_OP_T} ? 1 : -1];\n"
                   f"int types[CUDA_R_32F == {extern.CUDA_R_32F} && CUDA_R_16F == {extern.CUDA_R_16F} ? 1 : -1];\n"
                   f"int compute[CUBLAS_COMPUTE_32F == {extern.CUBLAS_COMPUTE_32F} && CUBLAS_GEMM_DEFAULT == {extern.CUBLAS_GEMM_DEFAULT} ? 1 : -1];\n")
  r = subprocess.run(["gcc", "-fsyntax-only", f"-I{inc}", *(f"-I{d}" for d in cuda_inc), str(check)], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]


def test_cublas_library_resolves_the_declared_functions():
  ffi = cffi.FFI()
  ffi.cdef(extern.CUBLAS_CDEF)
  if (lib := extern._open_cublas(ffi)) is None: pytest.skip(f"libcublas is not installed here (looked for {extern.cublas_candidates()})")
  assert lib.cublasGemmEx and lib.cublasGemmStridedBatchedEx and lib.cublasCreate_v2


@needs_openblas
def test_a_matmul_assigned_into_rows_of_a_tensor_writes_only_those_rows_with_sgemm(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  t0 = rng.standard_normal((100, 48)).astype(np.float32)
  t = Tensor(t0.copy())
  t[:64] = Tensor(a) @ Tensor(b)
  assert "extern sgemm" in str(last_program())
  expect = t0.copy(); expect[:64] = a @ b
  np.testing.assert_allclose(t.numpy(), expect, rtol=1e-4, atol=1e-4)
  t[36:] = Tensor(a) @ Tensor(b)   # at an offset in the buffer
  assert "extern sgemm" in str(last_program())
  expect[36:] = a @ b
  np.testing.assert_allclose(t.numpy(), expect, rtol=1e-4, atol=1e-4)


class ColumnMajorCublas:
  """A numpy model of what cuBLAS's cublasGemmEx and cublasGemmStridedBatchedEx compute, by their documentation
  (column-major matrices, leading dimensions, batch strides in elements, C = alpha op(A) op(B) + beta C with beta 0),
  over a byte array whose offsets stand for device addresses: it checks the arguments our calls pass (the operands
  swapped for the row-major product, the types, the strides) without a GPU."""
  TYPES = {extern.CUDA_R_32F: np.float32, extern.CUDA_R_16F: np.float16}

  def __init__(self, nbytes: int): self.memory = np.zeros(nbytes, np.uint8)

  def at(self, address: int, dtype, rows: int, cols: int, ld: int):
    """Indices (into the memory viewed as dtype) of the column-major rows x cols matrix at `address`."""
    size = np.dtype(dtype).itemsize
    assert address % size == 0 and ld >= rows, (address, ld, rows)
    return address // size + np.arange(rows)[:, None] + ld * np.arange(cols)[None, :]

  def op(self, address, dtype, trans, rows, cols, ld) -> np.ndarray:
    """op(X) (rows x cols) in float64, X stored column-major: X itself, or X^T read from a cols x rows matrix."""
    if trans == extern.CUBLAS_OP_T: return self.memory.view(dtype)[self.at(address, dtype, cols, rows, ld)].T.astype(np.float64)
    return self.memory.view(dtype)[self.at(address, dtype, rows, cols, ld)].astype(np.float64)

  def cublasGemmEx(self, handle, ta, tb, m, n, k, alpha, A, atype, lda, B, btype, ldb, beta, C, ctype, ldc, compute, algo):
    assert compute == extern.CUBLAS_COMPUTE_32F and algo == extern.CUBLAS_GEMM_DEFAULT and beta[0] == 0
    product = alpha[0] * (self.op(A, self.TYPES[atype], ta, m, k, lda) @ self.op(B, self.TYPES[btype], tb, k, n, ldb))
    self.memory.view(self.TYPES[ctype])[self.at(C, self.TYPES[ctype], m, n, ldc)] = product
    return 0

  def cublasGemmStridedBatchedEx(self, handle, ta, tb, m, n, k, alpha, A, atype, lda, stride_a, B, btype, ldb, stride_b,
                                 beta, C, ctype, ldc, stride_c, count, compute, algo):
    sa, sb, sc = (np.dtype(self.TYPES[t]).itemsize for t in (atype, btype, ctype))
    for i in range(count):
      self.cublasGemmEx(handle, ta, tb, m, n, k, alpha, A + sa * stride_a * i, atype, lda, B + sb * stride_b * i, btype, ldb,
                        beta, C + sc * stride_c * i, ctype, ldc, compute, algo)
    return 0


def product_case(layout: str, sa: tuple, sb: tuple, dtype=np.float32, out_dtype=dtypes.float32):
  """A product to run and what it must give: (A @ B in `layout`, on the CPU, its value in float64)."""
  x, y, A, B = product_operands(layout, sa, sb, "CPU", dtype)
  return A.matmul(B, dtype=out_dtype), x.astype(np.float64) @ y.astype(np.float64)


def heads_between_rows():
  """Attention's p @ v per head, written back as (sequence, heads x head size): a batch whose C rows are 64 apart
  (ldc 64) and whose products sit 16 apart (batch stride 16)."""
  p, v = normal(4, 32, 32), normal(32, 64)
  out = (Tensor(p) @ Tensor(v).reshape(32, 4, 16).permute(1, 0, 2)).permute(1, 0, 2).reshape(32, 64)
  return out, (p.astype(np.float64) @ v.reshape(32, 4, 16).transpose(1, 0, 2)).transpose(1, 0, 2).reshape(32, 64)


PRODUCT_CASES = [
  *(lambda layout=layout: product_case(layout, (24, 20), (20, 16)) for layout in LAYOUTS),
  *(lambda layout=layout, sa=sa, sb=sb: product_case(layout, sa, sb) for layout, sa, sb in BATCHED),
  lambda: product_case("(A, B)", (3, 24, 20), (20, 16)),      # one product of 72 rows
  heads_between_rows,
  *(lambda layout=layout, out=out: product_case(layout, (3, 24, 20), (3, 20, 16), np.float16, out)
    for layout in LAYOUTS[::3] for out in (dtypes.float16, dtypes.float32)),
  lambda: product_case("(A^T, B)", (24, 20), (20, 16), np.float16, dtypes.float16),
]


@pytest.mark.parametrize("case", PRODUCT_CASES)
def test_our_cublas_calls_compute_the_row_major_product_in_a_model_of_cublas(case):
  out, expect = case()
  [step] = host_steps(out)
  assert step.op is Ops.EXTERN
  addresses, end = [], 0   # each buffer of the step in the model's memory, 256-byte aligned like cudaMalloc's
  for b in step.src: addresses.append(end); end += -(-b.arg.size * b.dtype.itemsize // 256) * 256
  model = ColumnMajorCublas(end)
  for address, b in zip(addresses, step.src):
    if not isinstance(b.arg, rr.NewBuffer): model.memory[address:address + b.arg.size * b.dtype.itemsize] = b.arg.numpy().view(np.uint8)
  extern.cublas_gemm(model, "handle", [1.0], [0.0])(addresses, step.arg)
  c, at = step.src[step.arg.operands[0]], addresses[step.arg.operands[0]]
  got = model.memory[at:at + c.arg.size * c.dtype.itemsize].view(out.dtype.name).astype(np.float64)
  np.testing.assert_allclose(got, expect.reshape(-1), rtol=2 ** -10 if out.dtype is dtypes.float16 else 1e-6, atol=1e-3)


def cuda_gpu():
  from runtime.device import get_device
  from runtime.cuda import CUDAUnavailable
  try: return get_device("CUDA")
  except CUDAUnavailable as e: pytest.skip(f"no usable CUDA GPU here: {str(e).split(' (')[0]}")


def cublas(name: str):
  cuda_gpu()
  if extern.routine("CUDA", name) is None: pytest.skip(f"no libcublas found (looked for {extern.cublas_candidates()})")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cublas_sgemm_on_a_gpu_matches_numpy_in_every_layout(monkeypatch, layout):
  cublas("sgemm")
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  A, B = operand(a, "A^T" in layout, "CUDA"), operand(b, "B^T" in layout, "CUDA")
  t = Tensor(rng.standard_normal((100, 48)).astype(np.float32), device="CUDA")
  t[30:94] = A @ B   # at an offset of the output's buffer
  assert f"extern sgemm 64x48x40 {layout}" in str(last_program())
  np.testing.assert_allclose(t.numpy()[30:94], a @ b, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose((A @ B).numpy(), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout, sa, sb", BATCHED)
def test_cublas_strided_batched_sgemm_on_a_gpu_matches_numpy(monkeypatch, layout, sa, sb):
  cublas("sgemm_batched")
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  x, y, A, B = product_operands(layout, sa, sb, "CUDA")
  np.testing.assert_allclose((A @ B).numpy(), x @ y, rtol=1e-4, atol=1e-4)
  assert f"extern sgemm_batched 3x24x16x20 {layout}  out0 <- in0, in1" in str(last_program())


def half_reference(x: np.ndarray, y: np.ndarray) -> np.ndarray:
  """The product of float16 values summed exactly (float64), before any rounding to the output's dtype."""
  return x.astype(np.float64) @ y.astype(np.float64)


@pytest.mark.parametrize("layout, sa, sb, listed", [
  ("(A, B)", (64, 48), (48, 40), "hgemm 64x40x48 (A, B)"),
  ("(A^T, B^T)", (37, 45), (45, 29), "hgemm 37x29x45 (A^T, B^T)"),   # sizes no tensor-core tile divides
  ("(A, B^T)", (3, 64, 48), (3, 48, 40), "hgemm_batched 3x64x40x48 (A, B^T)"),
  ("(A^T, B)", (3, 37, 45), (45, 29), "hgemm_batched 3x37x29x45 (A^T, B; B broadcast)"),
])
@pytest.mark.parametrize("out_dtype", [dtypes.float16, dtypes.float32])
def test_cublas_half_gemm_on_a_gpu_matches_the_float32_sum_of_exact_products(monkeypatch, layout, sa, sb, listed, out_dtype):
  cublas("hgemm")
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  x, y, A, B = product_operands(layout, sa, sb, "CUDA", np.float16)
  out = A.matmul(B, dtype=out_dtype).numpy()
  assert out.dtype == out_dtype.name
  expect = half_reference(x, y)
  if out_dtype is dtypes.float16:   # one rounding to float16 at the end: within half an ulp of float16, plus the sum's
    np.testing.assert_allclose(out.astype(np.float64), expect, rtol=2 ** -10, atol=1e-3)
  else:                             # summed in float32
    np.testing.assert_allclose(out, expect, rtol=1e-4, atol=1e-3)
  assert f"extern {listed}" + ("" if out_dtype is dtypes.float16 else " -> float32") in str(last_program())


def test_attention_on_a_gpu_runs_both_products_through_cublas(monkeypatch):
  cublas("sgemm_batched")
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  q, k, v = normal(4, 64, 32), normal(4, 64, 32), normal(4, 64, 32)
  Q, K, V = (Tensor(x, device="CUDA") for x in (q, k, v))
  out = ((Q @ K.transpose(-1, -2) / math.sqrt(32)).softmax(-1) @ V).numpy()
  s = q @ k.transpose(0, 2, 1) / math.sqrt(32)
  e = np.exp(s - s.max(-1, keepdims=True))
  np.testing.assert_allclose(out, e / e.sum(-1, keepdims=True) @ v, rtol=1e-4, atol=1e-5)
  assert str(last_program()).count("extern sgemm_batched") == 2


@pytest.mark.skipif(extern.routine("CPU", "sgemm") is None, reason="scipy-openblas32 is not installed")
def test_debug_2_times_a_library_call_at_the_rate_of_its_products(monkeypatch, capsys, on_cpu):
  import re
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  monkeypatch.setenv("DEBUG", "2")
  rng = np.random.default_rng(3)
  a, b = rng.standard_normal((4, 96, 40), dtype=np.float32), rng.standard_normal((4, 40, 72), dtype=np.float32)
  np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), a @ b, rtol=1e-4, atol=1e-4)
  ms, rate = map(float, re.search(r"extern sgemm_batched via OpenBLAS.*?([\d.]+) ms +([\d.]+) GFLOP/s", capsys.readouterr().out).groups())
  assert rate == pytest.approx(2 * 4 * 96 * 72 * 40 / (ms * 1e-3) / 1e9, rel=0.05, abs=0.02)  # 2 x batch x m x n x k
