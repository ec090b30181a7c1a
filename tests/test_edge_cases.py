"""Corners where a compiler quietly goes wrong: wrapping casts, NaN in a vectorized max, -0.0, empty axes, a rule
set changed between two calls, a compile that fails half way."""
import numpy as np
import pytest
from rewrite import UPat, PatternMatcher, Ops, UOp
from rules.pipeline import pipeline
from tensor import Tensor
import runtime.realize as rr


def test_a_narrowing_cast_wraps_and_later_folds_know_it():
  a = np.arange(256).astype(np.int8)  # numpy wraps 128..255 to negatives, as C does
  assert (Tensor.arange(256).cast("int8") < 0).numpy().sum() == (a < 0).sum() == 128
  b = np.arange(200).astype(np.int8)
  assert (Tensor.arange(200).cast("int8") % 7).cast("int32").sum().numpy() == (b % 7).astype(np.int32).sum()
  assert (Tensor.arange(200).cast("int8") // 2).cast("int32").sum().numpy() == (b // 2).astype(np.int32).sum()


@pytest.mark.parametrize("where", [0, 1, 37, 299])
def test_max_and_min_see_a_nan_anywhere_in_a_long_row(where):
  x = np.random.default_rng(0).standard_normal((6, 300)).astype(np.float32)
  x[2, where] = np.nan
  np.testing.assert_array_equal(Tensor(x).max(axis=1).numpy(), x.max(axis=1))
  np.testing.assert_array_equal(Tensor(x).min(axis=1).numpy(), x.min(axis=1))
  assert np.isnan(Tensor(x).max().numpy())


def test_adding_zero_to_negative_zero_gives_positive_zero():
  out = (Tensor(np.array([-0.0], np.float32)) + 0).numpy()
  assert not np.signbit(out[0])


def test_empty_axes():
  empty = np.zeros((0, 3), np.float32)
  np.testing.assert_array_equal(Tensor(empty).sum(axis=0).numpy(), empty.sum(axis=0))
  assert Tensor(np.ones((3, 4, 5), np.float32))[2:2].sum(0).numpy().shape == (4, 5)
  for reduce in (lambda t: t.max(0), lambda t: t.min(0), lambda t: t.argmax(0)):
    with pytest.raises(ValueError, match="empty axis"):
      reduce(Tensor(empty))


def test_a_rule_added_later_applies_to_kernels_compiled_before():
  x = np.arange(6, dtype=np.float32)
  assert np.array_equal((Tensor(x) * 3.0).numpy(), x * 3)
  mul_to_add = PatternMatcher([(UPat(Ops.STORE, src=(UPat.var("i"), UPat(Ops.MUL, name="m"))),
                                lambda i, m: UOp(Ops.STORE, src=(i, m.src[0] + m.src[1])))], name="mul_to_add")
  pipeline.insert("symbolic", mul_to_add)
  try: assert np.array_equal((Tensor(x) * 3.0).numpy(), x + 3)
  finally: pipeline.remove("mul_to_add")
  assert np.array_equal((Tensor(x) * 3.0).numpy(), x * 3)


def test_a_compile_that_fails_half_way_leaves_no_broken_kernel(monkeypatch):
  x = Tensor(np.ones((4, 4), np.float32))
  real_compile, calls = rr._compile, []
  def second_fails(*args):
    calls.append(args)
    if len(calls) == 2: raise KeyboardInterrupt("stopped half way")
    return real_compile(*args)
  monkeypatch.setattr(rr, "_compile", second_fails)
  with pytest.raises(KeyboardInterrupt):
    Tensor.realize_all(x.exp2() * 5.5, x.sum(axis=0) + 4.25)
  monkeypatch.setattr(rr, "_compile", real_compile)
  a, b = x.exp2() * 5.5, x.sum(axis=0) + 4.25
  Tensor.realize_all(a, b)
  np.testing.assert_allclose(a.numpy(), np.full((4, 4), 11.0))
  np.testing.assert_allclose(b.numpy(), np.full(4, 8.25))
