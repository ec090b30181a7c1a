"""Elementwise Tensor operations against numpy: arithmetic with broadcasting and scalars, dtype promotion, integer
division, powers, math functions, comparisons (NaN included), where, logic, and the errors of bad operands."""
import math
import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from rewrite import Ops, GroupOp
from helpers import realize_and_check as check_all
from tensor import Tensor, dtypes

rng = np.random.default_rng(0)
A = rng.standard_normal((4, 1)).astype(np.float32)          # broadcasts against B
B = (rng.standard_normal(5) + 3).astype(np.float32)         # positive, so it divides and roots safely
C = rng.standard_normal((5, 4)).astype(np.float32)          # used transposed: a non-contiguous view
S = np.float32(1.75)                                        # for 0-d tensors


def realize_and_check(pairs, rtol=1e-5, atol=1e-6):
  return check_all(pairs, rtol=rtol, atol=atol)


def test_arithmetic_broadcasts_like_numpy():
  a, b, ct, s = Tensor(A), Tensor(B), Tensor(C).T, Tensor(np.array(S))
  realize_and_check([
    (a + b, A + B), (a - b, A - B), (a * b, A * B), (a / b, A / B),
    (ct + b, C.T + B), (ct * a, C.T * A),
    (a + s, A + S), (s * s, S * S),
    (2 + a, 2 + A), (2 - a, 2 - A), (a * 3, A * 3), (3 / b, 3 / B), (a - 0.5, A - 0.5), (-a, -A),
    (+a, A), (abs(ct), np.abs(C.T)),
  ])


def test_integer_arithmetic_wraps_like_numpy():
  x = np.array([[-7, 0, 5], [1000000, -3, 9]], np.int32)
  u = np.array([0, 1, 200, 255], np.uint8)
  t, tu = Tensor(x), Tensor(u)
  realize_and_check([
    (t + 1, x + 1), (t - 4, x - 4), (t * 3, x * 3), (-t, -x), (t.abs(), np.abs(x)),
    (tu + 100, u + np.uint8(100)), (-tu, -u), (tu - 1, u - np.uint8(1)),
    (t / 2, (x / 2).astype(np.float32)),
  ], rtol=1e-6)


def test_a_python_int_outside_the_dtype_raises_overflow_like_numpy_2():
  i8, u8, i32 = Tensor(np.array([1, -5], np.int8)), Tensor(np.array([1, 7], np.uint8)), Tensor(np.array([1], np.int32))
  for make in (lambda: i8 + 300, lambda: u8 + 256, lambda: i32 + 2**40, lambda: i8 * 1000, lambda: 300 - i8,
               lambda: i8 - 128, lambda: u8 + -1, lambda: i8 // 300, lambda: i8 % 300, lambda: i8 & 300,
               lambda: i8 << 300, lambda: i8.maximum(300), lambda: (i8 > 0).where(i8, 300), lambda: i8 ** 300):
    with pytest.raises(OverflowError, match=r"Python integer -?\d+ out of bounds for u?int(8|32)"): make()
  with pytest.raises(OverflowError, match="300 out of bounds for int8"): Tensor(300, dtype=dtypes.int8)
  # in range, arithmetic wraps like numpy's; a float scalar promotes; a float tensor takes a big int as a float
  i8_np, u8_np = np.array([1, -5], np.int8), np.array([1, 7], np.uint8)
  realize_and_check([
    (i8 + 127, i8_np + 127), (i8 + -128, i8_np + -128), (u8 + 255, u8_np + 255),
    (u8 - 1, u8_np - 1), (i8 + 2.5, [3.5, -2.5]), (i8.half() + 2**40, np.full(2, np.inf, np.float16)),
    (i8.clip(-300, 300), i8_np), (u8.sign(), np.sign(u8_np)),
  ])


def test_comparing_with_a_python_int_outside_the_dtype_is_exact_like_numpy_2():
  x = np.array([1, -5, 127], np.int8)
  t, u = Tensor(x), Tensor(np.array([0, 255], np.uint8))
  realize_and_check([
    (t < 300, x < 300), (t <= 300, x <= 300), (t > 300, x > 300), (t >= 300, x >= 300), (t == 300, x == 300),
    (t != 300, x != 300), (t < -1000, x < -1000), (t > -1000, x > -1000), (300 > t, x < 300),
    (u == -1, [False, False]), (u > -1, [True, True]), (Tensor([1]) < 2**70, [True]),
  ])


def test_dtype_promotion():
  i32, f32 = Tensor([1, 2]), Tensor([1.0, 2.0])
  f16, i8, u8, b = f32.half(), i32.cast(dtypes.int8), i32.cast(dtypes.uint8), Tensor([True, False])
  cases = [
    (i32 + 2.5, dtypes.float32), (f16 + 2.0, dtypes.float16), (i8 + 1, dtypes.int8), (i8 + i32, dtypes.int32),
    (u8 + i8, dtypes.int16), (i32 + f16, dtypes.float16), (f16 * f32, dtypes.float32), (b + b, dtypes.bool),
    (b + 1, dtypes.int32), (b * 1.5, dtypes.float32), (i32 / i32, dtypes.float32), (f16 / 2, dtypes.float16),
    (i32 < 1.5, dtypes.bool), (i32.float().cast(dtypes.float64) + f32, dtypes.float64), (2 ** i32, dtypes.int32),
    (i32.exp(), dtypes.float32), (f16.exp(), dtypes.float16), (i32.sqrt(), dtypes.float32),
  ]
  for i, (t, want) in enumerate(cases): assert t.dtype is want, f"case {i}: {t.dtype} != {want}"
  realize_and_check([(i32 + 2.5, [3.5, 4.5]), (b + b, [True, False]), (b * 1.5, [1.5, 0.0]),
                     (f16 + 2.0, np.array([3, 4], np.float16)), (u8 + i8, [2, 4])])


def test_numpy_scalars_on_the_left_are_weak_scalars():
  t = Tensor([1.0, 2.0], dtype=dtypes.float16)
  assert (np.float32(2) * t).dtype is dtypes.float16
  assert_allclose((np.float32(2) * t + np.int64(1)).numpy(), [3, 5])


def test_floor_division_and_remainder_match_numpy():
  x = np.array([-7, -6, -1, 0, 1, 6, 7, 9], np.int32)
  y = np.array([2, -2, 3, -3, 5, -4, 1, 0], np.int32)  # 0: numpy gives 0 (with a warning), never a trap
  t, d = Tensor(x), Tensor(y)
  with np.errstate(divide="ignore", invalid="ignore"):
    want = [np.floor_divide(x, y), np.remainder(x, y)]
  realize_and_check([
    (t // d, want[0]), (t % d, want[1]),
    (t // 3, x // 3), (t % 3, x % 3), (t // -3, x // -3), (t % -3, x % -3), (20 // Tensor([3, -3, 7]), 20 // np.array([3, -3, 7])),
    (Tensor(x.astype(np.uint8)) // 3, x.astype(np.uint8) // 3),
  ])
  lo = np.array([-2**31, -2**31, 7, -7], np.int32)  # MIN // -1 traps in C; numpy wraps it around
  with np.errstate(over="ignore"):
    realize_and_check([(Tensor(lo) // Tensor([-1, 1, -1, -1]), lo // np.array([-1, 1, -1, -1], np.int32)),
                       (Tensor(lo) % Tensor([-1, 3, -1, 2]), lo % np.array([-1, 3, -1, 2], np.int32)), (Tensor(lo) // -1, lo // -1)])
  xf, yf = x.astype(np.float32) + 0.5, np.array([2, -2, 3, -3, 5, -4, 1, 0.5], np.float32)
  realize_and_check([(Tensor(xf) // Tensor(yf), xf // yf), (Tensor(xf) % Tensor(yf), xf % yf), (Tensor(xf) % 2.5, xf % 2.5)])


def test_powers():
  base = np.array([[-2.0, -0.5, 0.0], [0.5, 1.0, 3.0]], np.float32)
  expo = np.array([[3.0, 2.0, 0.0], [2.5, np.nan, -1.5]], np.float32)
  t, e = Tensor(base), Tensor(expo)
  with np.errstate(all="ignore"):
    realize_and_check([
      (t ** e, np.power(base, expo)), (t ** 2, base ** 2), (t ** 3, base ** 3), (t ** 0, base ** 0),
      (t ** -1, base ** -1), (t.abs() ** 0.5, np.abs(base) ** 0.5), (t ** 1.5, base ** 1.5), (t ** -2.5, base ** -2.5),
      (2 ** t, 2 ** base), (Tensor([-2.0, 3.0]) ** Tensor([3.0, 4.0]), [-8.0, 81.0]),
      (Tensor([1, 2]) ** 0.5, np.sqrt([1, 2], dtype=np.float32)),
    ], rtol=2e-5)


def test_integer_powers_are_exact():
  x, e = np.array([2, -3, 5, 7], np.int32), np.array([10, 3, 0, 11], np.int32)
  realize_and_check([(Tensor(x) ** 3, x ** 3), (Tensor(x) ** Tensor(e), x ** e), (2 ** Tensor(e), 2 ** e)], rtol=0, atol=0)


MATH = [
  ("exp", np.exp, lambda x: x), ("log", np.log, np.abs), ("exp2", np.exp2, lambda x: x), ("log2", np.log2, np.abs),
  ("sqrt", np.sqrt, np.abs), ("rsqrt", lambda x: 1 / np.sqrt(x), np.abs), ("reciprocal", np.reciprocal, lambda x: x),
  ("sin", np.sin, lambda x: x), ("cos", np.cos, lambda x: x), ("tanh", np.tanh, lambda x: x),
  ("sigmoid", lambda x: 1 / (1 + np.exp(-x)), lambda x: x), ("relu", lambda x: np.maximum(x, 0), lambda x: x),
  ("silu", lambda x: x / (1 + np.exp(-x)), lambda x: x),
  ("gelu", lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))), lambda x: x),
]


def test_math_functions():
  x = (rng.standard_normal((3, 7)) * 2).astype(np.float32)
  x[0, :3] = [0.5, 1e-3, 12.0]
  pairs = []
  for name, ref, domain in MATH:
    xi = domain(x)
    pairs.append((getattr(Tensor(xi), name)(), ref(xi.astype(np.float64))))
    pairs.append((getattr(Tensor(xi).T, name)(), ref(xi.T.astype(np.float64))))
  pairs.append((Tensor(np.float32(0.3)).exp(), np.exp(np.float32(0.3))))  # 0-d
  realize_and_check(pairs, rtol=3e-5, atol=1e-6)


def test_math_in_float16_and_on_integers():
  x = np.array([[0.5, 1.0, 2.0], [3.0, 0.25, 1.5]], np.float16)
  i = np.array([1, 4, 9], np.int32)
  realize_and_check([
    (Tensor(x).exp(), np.exp(x)), (Tensor(x).log(), np.log(x)), (Tensor(x).sigmoid(), 1 / (1 + np.exp(-x))),
    (Tensor(x).sqrt(), np.sqrt(x)), (Tensor(i).sqrt(), np.sqrt(i)), (Tensor(i).exp(), np.exp(i.astype(np.float32))),
  ], rtol=2e-3, atol=1e-3)


def test_extremes_of_math_functions():
  x = np.array([-np.inf, -100.0, 0.0, 100.0, np.inf, np.nan], np.float32)
  t = Tensor(x)
  with np.errstate(all="ignore"):
    realize_and_check([
      (t.exp(), np.exp(x)), (t.sigmoid(), 1 / (1 + np.exp(-x))), (t.tanh(), np.tanh(x)), (t.relu(), [0, 0, 0, 100, np.inf, np.nan]),
      (t.abs().log(), np.log(np.abs(x))), (t.clip(-1, 1), np.clip(x, -1, 1)),
    ])


def test_maximum_minimum_clip():
  x = np.array([[1.0, np.nan, -2.0, 5.0], [0.0, 3.0, np.inf, -np.inf]], np.float32)
  y = np.array([2.0, 1.0, np.nan, -6.0], np.float32)
  ti = np.array([3, -8, 0, 7], np.int32)
  realize_and_check([
    (Tensor(x).maximum(Tensor(y)), np.maximum(x, y)), (Tensor(x).minimum(Tensor(y)), np.minimum(x, y)),
    (Tensor(x).maximum(0.5), np.maximum(x, 0.5)), (Tensor(x).clip(-1.0, 2.0), np.clip(x, -1, 2)),
    (Tensor(ti).maximum(Tensor(ti[::-1].copy())), np.maximum(ti, ti[::-1])), (Tensor(ti).minimum(1), np.minimum(ti, 1)),
    (Tensor(ti).clip(hi=2), np.clip(ti, None, 2)), (Tensor(x).clip(lo=0.0), np.clip(x, 0, None)),
  ])


def test_comparisons_handle_nan_like_numpy():
  x = np.array([1.0, np.nan, 2.0, -np.inf, np.nan, 0.0, 3.0], np.float32)
  y = np.array([1.0, 1.0, np.nan, -np.inf, np.nan, -0.0, 2.0], np.float32)
  a, b = Tensor(x), Tensor(y)
  pairs = [(a < b, x < y), (a <= b, x <= y), (a > b, x > y), (a >= b, x >= y), (a == b, x == y), (a != b, x != y),
           (a < 1.5, x < 1.5), (2 <= a, 2 <= x), (a == 1, x == 1), (a.isnan(), np.isnan(x))]
  for t, _ in pairs: assert t.dtype is dtypes.bool
  realize_and_check(pairs)
  i, j = np.array([[1, 5, -3]], np.int32), np.array([[1], [-3]], np.int32)
  realize_and_check([(Tensor(i) <= Tensor(j), i <= j), (Tensor(i) >= Tensor(j), i >= j), (Tensor(i) != Tensor(j), i != j)])


def test_where():
  cond = np.array([[True, False, True]])
  x = rng.standard_normal((2, 3)).astype(np.float32)
  realize_and_check([
    (Tensor(cond).where(Tensor(x), 0.0), np.where(cond, x, 0)),
    (Tensor(cond).where(1.0, Tensor(x)), np.where(cond, 1, x)),
    (Tensor(cond).where(2, -1), np.where(cond, 2, -1)),
    (Tensor(x).where(Tensor(x), 5.0), np.where(x != 0, x, 5)),  # a non-bool condition means != 0
    (Tensor(x > 0).where(Tensor(x).T.T, Tensor(cond).float()), np.where(x > 0, x, cond.astype(np.float32))),
  ])
  assert Tensor(cond).where(1, 0).dtype is dtypes.int32 and Tensor(cond).where(1, 0.5).dtype is dtypes.float32


def test_logic_and_bits():
  p, q = np.array([True, True, False, False]), np.array([True, False, True, False])
  i = np.array([12, -5, 0, 255], np.int32)
  realize_and_check([
    (Tensor(p) & Tensor(q), p & q), (Tensor(p) | Tensor(q), p | q), (Tensor(p) ^ Tensor(q), p ^ q), (~Tensor(p), ~p),
    (Tensor(p).logical_not(), ~p), (Tensor(i).logical_not(), np.logical_not(i)), (~Tensor(i), ~i),
    (Tensor(i) & 6, i & 6), (Tensor(i) | 1, i | 1), (Tensor(i) ^ Tensor(i[::-1].copy()), i ^ i[::-1]),
    (Tensor(i) << 2, i << 2), (Tensor(i) >> 1, i >> 1), ((Tensor(i) > 0) & (Tensor(i) < 100), (i > 0) & (i < 100)),
  ])


def test_graph_uses_only_alu_primitives():
  x = Tensor(np.ones((2, 3), np.float32))
  allowed = GroupOp.ALU | {Ops.CAST, Ops.VIEW, Ops.CONST, Ops.BUFFER}
  for t in (x.exp(), x.log(), x.tanh(), x.gelu(), x - 1, x ** 2.5, x.cos(), x // 2, (x.int() // Tensor([1, 2, 3])), x <= 1):
    assert {u.op for u in t.uop.toposort} <= allowed
  assert Ops.EXP2 in {u.op for u in x.exp().uop.toposort}
  sub = (x - x).uop
  assert sub.op is Ops.ADD and sub.src[1].op is Ops.NEG  # a - b is a + (-b)


def test_bad_operands_raise():
  with pytest.raises(ValueError, match=r"\(2, 3\) and \(4,\)"): Tensor.ones(2, 3) + Tensor.ones(4)
  with pytest.raises(ValueError, match=r"\(3, 2\)"): Tensor.ones(2, 3).where(Tensor.ones(3, 2), 0)
  with pytest.raises(TypeError, match="str"): Tensor.ones(2) + "a"
  with pytest.raises(TypeError, match="bitwise"): Tensor.ones(2) & 1
  with pytest.raises(TypeError, match="bool"): -Tensor([True])
  with pytest.raises(TypeError, match="bool"): Tensor([True]) - Tensor([False])
  with pytest.raises(ValueError, match="lo or hi"): Tensor.ones(2).clip()
  with pytest.raises(ValueError, match="negative integer powers"): Tensor([2, 3]) ** -1
  assert (Tensor.ones(2) == None) is False  # noqa: E711 -- not an operand: plain inequality, no graph


def test_0d_tensors_and_size_1_dims():
  s, r = np.float32(-1.25), rng.standard_normal((1, 3, 1)).astype(np.float32)
  ts, tr = Tensor(np.array(s)), Tensor(r)
  realize_and_check([
    (ts * 2 - 1, s * 2 - 1), (ts.abs().sqrt(), np.sqrt(np.abs(s))), (ts < 0, s < 0), ((ts > 0).where(1.0, ts), np.where(s > 0, 1, s)),
    (ts.maximum(tr), np.maximum(s, r)), (tr + tr.reshape(3, 1, 1), r + r.reshape(3, 1, 1)), (tr.sigmoid() * ts, s / (1 + np.exp(-r))),
    (Tensor(2) ** Tensor(3), 8), (Tensor(7) // Tensor(-2), 7 // -2),
  ])
