"""bfloat16 end to end: made from float data (rounded to nearest even), read back as float32, computed like torch
(each operation in float32, rounded back to bfloat16), rendered for C (a struct of its bits) and CUDA (__nv_bfloat16)."""
import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from rewrite import dtypes
from rewrite.dtypes import bf16_bits, bf16_to_float32, bf16_round
from tensor import Tensor

# bfloat16 keeps 8 significant bits: one rounding is within 2^-8 relative (half an ulp is 2^-9)
ULP = 2.0 ** -8


def bf16(x) -> np.ndarray:
  """The float32 values of x rounded to bfloat16 (the host's reference conversion)."""
  return bf16_to_float32(bf16_bits(x))


def test_host_conversion_rounds_to_nearest_even_and_keeps_specials():
  # 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even one (1); just above rounds up
  x = np.array([1.0, 1 + 2**-8, 1 + 2**-8 + 2**-20, 1 + 3 * 2**-8, -2.5, 0.0, -0.0, np.inf, -np.inf, 3.4e38, 1e-40], np.float32)
  got = bf16(x)
  assert got[:7].tolist() == [1.0, 1.0, 1 + 2**-7, 1 + 2**-6, -2.5, 0.0, 0.0] and np.signbit(got[6])
  assert got[7] == np.inf and got[8] == -np.inf
  assert got[9] == np.inf                       # past bfloat16's largest finite value (about 3.39e38) rounds to inf
  assert got[10] != 0 and abs(got[10] - np.float32(1e-40)) <= 2.0 ** -134   # a subnormal: half its ulp of 2^-133
  nan = bf16_bits(np.array([np.nan, -np.nan], np.float32))
  assert np.isnan(bf16_to_float32(nan)).all()
  assert bf16_round(3.14159) == 3.140625


def test_round_trip_of_values_and_bits():
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((5, 7)) * 10.0 ** rng.integers(-20, 20, (5, 7))).astype(np.float32)
  t = Tensor(x, dtype=dtypes.bfloat16)
  assert t.dtype is dtypes.bfloat16 and t.numpy().dtype == np.float32
  assert_array_equal(t.numpy(), bf16(x))
  assert_array_equal(t.bf16_bits(), bf16_bits(x))
  back = Tensor.from_bf16_bits(t.bf16_bits())
  assert back.dtype is dtypes.bfloat16 and (back.bf16_bits() == t.bf16_bits()).all()
  # a bfloat16 value is exactly a float32: the round trip through float32 changes nothing
  assert_array_equal(t.float().bfloat16().bf16_bits(), t.bf16_bits())
  assert_array_equal(Tensor(bf16(x)).cast("bfloat16").bf16_bits(), t.bf16_bits())


def test_creation_and_constants_hold_rounded_values():
  assert Tensor.full((2,), 1.1, dtype=dtypes.bfloat16).float().tolist() == [bf16_round(1.1)] * 2
  assert Tensor([1.1, 2], dtype="bfloat16").numpy().tolist() == [bf16_round(1.1), 2.0]
  assert Tensor.ones(3, dtype=dtypes.bfloat16).numpy().tolist() == [1.0, 1.0, 1.0]
  u = Tensor.rand(1000, seed=3, dtype=dtypes.bfloat16).numpy()
  assert ((0 <= u) & (u < 1)).all() and len(np.unique(u)) > 100


def test_promotion_like_torch():
  b, h, f = (Tensor.ones(2, dtype=d) for d in (dtypes.bfloat16, dtypes.float16, dtypes.float32))
  i = Tensor([1, 2])
  assert (b + h).dtype is dtypes.float32     # neither 16-bit float holds the other's values
  assert (b + f).dtype is dtypes.float32
  assert (b + i).dtype is dtypes.bfloat16 and (b * 2.5).dtype is dtypes.bfloat16 and (i + b).dtype is dtypes.bfloat16
  assert (b < 1).dtype is dtypes.bool and b.sum().dtype is dtypes.bfloat16


@pytest.mark.parametrize("graft, reference", [
  (lambda a, b: a + b, lambda a, b: bf16(a + b)),
  (lambda a, b: a * b, lambda a, b: bf16(a * b)),
  (lambda a, b: a / b, lambda a, b: bf16(a / b)),
  (lambda a, b: a * 3 - b, lambda a, b: bf16(bf16(a * 3) - b)),   # rounded after each operation, as torch does
  (lambda a, b: a.maximum(b), np.maximum),
  (lambda a, b: (a < b).where(a, b), lambda a, b: np.where(a < b, a, b)),
], ids=["add", "mul", "div", "mul-sub", "maximum", "where"])
def test_arithmetic_rounds_each_operation_like_torch(graft, reference):
  rng = np.random.default_rng(1)
  x, y = bf16(rng.standard_normal(300).astype(np.float32)), bf16(rng.standard_normal(300).astype(np.float32) + 3)
  got = graft(Tensor(x, dtype="bfloat16"), Tensor(y, dtype="bfloat16"))
  assert got.dtype is dtypes.bfloat16
  assert_array_equal(got.numpy(), reference(x, y))


def test_math_reductions_and_products_against_float32():
  rng = np.random.default_rng(2)
  x = bf16(rng.standard_normal((16, 64)).astype(np.float32))
  w = bf16(rng.standard_normal((64, 8)).astype(np.float32))
  t, tw = Tensor(x, dtype="bfloat16"), Tensor(w, dtype="bfloat16")
  assert_allclose(t.exp().numpy(), np.exp(x), rtol=ULP)
  assert_allclose(t.sigmoid().numpy(), 1 / (1 + np.exp(-x)), rtol=ULP, atol=1e-6)
  # sums and products add up in float32 and round once: within one bfloat16 rounding of float32's result
  assert_allclose(t.sum(1).numpy(), x.sum(1), rtol=ULP, atol=ULP * np.abs(x).sum(1).max() * 2 ** -7)
  assert_array_equal(t.max(1).numpy(), x.max(1))
  assert_array_equal(t.min(0).numpy(), x.min(0))
  assert_array_equal(t.argmax(1).numpy(), x.argmax(1))
  out = t @ tw
  assert out.dtype is dtypes.bfloat16
  assert_allclose(out.numpy(), x @ w, rtol=ULP, atol=ULP * (np.abs(x) @ np.abs(w)).max())
  assert (t @ tw.float()).dtype is dtypes.float32


def test_casts_to_and_from_other_dtypes_go_through_float32():
  x = np.array([-3.7, 0.49, 2.5, 300.2], np.float32)
  t = Tensor(x, dtype="bfloat16")
  assert t.int().tolist() == [int(v) for v in bf16(x)]
  assert t.half().numpy().tolist() == bf16(x).astype(np.float16).tolist()
  assert Tensor([7, -2, 1000001]).cast("bfloat16").numpy().tolist() == bf16(np.array([7, -2, 1000001], np.float32)).tolist()
  assert Tensor([True, False]).cast("bfloat16").tolist() == [1.0, 0.0]


def test_assign_rounds_float_arrays():
  t = Tensor.zeros(3, dtype=dtypes.bfloat16).realize()
  t.assign(np.array([1.1, 2.0, -0.3], np.float32))
  assert_array_equal(t.numpy(), bf16(np.array([1.1, 2.0, -0.3], np.float32)))


def test_c_renders_bf16_as_bits_and_converts_explicitly():
  a = Tensor(np.ones(8, np.float32), dtype="bfloat16")
  (src,) = ((a * 2).pad(((1, 1),)) + 0).kernel_sources(device="CPU")
  assert "g_bf16" in src and "g_float_to_bf16(" in src and "g_bf16_to_float(" in src
  (cuda,) = (a * 2).kernel_sources(device="CUDA")
  assert "__nv_bfloat16" in cuda and "__float2bfloat16_rn(" in cuda and "__bfloat162float(" in cuda


def test_bf16_arithmetic_reaching_a_renderer_is_a_clear_error():
  from rewrite import UOp, Ops
  from renderers.cstyle import RenderContext, cstyle_rules
  from renderers.c import C
  add = UOp(Ops.ADD, dtypes.bfloat16, (UOp.const(dtypes.bfloat16, 1.0), UOp.const(dtypes.bfloat16, 2.0)))
  with pytest.raises(TypeError, match="bfloat16 arithmetic is computed in float32"): cstyle_rules.rewrite(add, RenderContext(C))


def test_cuda_kernels_of_bf16_compile_for_sm_90(tmp_path):
  from runtime import cuda
  from runtime.device import CompileError
  from renderers.cuda import renderer
  try: nvcc = cuda.find_nvcc()
  except CompileError: pytest.skip("nvcc not found: CUDA kernels not compiled")
  rng = np.random.default_rng(3)
  x = Tensor(rng.standard_normal((32, 48)).astype(np.float32), dtype="bfloat16")
  w = Tensor(rng.standard_normal((48, 16)).astype(np.float32), dtype="bfloat16")
  programs = [x * 2 + 1, x.exp(), x.sum(1), x.max(0), x @ w, x.softmax(1), x.float() - x, x.pad(((1, 0), (0, 2))),
              x.half() + x, (x > 0).where(x, 0.5)]
  kernels = list(dict.fromkeys(s for p in programs for s in p.kernel_sources(device="CUDA")))
  assert any("__nv_bfloat16" in k for k in kernels)
  src, out = tmp_path / "bf16.cu", tmp_path / "bf16.cubin"
  src.write_text(renderer.source(kernels))   # one translation unit, as the CUDA device compiles a realize
  cuda._run_nvcc(nvcc, "sm_90", src, out)    # CompileError with nvcc's message fails the test
  assert out.stat().st_size > 0
