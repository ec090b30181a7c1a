"""opt_vector: the vector loop part becomes the lanes of vector values; the C renderer writes gcc vector types."""
import numpy as np
from numpy.testing import assert_allclose
from rewrite import Ops
from tensor import Tensor
from rules.opt import Opt, OptKind
from runtime.device import get_device
from tests.opt_helpers import lowered, run_with, loops
import pytest

pytestmark = pytest.mark.usefixtures("on_cpu")  # the CPU's vocabulary: on the CPU also in a DEVICE=CUDA run

rng = np.random.default_rng(2)
a, b = rng.standard_normal((8, 32), dtype=np.float32), rng.standard_normal((32, 16), dtype=np.float32)
V = lambda axis, n=8: Opt(OptKind.VECTOR, axis, n)


def vector_ops(linear, op): return [u for u in linear.src if u.op is op and u.dtype.count > 1]


def test_elementwise_lanes_are_vector_loads_math_and_stores():
  t = Tensor(a) * 2 + 1
  linear, _ = lowered(t, V(1))
  assert [n for n, _ in loops(linear)] == [8, 4]
  assert len(vector_ops(linear, Ops.LOAD)) == 1 and not any(u.op is Ops.STORE and u.src[1].dtype.count == 1 for u in linear.src)
  assert_allclose(run_with(t, V(1)), a * 2 + 1)


def test_matmul_lanes_along_columns_accumulate_vectors_and_broadcast_a():
  t = Tensor(a) @ Tensor(b)
  linear, _ = lowered(t, V(1))
  assert [u.dtype.count for u in linear.src if u.op is Ops.DEFINE_ACC] == [8]
  assert any(u.op is Ops.VECTORIZE and len(u.src) == 1 for u in linear.src)   # A[i, k] broadcast to all lanes
  assert_allclose(run_with(t, V(1)), a @ b, rtol=1e-5, atol=1e-5)


def test_lanes_along_a_reduction_add_up_at_the_end():
  t = Tensor(a).sum(axis=1)
  linear, _ = lowered(t, V(1))
  assert [u.dtype.count for u in linear.src if u.op is Ops.DEFINE_ACC] == [8]
  assert sum(u.op is Ops.GEP for u in linear.src) == 8
  assert_allclose(run_with(t, V(1)), a.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_strided_lanes_gather_and_scatter():
  t = Tensor(a).permute(1, 0) + 0.5   # lanes along the output's rows read a column of a
  linear, _ = lowered(t, V(1))
  assert any(u.op is Ops.VECTORIZE and len(u.src) == 8 for u in linear.src)
  assert_allclose(run_with(t, V(1)), a.T + 0.5)


def test_ops_without_a_vector_form_run_lane_by_lane():
  t = (Tensor(a) * 2).maximum(0.0).sqrt()
  linear, _ = lowered(t, V(1))
  # the product is one 8-lane vector op; sqrt has no vector form: each lane taken out (GEP), sqrt'd alone, put back
  assert any(u.op is Ops.MUL and u.dtype.count == 8 for u in linear.src)
  assert sum(u.op is Ops.SQRT and u.dtype.count == 1 for u in linear.src) == 8 == sum(u.op is Ops.GEP for u in linear.src)
  assert_allclose(run_with(t, V(1)), np.sqrt(np.maximum(a * 2, 0)), rtol=1e-5)


@pytest.mark.parametrize("lanes", [4, 8, 16])
def test_exp_in_vector_lanes_gives_the_scalar_exps_bits(lanes):
  # g_exp2f_x<n> does g_exp2f's operations in the same order: every lane the same bits as the scalar path, over
  # the whole range (underflow, overflow, infinities, NaN, -0.0)
  x = np.concatenate([np.linspace(-160, 140, 4096 - 16, dtype=np.float32),
                      np.array([0, -0.0, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 88.7, -87.3, 127.99, 128, -149.5, -126,
                                0.5, -0.5, 1], dtype=np.float32)]).reshape(-1, 16)
  t = Tensor(x).exp2()
  linear, _ = lowered(t, V(1, lanes))
  assert vector_ops(linear, Ops.EXP2) and not any(u.op is Ops.GEP for u in linear.src)
  vector, scalar = run_with(t, V(1, lanes)), run_with(t)
  np.testing.assert_array_equal(vector.view(np.int32), scalar.view(np.int32))
  with np.errstate(over="ignore"): assert_allclose(vector, np.exp2(x), rtol=3e-7, atol=1e-44)   # (subnormals: 2^-149 steps)


def test_masked_loads_of_padding_keep_a_validity_per_lane():
  # a 3x3 window sum over a padded view (conv2d itself stores its padded input first)
  x = rng.standard_normal((1, 2, 8, 8), dtype=np.float32)
  t = Tensor(x).pad(((0, 0), (0, 0), (1, 1), (1, 1))).avg_pool2d(3, 1)
  linear, plan = lowered(t, V(2))
  assert any(u.op is Ops.LOAD and u.dtype.count == 8 and len(u.src) == 9 for u in linear.src)
  from numpy.lib.stride_tricks import sliding_window_view
  want = sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), (3, 3), axis=(2, 3)).mean((4, 5))
  assert_allclose(run_with(t, V(2)), want, rtol=1e-4, atol=1e-4)


def test_a_products_relu_epilogue_stays_in_vector_registers():
  # the linear layer's epilogue (bias, relu) on the register tile: a vector compare and a vector select per
  # accumulator, no lane taken out (a scalar epilogue made gcc spill the tile's accumulators)
  x, w, bias = a, rng.standard_normal((16, 32), dtype=np.float32), rng.standard_normal(16, dtype=np.float32)
  t = Tensor(x).linear(Tensor(w), Tensor(bias)).relu()
  linear, plan = lowered(t)
  assert any(o.kind is OptKind.VECTOR for o in plan.opts)
  assert vector_ops(linear, Ops.CMPLT) and vector_ops(linear, Ops.WHERE) and not any(u.op is Ops.GEP for u in linear.src)
  assert all(u.dtype.scalar.name == "bool" for u in vector_ops(linear, Ops.CMPLT))
  source = render(linear)
  assert "boolx16" in source or "boolx8" in source
  assert_allclose(run_with(t, *plan.opts), np.maximum(x @ w.T + bias, 0), rtol=1e-5, atol=1e-5)


def test_vector_compares_and_selects_keep_nan_and_broadcast_conditions():
  x = a.copy()
  x[0, :3] = [np.nan, -np.inf, np.inf]
  # maximum: NaN on either side wins (a compare, an isnan (x != x) and two selects, all in lanes)
  t = Tensor(x).maximum(Tensor(x[::-1].copy()) * 0.5)
  linear, _ = lowered(t, V(1))
  assert vector_ops(linear, Ops.CMPNE) and len(vector_ops(linear, Ops.WHERE)) == 2
  assert_allclose(run_with(t, V(1)), np.maximum(x, x[::-1] * 0.5))
  # a condition that does not depend on the lanes (one per row) is broadcast to a mask; int32 lanes select too
  rows = Tensor(np.arange(8, dtype=np.int32).reshape(8, 1))
  t = (rows < 3).where(Tensor(x), -1.0)
  assert_allclose(run_with(t, V(1)), np.where(np.arange(8)[:, None] < 3, x, -1.0))
  i = rng.integers(-5, 5, (8, 32)).astype(np.int32)
  t = (Tensor(i) < 0).where(Tensor(i) * 2, Tensor(i))
  linear, _ = lowered(t, V(1))
  assert vector_ops(linear, Ops.WHERE)
  np.testing.assert_array_equal(run_with(t, V(1)), np.where(i < 0, i * 2, i))


def test_a_mask_read_lane_by_lane_is_a_bool_again():
  # sqrt has no vector form: it reads lanes of the selected vector; a compare's mask cast to float reads its lanes as 0/1
  t = (Tensor(a) < 0).where(-Tensor(a), 0.0).sqrt() + (Tensor(a) < 0).cast("float32")
  assert_allclose(run_with(t, V(1)), np.sqrt(np.where(a < 0, -a, 0)) + (a < 0), rtol=1e-6)


def test_a_gelu_epilogue_runs_in_vector_lanes():
  x, w, bias = a, rng.standard_normal((16, 32), dtype=np.float32), rng.standard_normal(16, dtype=np.float32)
  t = Tensor(x).linear(Tensor(w), Tensor(bias)).gelu()
  linear, plan = lowered(t)
  assert vector_ops(linear, Ops.EXP2) and vector_ops(linear, Ops.RECIP) and not any(u.op is Ops.GEP for u in linear.src)
  assert "g_exp2f_x" in render(linear)
  y = x @ w.T + bias
  assert_allclose(run_with(t, *plan.opts), 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3))), rtol=1e-5, atol=1e-6)


def render(linear) -> str:
  return get_device("CPU").renderer.render("k", linear)
