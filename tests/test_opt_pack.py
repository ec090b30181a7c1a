"""opt_pack: loads shared by a loop's iterations read a packed local copy, filled before the loop."""
import numpy as np
from numpy.testing import assert_allclose
from rewrite import Ops
from tensor import Tensor
from rules.opt import Opt, OptKind
from tests.opt_helpers import lowered, run_with, loops
import pytest

pytestmark = pytest.mark.usefixtures("on_cpu")  # the CPU's vocabulary: on the CPU also in a DEVICE=CUDA run

rng = np.random.default_rng(4)
a, b = rng.standard_normal((8, 16), dtype=np.float32), rng.standard_normal((16, 24), dtype=np.float32)
plan = (Opt(OptKind.UPCAST, 0, 2), Opt(OptKind.INTERCHANGE, 1), Opt(OptKind.PACK, 0))


def test_the_b_panel_of_a_matmul_is_packed_once_per_column():
  t = Tensor(a) @ Tensor(b)
  linear, _ = lowered(t, *plan)
  # columns (outermost), the fill loop over k, then the rows, each with its reduction over k
  assert [n for n, _ in loops(linear)] == [24, 16, 4, 16]
  local = [u for u in linear.src if u.op is Ops.DEFINE_LOCAL]
  assert len(local) == 1 and local[0].arg[1] == 16 and local[0].src[0].op is Ops.RANGE   # one per column: per thread
  fill = next(i for i, u in enumerate(linear.src) if u.op is Ops.STORE and u.src[0].src[0] is local[0])
  read = next(i for i, u in enumerate(linear.src) if u.op is Ops.LOAD and u.src[0].src[0].op is Ops.BARRIER)
  assert fill < read
  assert_allclose(run_with(t, *plan), a @ b, rtol=1e-5, atol=1e-5)


def test_pack_leaves_loads_that_depend_on_the_loop():
  t = Tensor(a) @ Tensor(b)
  linear, _ = lowered(t, *plan)
  assert sum(u.op is Ops.LOAD and u.src[0].src[0].op is Ops.DEFINE_GLOBAL and u.src[0].src[0].arg == 1 for u in linear.src) == 2


def test_a_bias_read_once_per_column_is_not_packed_but_the_panel_of_w_is():
  x, w, bias = a, b.T.copy(), rng.standard_normal(24, dtype=np.float32)
  t = Tensor(x).linear(Tensor(w), Tensor(bias))
  opts = (Opt(OptKind.VECTOR, 1, 8), *plan)
  linear, _ = lowered(t, *opts)
  assert sum(u.op is Ops.DEFINE_LOCAL for u in linear.src) == 1
  assert_allclose(run_with(t, *opts), x @ w.T + bias, rtol=1e-5, atol=1e-5)


def test_the_fill_of_a_packed_panel_stores_by_subscript_in_c():
  # x @ W.T: W's panel is filled transposed; by subscript gcc sees the array and vectorizes the fill into transposes
  x, w = rng.standard_normal((32, 64), dtype=np.float32), rng.standard_normal((64, 64), dtype=np.float32)
  t = Tensor(x) @ Tensor(w).T
  source = t.kernel_sources()[0]
  locals_ = [line.split()[1].split("[")[0] for line in source.splitlines() if line.strip().startswith("float local")]
  assert locals_ and all(f"{name}[" in source.replace(f"float {name}[", "") for name in locals_)
  assert not any(f"*({name}+" in source for name in locals_)
  assert_allclose(t.numpy(), x @ w.T, rtol=1e-5, atol=1e-5)
