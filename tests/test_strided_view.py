"""Tests of rules/strided_view.py (View, compose, to_index, to_index_chain) and rules/shapes.py (shape_of).

Every movement is checked against numpy doing the same thing to an array: a view is evaluated by brute force over a
source `1..n` (so that the pad value 0 cannot be mistaken for an element), and its index arithmetic by a small numpy
evaluator of UOp integer expressions with C division semantics.
"""
import math, os
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck
from rewrite import UOp, Ops, dtypes
from rules.strided_view import View, compose, to_index_chain
from rules.shapes import shape_of
from tests.helpers import python_path


# ---- evaluators ----
def evaluate(view: View, src: np.ndarray) -> np.ndarray:
  """The view read from flat `src` by its definition, one element at a time."""
  out = np.zeros(view.shape, dtype=src.dtype)
  for i in np.ndindex(*view.shape):
    if view.mask is None or all(lo <= x < hi for x, (lo, hi) in zip(i, view.mask)):
      out[i] = src[view.offset + sum(x * s for x, s in zip(i, view.strides))]
  return out


def evaluate_stack(views: list[View], src: np.ndarray) -> np.ndarray:
  """A stack of views, innermost first: each reads the contiguous layout of the one below."""
  for v in views: src = evaluate(v, src.reshape(-1))
  return src


def _c_div(a, b): return np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))


def evaluate_uop(root: UOp, env: dict[str, np.ndarray]):
  """Value of an integer/bool UOp expression, elementwise over numpy arrays bound to DEFINE_VARs by name."""
  vals: dict[UOp, object] = {}
  for u in root.toposort:
    s = [vals[x] for x in u.src]
    if u.op is Ops.CONST: vals[u] = u.arg
    elif u.op is Ops.DEFINE_VAR: vals[u] = env[u.arg[0]]
    elif u.op is Ops.ADD: vals[u] = s[0] + s[1]
    elif u.op is Ops.MUL: vals[u] = s[0] * s[1]
    elif u.op is Ops.NEG: vals[u] = -s[0]
    elif u.op is Ops.IDIV: vals[u] = _c_div(s[0], s[1])
    elif u.op is Ops.MOD: vals[u] = s[0] - s[1] * _c_div(s[0], s[1])
    elif u.op is Ops.CMPLT: vals[u] = np.less(s[0], s[1])
    elif u.op is Ops.CMPNE: vals[u] = np.not_equal(s[0], s[1])
    elif u.op is Ops.AND: vals[u] = np.logical_and(s[0], s[1])
    else: raise NotImplementedError(u.op)
  return vals[root]


def evaluate_index(views: list[View], src: np.ndarray) -> np.ndarray:
  """A stack of views read through the index arithmetic of to_index_chain."""
  shape = views[-1].shape
  idxs = [UOp.variable(f"i{d}", 0, max(s - 1, 0)) for d, s in enumerate(shape)]
  flat, valid = to_index_chain(views, idxs)
  grid = np.indices(shape, dtype=np.int64)
  env = {f"i{d}": grid[d] for d in range(len(shape))}
  flat = np.broadcast_to(evaluate_uop(flat, env), shape)
  valid = np.ones(shape, bool) if valid is None else np.broadcast_to(evaluate_uop(valid, env), shape)
  assert np.all((flat[valid] >= 0) & (flat[valid] < src.size)), "a readable element indexes outside its source"
  return np.where(valid, src[np.where(valid, flat, 0)], 0)


# ---- movements, as numpy and as views ----
def np_move(a: np.ndarray, op: str, arg) -> np.ndarray:
  if op == "reshape": return a.reshape(arg)
  if op == "permute": return a.transpose(arg)
  if op == "expand": return np.broadcast_to(a, arg)
  if op == "pad": return np.pad(a, arg)
  if op == "shrink": return a[tuple(slice(b, e) for b, e in arg)]
  if op == "flip": return a[tuple(slice(None, None, -1) if d in arg else slice(None) for d in range(a.ndim))]
  raise ValueError(op)


def view_move(v: View, op: str, arg) -> View | None: return getattr(v, op)(arg)


def run_sequence(start: tuple[int, ...], ops: list[tuple[str, object]]):
  """Apply `ops` to np.arange(1, n+1) with numpy, and to views three ways: fully stacked (one view per op), merged by
  the View methods (a new view stacked only when reshape says None), and the stack folded with compose."""
  n = math.prod(start)
  src = np.arange(1, n + 1)
  ref = src.reshape(start)
  stacked, merged = [View.contiguous(start)], [View.contiguous(start)]
  for op, arg in ops:
    ref = np_move(ref, op, arg)
    stacked.append(view_move(View.contiguous(stacked[-1].shape), op, arg))
    if (m := view_move(merged[-1], op, arg)) is None: merged.append(View.contiguous(arg))
    else: merged[-1] = m
  folded = [stacked[0]]
  for v in stacked[1:]:
    if (c := compose(folded[-1], v)) is None: folded.append(v)
    else: folded[-1] = c
  return src, ref, stacked, merged, folded


def check_sequence(start, ops):
  src, ref, stacked, merged, folded = run_sequence(start, ops)
  for name, views in (("stacked", stacked), ("merged", merged), ("folded", folded)):
    assert views[-1].shape == ref.shape, name
    np.testing.assert_array_equal(evaluate_stack(views, src), ref, err_msg=f"{name}: {views}")
    np.testing.assert_array_equal(evaluate_index(views, src), ref, err_msg=f"{name} via to_index_chain: {views}")
  return merged, folded


# ---- examples against numpy ----
@pytest.mark.parametrize("start, ops", [
  ((6,), [("reshape", (2, 3))]),
  ((2, 3), [("permute", (1, 0))]),
  ((2, 3), [("permute", (1, 0)), ("reshape", (6,))]),  # a transposed merge needs a second view
  ((2, 3), [("permute", (1, 0)), ("reshape", (3, 1, 2, 1))]),
  ((3, 1), [("expand", (3, 4))]),
  ((3, 1), [("expand", (3, 4)), ("reshape", (12,))]),
  ((1, 6), [("expand", (2, 6)), ("reshape", (2, 2, 3))]),
  ((2, 3), [("pad", ((1, 2), (0, 1)))]),
  ((2, 3), [("pad", ((1, 1), (0, 0))), ("reshape", (12,))]),  # rows padded: still one range
  ((2, 3), [("pad", ((1, 1), (0, 0))), ("reshape", (2, 6))]),  # not a box in the new shape
  ((4, 5), [("shrink", ((1, 3), (2, 5)))]),
  ((4, 5), [("flip", (0,))]),
  ((4, 5), [("flip", (0, 1)), ("shrink", ((1, 2), (0, 5))), ("reshape", (5,))]),
  ((2, 3, 4), [("permute", (2, 0, 1)), ("flip", (1,)), ("pad", ((0, 1), (1, 0), (2, 2))), ("shrink", ((1, 4), (0, 3), (1, 6)))]),
  ((3,), [("pad", ((1, 1),)), ("reshape", (5, 1)), ("expand", (5, 2)), ("permute", (1, 0))]),
  ((6,), [("reshape", (2, 3)), ("permute", (1, 0)), ("reshape", (6,))]),
  ((6,), [("flip", (0,)), ("reshape", (2, 3)), ("permute", (1, 0))]),
  ((2, 2), [("pad", ((0, 0), (1, 1))), ("shrink", ((0, 2), (1, 3))), ("reshape", (4,))]),  # pad then cut it back off
  ((5,), [("shrink", ((2, 3),)), ("reshape", ())]),
  ((0, 3), [("reshape", (3, 0)), ("permute", (1, 0))]),
  ((), [("reshape", (1, 1)), ("expand", (2, 3)), ("pad", ((1, 0), (0, 1)))]),
])
def test_movements_match_numpy(start, ops): check_sequence(start, ops)


def test_merged_views_stay_single():
  # movements that one view can always say, whatever came before
  merged, folded = check_sequence((2, 3, 4), [("permute", (2, 0, 1)), ("pad", ((1, 1), (0, 0), (0, 2))), ("flip", (0, 2)),
                                              ("shrink", ((1, 5), (1, 2), (0, 4))), ("reshape", (4, 4)), ("expand", (4, 4))])
  assert len(merged) == 1 and len(folded) == 1


def test_padded_rows_reshape_to_one_range():
  v = View.contiguous((2, 3)).pad(((1, 1), (0, 0))).reshape((12,))
  assert v == View((12,), (1,), -3, ((3, 9),))


# ---- canonical form ----
def test_canonical_form():
  assert View((1, 3), (7, 1), 0, ((0, 1), (0, 3))) == View.contiguous((1, 3))
  assert View.contiguous((1, 3)).strides == (0, 1) and View.contiguous((1, 3)).is_contiguous
  assert View.contiguous((3,)).pad(((1, 1),)).shrink(((1, 4),)) == View.contiguous((3,))
  assert hash(View.contiguous((2, 3)).permute((1, 0)).permute((1, 0))) == hash(View.contiguous((2, 3)))
  # one readable index: the stride is folded into the offset
  assert View((4,), (3,), 1, ((2, 3),)) == View((4,), (0,), 7, ((2, 3),))
  # nothing readable: one all-padding view per shape
  assert View.contiguous((2, 3)).pad(((0, 0), (4, 0))).shrink(((0, 2), (0, 3))) == View.padding((2, 3))
  assert View((2, 0), (5, 1), 3).strides == (0, 0) and View((0,), (1,), 3).offset == 0
  assert View.contiguous((2, 3)).size == 6 and not View.contiguous((2, 3)).permute((1, 0)).is_contiguous


def test_reshape_returns_none_when_one_view_cannot():
  assert View.contiguous((2, 3)).permute((1, 0)).reshape((6,)) is None
  assert View.contiguous((3, 1)).expand((3, 4)).reshape((12,)) is None
  assert View.contiguous((2, 3)).pad(((1, 1), (0, 0))).reshape((2, 6)) is None
  assert View.contiguous((2, 3)).pad(((0, 0), (1, 0))).reshape((8,)) is None  # the readable part is no range
  assert View.contiguous((4,)).shrink(((0, 2),)).reshape((1, 2)) == View.contiguous((1, 2))


# ---- compose ----
def test_compose_examples():
  t = View.contiguous((2, 3)).permute((1, 0))
  assert compose(View.contiguous((6,)), View.contiguous((6,)).reshape((2, 3))) == View.contiguous((2, 3))
  assert compose(t, View.contiguous((3, 2)).permute((1, 0))) == View.contiguous((2, 3))
  assert compose(t, View.contiguous((3, 2)).reshape((6,))) is None
  assert t + View.contiguous((3, 2)).flip((0,)) == t.flip((0,))
  # a split then permute over a flipped inner needs inner split first
  flipped = View.contiguous((6,)).flip((0,))
  outer = View.contiguous((6,)).reshape((2, 3)).permute((1, 0))
  assert compose(flipped, outer) == View((3, 2), (-1, -3), 5)


MOVES = ["permute", "expand", "pad", "shrink", "flip"]


# ---- property tests over random sequences ----
def _factorizations(n: int, dims: int) -> list[tuple[int, ...]]:
  if dims == 0: return [()] if n == 1 else []
  return [(d,) + rest for d in range(1, n + 1) if n % d == 0 for rest in _factorizations(n // d, dims - 1)]


@st.composite
def movement(draw, shape: tuple[int, ...]):
  size, nd = math.prod(shape), len(shape)
  ops = ["reshape", "permute", "shrink", "flip"] + (["expand", "pad"] if size <= 96 else [])
  if nd == 0: ops = ["reshape"]
  op = draw(st.sampled_from(ops))
  if op == "reshape":
    if size == 0: return op, draw(st.sampled_from([(0,), (0, 2), (2, 0, 1)]))
    return op, draw(st.sampled_from([f for k in range(0, 5) for f in _factorizations(size, k)]))
  if op == "permute": return op, tuple(draw(st.permutations(range(nd))))
  if op == "expand": return op, tuple(draw(st.integers(1, 3)) if s == 1 else s for s in shape)
  if op == "pad": return op, tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in shape)
  if op == "shrink":
    out = []
    for s in shape:
      b = draw(st.integers(0, s))
      out.append((b, draw(st.integers(b, s))))
    return op, tuple(out)
  return op, tuple(d for d in range(nd) if draw(st.booleans()))


@st.composite
def sequences(draw):
  start = tuple(draw(st.lists(st.integers(1, 4), min_size=0, max_size=3)))
  shape, ops = start, []
  for _ in range(draw(st.integers(1, 6))):
    op, arg = draw(movement(shape))
    ops.append((op, arg))
    shape = np_move(np.zeros(shape), op, arg).shape
  return start, ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences())
def test_random_sequences_match_numpy(seq): check_sequence(*seq)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequences(), st.data())
def test_compose_of_one_movement_is_the_movement(seq, data):
  # whatever the inner view, composing a permute/expand/pad/shrink/flip on top gives one view, and the very view
  # (canonical form) that the method gives
  _, _, _, merged, _ = run_sequence(*seq)
  inner = merged[-1]
  op, arg = data.draw(movement(inner.shape).filter(lambda m: m[0] in MOVES))
  direct = view_move(inner, op, arg)
  assert compose(inner, view_move(View.contiguous(inner.shape), op, arg)) == direct


# ---- index arithmetic ----
def test_to_index_form():
  i, j = UOp.variable("i", 0, 1), UOp.variable("j", 0, 2)
  flat, valid = View.contiguous((2, 3)).to_index([i, j])
  assert flat is i * 3 + j and valid is None  # no *1, no +0
  flat, valid = View.contiguous((1, 3)).expand((2, 3)).to_index([i, j])
  assert flat is j and valid is None  # zero strides are skipped
  flat, valid = View.contiguous((2, 2)).pad(((0, 0), (1, 0))).to_index([i, j])
  assert flat is i * 2 + j + -1 and valid is (j > 0)  # only the masked side of the masked dimension is checked
  flat, valid = View.contiguous((2, 1)).pad(((0, 0), (1, 1))).to_index([i, j])
  assert valid is ((j > 0) & (j < 2)) and flat is i  # the padded size-1 dim reads one place
  assert View((), (), 5).to_index([]) == (UOp.const(dtypes.index, 5), None)


def test_to_index_chain_unflattens():
  i, j = UOp.variable("i", 0, 2), UOp.variable("j", 0, 1)
  inner = View.contiguous((2, 3)).permute((1, 0))
  outer = View.contiguous((3, 2)).reshape((6,)).reshape((2, 3)).permute((1, 0))
  flat, valid = to_index_chain([inner, outer], [i, j])
  src = np.arange(1, 7)
  np.testing.assert_array_equal(evaluate_index([inner, outer], src), evaluate_stack([inner, outer], src))
  assert valid is None and flat.op is Ops.ADD


# ---- bad arguments ----
@pytest.mark.parametrize("make, match", [
  (lambda: View.contiguous((2, 3)).permute((0, 0)), r"permute\(0, 0\) of shape \(2, 3\)"),
  (lambda: View.contiguous((2, 3)).permute((1,)), r"shape \(2, 3\)"),
  (lambda: View.contiguous((2, 3)).reshape((4, 2)), r"\(2, 3\) \(6 elements\) to \(4, 2\) \(8 elements\)"),
  (lambda: View.contiguous((2, 3)).reshape((-1, 6)), r"\(-1, 6\)"),
  (lambda: View.contiguous((2, 3)).expand((4, 3)), r"expand of shape \(2, 3\) to \(4, 3\)"),
  (lambda: View.contiguous((1, 3)).expand((2, 1, 3)), r"number of dimensions"),
  (lambda: View.contiguous((2, 3)).pad(((0, -1), (0, 0))), r"pads must be >= 0"),
  (lambda: View.contiguous((2, 3)).pad(((0, 1),)), r"one \(before, after\) pair per dimension"),
  (lambda: View.contiguous((2, 3)).shrink(((0, 3), (0, 3))), r"shrink \(\(0, 3\), \(0, 3\)\) of shape \(2, 3\)"),
  (lambda: View.contiguous((2, 3)).shrink(((2, 1), (0, 3))), r"start <= end"),
  (lambda: View.contiguous((2, 3)).flip((2,)), r"flip\(2,\) of shape \(2, 3\)"),
  (lambda: View.contiguous((2, 3)).flip((0, -2)), r"distinct"),
  (lambda: View((2, 3), (1,), 0), r"differ in length"),
  (lambda: View.contiguous((2, 3)).to_index([UOp.variable("i", 0, 1)]), r"needs 2 indices, got 1"),
])
def test_bad_arguments(make, match):
  with pytest.raises(ValueError, match=match): make()


# ---- shape_of ----
class FakeBuffer:
  def __init__(self, size): self.size = size


def test_shape_of_nodes():
  buf = UOp(Ops.BUFFER, dtypes.float32, (), FakeBuffer(12))
  assert shape_of(buf) == (12,)
  x = UOp(Ops.VIEW, dtypes.float32, (buf,), View.contiguous((12,)).reshape((3, 4)))
  assert shape_of(x) == (3, 4)
  assert shape_of(UOp.const(dtypes.float32, 1.0)) == ()
  assert shape_of(UOp(Ops.IOTA, dtypes.int32, (), 5)) == (5,)
  red = UOp(Ops.REDUCE_AXIS, dtypes.float32, (x,), (Ops.ADD, (1,)))
  assert shape_of(red) == (3, 1)
  assert shape_of((x + x).cast(dtypes.float16)) == (3, 4)
  cond = UOp(Ops.VIEW, dtypes.bool, (UOp.const(dtypes.bool, True),), View.contiguous(()).reshape((1, 1)).expand((3, 4)))
  assert shape_of(cond.where(x, x)) == (3, 4)
  assert shape_of(UOp(Ops.CONTIGUOUS, dtypes.float32, (red,))) == (3, 1)
  with pytest.raises(ValueError, match="RANGE"): shape_of(UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, 4),)))
  with pytest.raises(ValueError, match=r"axes \(2,\)"): shape_of(UOp(Ops.REDUCE_AXIS, dtypes.float32, (x,), (Ops.ADD, (2,))))


def test_shape_of_deep_chain():
  node = UOp(Ops.BUFFER, dtypes.float32, (), FakeBuffer(6))
  views = [View.contiguous((6,)).reshape((2, 3)), View.contiguous((2, 3)).reshape((6,))]
  for k in range(200_000): node = UOp(Ops.VIEW, dtypes.float32, (node,), views[k % 2])
  assert shape_of(node) == (6,)
  assert shape_of(node.src[0]) == (2, 3)  # cached on the way



def test_a_view_from_another_process_is_equal_and_finds_its_dict_entry():
  # a View's hash is computed once, when made; one loaded from a pickle made elsewhere (where hash(None), a field of
  # an unmasked view, differs) must hash as one made here
  import pickle, subprocess, sys
  code = "import pickle, sys; from rules.strided_view import View; sys.stdout.buffer.write(pickle.dumps(View((2, 3), (3, 1))))"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  data = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, cwd=root,
                        env={**os.environ, "PYTHONPATH": python_path(root)}).stdout
  here = View.contiguous((2, 3))
  assert pickle.loads(data) == here and {here: "found"}[pickle.loads(data)] == "found"
