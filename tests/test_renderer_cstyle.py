"""What the C-family renderers must never get wrong, whatever the compiler does with the text: a load behind a gate
(padding) reads an address inside its buffer with no branch around it, and a constant keeps its sign whatever
operator stands before it (issue 22)."""
import math
import re
import numpy as np
import pytest
from rewrite import dtypes
from renderers.c import C
from renderers.cuda import CUDA
from tensor import Tensor
from tests.helpers import realize_and_check

X = np.arange(12, dtype=np.float32).reshape(6, 2)


def test_the_padded_flipped_exp_of_issue_22():
  # gcc 12.2 -O3 read the flipped input one element off when this load was `gate ? *(data1+i) : 0`
  got = Tensor(X).pad(((0, 1), (1, 2))).exp().flip(1).numpy()
  np.testing.assert_allclose(got, np.flip(np.exp(np.pad(X, ((0, 1), (1, 2)))), 1), rtol=1e-6)


# padded, then walked backwards, then a function whose clamps or compares gcc if-converts: the family of the case
# above (each of these read a wrong element under the old rendering with our flags, -O3 -fno-trapping-math)
FUNCTIONS = {"exp": (lambda t: t.exp(), np.exp), "sigmoid": (lambda t: t.sigmoid(), lambda a: 1 / (1 + np.exp(-a))),
             "relu": (lambda t: t.relu(), lambda a: np.maximum(a, 0)), "clip": (lambda t: t.clip(-1, 5), lambda a: np.clip(a, -1, 5)),
             "where": (lambda t: (t < 3).where(t, -t), lambda a: np.where(a < 3, a, -a))}


# (found by a search over random shapes; each read a wrong element under the old rendering and flags. Each is realized
# alone: realized together they fuse differently and gcc compiled them right)
@pytest.mark.parametrize("shape,pad,fn", [((7, 2), ((1, 0), (1, 3)), "exp"), ((7, 2), ((1, 0), (1, 3)), "relu"),
                                          ((7, 2), ((1, 0), (1, 3)), "sigmoid"), ((2, 5), ((1, 3), (3, 2)), "clip"),
                                          ((4, 3), ((0, 2), (3, 0)), "exp"), ((4, 3), ((0, 2), (3, 0)), "clip"),
                                          ((4, 3), ((0, 2), (3, 0)), "where")])
def test_padded_inputs_walked_backwards(shape, pad, fn):
  x = np.arange(math.prod(shape), dtype=np.float32).reshape(shape) - 4
  apply, ref = FUNCTIONS[fn]
  np.testing.assert_allclose(apply(Tensor(x).pad(pad)).flip(1).numpy(), np.flip(ref(np.pad(x, pad)), 1), rtol=1e-6)


def test_a_gated_load_has_no_branch_and_no_address_outside_its_buffer():
  kernel = "\n".join(Tensor(X).pad(((0, 1), (1, 2))).exp().flip(1).kernel_sources())
  assert not re.search(r"\?\s*\*", kernel), kernel         # no `gate ? *(...)`: the read is not behind a branch
  assert re.search(r"= \*\(data1\+v\d+\*v\d+\);", kernel), kernel   # the index times the gate: element 0 when off


def test_a_padded_vector_load_reads_in_bounds():
  x = np.arange(8 * 40, dtype=np.float32).reshape(8, 40)
  out = Tensor(x).pad(((0, 0), (3, 5)))
  src = "\n".join(out.kernel_sources())
  assert not re.search(r"\?\s*\(?\*\(\w+x\d+\*\)", src)   # no vector read behind a branch either
  np.testing.assert_array_equal(out.numpy(), np.pad(x, ((0, 0), (3, 5))))


# ---- constants keep their sign

@pytest.mark.parametrize("lang", [C, CUDA], ids=["C", "CUDA"])
def test_negative_literals_are_parenthesized(lang):
  assert lang.literal(dtypes.float32, -0.5) == "(-0.5f)"
  assert lang.literal(dtypes.float64, -0.0) == "(-0.0)"
  assert lang.literal(dtypes.int32, -3) == "(-3)"
  assert lang.literal(dtypes.int64, -3) == "(-3LL)"
  assert lang.literal(dtypes.int8, -3).endswith(")(-3))")
  assert lang.literal(dtypes.int32, -2**31) == "((int)(-2147483647-1))"
  assert lang.literal(dtypes.float32, 0.5) == "0.5f" and lang.literal(dtypes.int32, 3) == "3"
  for text in (lang.literal(dt, v) for dt in (dtypes.float16, dtypes.float32, dtypes.float64) for v in (-1.5, -0.0, -math.inf)):
    assert f"-{text}".count("--") == 0, text


UNARY = {"neg": (lambda t: -t, np.negative), "exp": (Tensor.exp, np.exp), "exp2": (Tensor.exp2, np.exp2),
         "log": (Tensor.log, np.log), "log2": (Tensor.log2, np.log2), "sqrt": (Tensor.sqrt, np.sqrt),
         "rsqrt": (Tensor.rsqrt, lambda a: 1 / np.sqrt(a)), "reciprocal": (Tensor.reciprocal, np.reciprocal),
         "sin": (Tensor.sin, np.sin), "cos": (Tensor.cos, np.cos), "tan": (Tensor.tan, np.tan),
         "abs": (Tensor.abs, np.abs), "sign": (Tensor.sign, np.sign), "relu": (Tensor.relu, lambda a: np.maximum(a, 0)),
         "sigmoid": (Tensor.sigmoid, lambda a: 1 / (1 + np.exp(-a))), "tanh": (Tensor.tanh, np.tanh),
         "square": (Tensor.square, np.square), "floor": (Tensor.floor, np.floor), "ceil": (Tensor.ceil, np.ceil),
         "trunc": (Tensor.trunc, np.trunc), "isnan": (Tensor.isnan, np.isnan)}
SPECIAL = [-0.5, -2.0, -0.0, -1e30, -3e-39, math.nan, math.inf, -math.inf]


def _check_nan_aware(pairs):
  Tensor.realize_all(*(t for t, _ in pairs))
  for i, (t, want) in enumerate(pairs):
    np.testing.assert_allclose(t.numpy(), want, rtol=2e-6, atol=1e-7, equal_nan=True, err_msg=f"pair {i}")


@pytest.mark.parametrize("name", sorted(UNARY))
def test_every_unary_op_over_negative_constants_nan_and_infinities(name):
  fn, ref = UNARY[name]
  pairs = []
  with np.errstate(all="ignore"):
    for v in SPECIAL:
      a = np.full((3,), v, np.float32)
      pairs += [(fn(Tensor.full((3,), v)), ref(a)),          # the constant itself
                (fn(-Tensor.full((3,), v)), ref(-a)),        # a negation before it: `--` was a syntax error
                *([(-fn(Tensor.full((3,), v)), -ref(a))] if name != "isnan" else []),
                (fn(Tensor(a) * 1 + Tensor.full((3,), v)), ref(a + a))]  # beside a loaded value
  _check_nan_aware(pairs)


@pytest.mark.parametrize("dtype", ["int8", "int16", "int32", "int64", "float16", "float64"])
def test_negated_negative_constants_of_every_dtype(dtype):
  v = -3 if dtype.startswith("int") else -0.5
  a = np.full((4,), v, dtype)
  realize_and_check([(-Tensor.full((4,), v, dtype=dtype), -a), (-(-Tensor.full((4,), v, dtype=dtype)), a),
                     (Tensor(a) - Tensor.full((4,), v, dtype=dtype), a - a), (abs(Tensor.full((4,), v, dtype=dtype)), np.abs(a))])


def test_the_most_negative_integer_negated_wraps_as_in_numpy():
  a = np.full((2,), -2**31, np.int32)
  with np.errstate(over="ignore"): want = -a
  np.testing.assert_array_equal((-Tensor.full((2,), -2**31, dtype="int32")).numpy(), want)


def test_any_of_bytes_cast_to_int8_is_one():
  # gcc 12.2's straight-line vectorizer kept the -1 lane masks of the bools of an unrolled max (found by bench/fuzz.py)
  x = np.random.default_rng(752844).integers(0, 6, (2, 8, 1)).astype(np.uint8)
  np.testing.assert_array_equal(Tensor(x).any(axis=None, keepdim=True).cast("int8").numpy(), np.ones((1, 1, 1), np.int8))


@pytest.mark.parametrize("dtype", ["int16", "float32"])
def test_a_pad_of_a_cast_over_pairs_reads_every_value(dtype):
  # the cast between the pad and the load puts the pad's mask in the index (`c ? i : 0`); gcc 12.2 made masked vector
  # loads of each pair out of it with wrong masks: zeros where values belonged (found by bench/fuzz.py)
  x = np.random.default_rng(5).integers(-5, 6, (7, 2)).astype(np.int64)
  got = Tensor(x).cast(dtype).pad(((2, 1), (0, 0)), value=0).numpy()
  np.testing.assert_array_equal(got, np.pad(x.astype(dtype), ((2, 1), (0, 0))))


def test_a_pad_of_negative_zero_keeps_its_sign():
  x = np.ones((2, 2), np.float16)
  got = Tensor(x).pad(((1, 0), (0, 1)), value=-0.0).reciprocal().numpy()
  np.testing.assert_array_equal(got, 1 / np.pad(x, ((1, 0), (0, 1)), constant_values=-0.0))


@pytest.mark.parametrize("width", [3, 40])
def test_a_cat_of_a_one_element_view_reads_its_element(width):
  # the view reads element 1 at every index (offset 1, strides 0), gated by the pad of the cat: `1*valid` in the
  # index, which gcc 12.2 folded into the bool's -1 lane mask (buf[-1]) at 4 lanes and stopped on at 16 and more
  # (found by bench/fuzz.py, seed 5000869)
  a = np.random.default_rng(419459).standard_normal((3, 1)).astype(np.float32)
  b = np.random.default_rng(90985).integers(-5, 6, (1, width)).astype(np.float32)
  got = Tensor(a)[-2, None].cat(Tensor(b), axis=1).numpy()
  np.testing.assert_array_equal(got, np.concatenate([a[-2, None], b], axis=1))


@pytest.mark.parametrize("pads", [(2, 2), (30, 33)])
def test_a_pad_of_one_element_of_a_computed_tensor_reads_that_element(pads):
  # the view of a computed (5, 1) tensor reads its element `row` at every index, clamped to 0 where the pad's mask is
  # off (`valid ? row : 0`): as a value before the load (`1*valid`) gcc 12.2 -O3 folded it into the bool's -1 lane
  # mask and read element -1 (row 1 gave element 0), and stopped with an internal error at the wider pad (found by a
  # review). The C renderer writes the select inside the load's address
  a = np.arange(1, 6, dtype=np.float32).reshape(5, 1)
  for row in range(5):
    out = (Tensor(a) * 1)[row].pad((pads,))
    if row: assert f"?{row}:0))" in out.kernel_sources()[-1]
    np.testing.assert_array_equal(out.numpy(), np.pad(a[row], (pads,)))
