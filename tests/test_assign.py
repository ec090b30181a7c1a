"""In-place updates: Tensor.assign and t[index] = value, against numpy, including a value that reads the target."""
import numpy as np
import pytest
from tensor import Tensor
from rewrite import UOp, Ops
from rules.strided_view import View
from runtime.realize import realize, last_program
from tensor.assign import write_many

rng = np.random.default_rng(0)


def arr(*shape, dtype=np.float32): return (rng.standard_normal(shape) * 10).astype(dtype)


SETITEM_CASES = [
  ((5, 6), 2), ((5, 6), -1), ((5, 6), (1, 2)), ((5, 6), slice(1, 4)), ((5, 6), slice(None, None, 2)),
  ((5, 6), slice(None, None, -1)), ((5, 6), slice(4, 0, -2)), ((5, 6), (slice(None), 3)), ((5, 6), (Ellipsis, 1)),
  ((5, 6), (slice(1, None, 3), slice(None, None, -2))), ((2, 3, 4), (Ellipsis, slice(1, 3))), ((2, 3, 4), (1, Ellipsis, 0)),
  ((2, 3, 4), (slice(None), slice(None, None, -1), slice(0, 4, 3))), ((2, 3, 4), Ellipsis), ((7,), slice(2, 100)),
  ((7,), slice(-3, None)), ((2, 3, 4), (None, 1)),
]


@pytest.mark.parametrize("shape,index", SETITEM_CASES)
def test_setitem_with_a_scalar_matches_numpy(shape, index):
  a = arr(*shape)
  t = Tensor(a.copy())
  t[index] = 7.5
  a[index] = 7.5
  np.testing.assert_array_equal(t.numpy(), a)


@pytest.mark.parametrize("shape,index", SETITEM_CASES)
def test_setitem_with_an_array_of_the_selection_shape_matches_numpy(shape, index):
  a = arr(*shape)
  t = Tensor(a.copy())
  value = arr(*np.empty(shape)[index].shape)
  t[index] = Tensor(value)
  a[index] = value
  np.testing.assert_array_equal(t.numpy(), a)


def test_setitem_broadcasts_a_row_and_a_column():
  a, t = arr(4, 5), None
  t = Tensor(a.copy())
  row, col = arr(5), arr(4, 1)
  t[1:3] = row; a[1:3] = row
  t[:, ::2] = Tensor(col); a[:, ::2] = col
  np.testing.assert_array_equal(t.numpy(), a)


def test_setitem_with_a_numpy_array_and_on_ints():
  a = np.arange(12, dtype=np.int32).reshape(3, 4)
  t = Tensor(a.copy())
  t[::2, 1] = np.array([-5, -6], dtype=np.int32); a[::2, 1] = [-5, -6]
  t[1] = 3; a[1] = 3
  np.testing.assert_array_equal(t.numpy(), a)


def test_setitem_on_a_lazy_tensor_realizes_it_first():
  t = Tensor.zeros(3, 4)
  t[1, 1:] = 2.0
  expect = np.zeros((3, 4), np.float32); expect[1, 1:] = 2
  np.testing.assert_array_equal(t.numpy(), expect)


def test_two_views_of_a_dropped_lazy_tensor_share_its_memory():
  # as in numpy: y views the product's memory though nothing else names the product, and so does z; writing z
  # changes y (found by bench/fuzz.py --patterns: y kept its old values, z had become a tensor of its own)
  a = arr(2, 3)
  for _ in range(3):   # (from the second time on it had failed: what the first one registered is gone)
    y = (Tensor(a) @ Tensor(np.eye(3, dtype=np.float32))).reshape(6)
    z = y.flip(0)
    z.assign(y)
    np.testing.assert_array_equal(z.numpy(), a.reshape(6))
    np.testing.assert_array_equal(y.numpy(), a.reshape(6)[::-1])


def test_assign_takes_a_tensor_an_array_or_a_scalar_and_returns_self():
  t = Tensor(arr(3, 3))
  v = arr(3, 3)
  assert t.assign(Tensor(v)) is t
  np.testing.assert_array_equal(t.numpy(), v)
  t.assign(v * 2)
  np.testing.assert_array_equal(t.numpy(), v * 2)
  t.assign(1.5)
  np.testing.assert_array_equal(t.numpy(), np.full((3, 3), 1.5, np.float32))


def test_an_update_writes_the_existing_memory():
  t = Tensor(arr(64))
  t.realize()
  buf = t.uop.src[0].arg
  handle = buf.handle
  t[3:10] = 0.0
  t.assign(Tensor(arr(64)))
  assert t.uop.src[0].arg is buf and buf.handle == handle


def test_a_lazy_tensor_built_before_reads_old_values_one_built_after_new_ones():
  a = arr(6)
  t = Tensor(a.copy())
  before = t * 2
  t[0] = 100.0
  after = t * 2
  t.assign(t + 1)
  latest = t * 2
  np.testing.assert_array_equal(before.numpy(), a * 2)
  b = a.copy(); b[0] = 100
  np.testing.assert_array_equal(after.numpy(), b * 2)
  np.testing.assert_array_equal(latest.numpy(), (b + 1) * 2)


def test_a_value_that_views_the_target_is_read_before_the_write_and_views_it_after():
  a = arr(5)
  t = Tensor(a.copy())
  rev = t[::-1]
  t.assign(rev)
  np.testing.assert_array_equal(t.numpy(), a[::-1])
  np.testing.assert_array_equal(rev.numpy(), a)   # a view: the reverse of the new values, as in numpy
  computed = t[::-1] * 1
  t.assign(computed)
  np.testing.assert_array_equal(computed.numpy(), a)   # a computed tensor keeps the values it was built from


@pytest.mark.parametrize("update", [
  lambda t, a: (t.assign(t[::-1]), a[::-1].copy()),
  lambda t, a: (t.__setitem__(slice(1, None), t[:-1]), np.concatenate([a[:1], a[:-1]])),
  lambda t, a: (t.__setitem__(slice(None, -1), t[1:]), np.concatenate([a[1:], a[-1:]])),
  lambda t, a: (t.assign(t - t.max()), a - a.max()),
  lambda t, a: (t.assign(t * t + 1), a * a + 1),
  # the target a view of the tensor whose memory the value reads, elsewhere (random programs found these wrong)
  lambda t, a: (t[::-1].assign(t), a[::-1].copy()),
  lambda t, a: (t.reshape(3, 3).T.assign(t.reshape(3, 3)), a.reshape(3, 3).T.reshape(-1)),
  lambda t, a: (t.reshape(3, 3)[:, ::-1].__setitem__(slice(1, None), t.reshape(3, 3)[:2]),
                np.concatenate([a[:3], a[:6].reshape(2, 3)[:, ::-1].reshape(-1)])),
  # the value computed from the target, then moved: the view above the arithmetic (random programs found these wrong)
  lambda t, a: (t.assign((t + 0).flip(0)), a[::-1].copy()),
  lambda t, a: (t.assign(t.ceil().flip(0)), np.ceil(a)[::-1].copy()),
  lambda t, a: (t.assign((t + 1).pad(((1, 0),))[:-1]), np.concatenate([[0], a[:-1] + 1])),
])
def test_updates_whose_value_reads_the_target_match_numpy(update):
  a = arr(9)
  t = Tensor(a.copy())
  _, expect = update(t, a)
  np.testing.assert_allclose(t.numpy(), expect, rtol=1e-6)


def test_a_square_matrix_assigned_its_transpose():
  a = arr(6, 6)
  t = Tensor(a.copy())
  t.assign(t.T)
  np.testing.assert_array_equal(t.numpy(), a.T)


def test_a_shape_mismatch_names_both_shapes_and_leaves_the_target_unchanged():
  a = arr(3, 4)
  t = Tensor(a.copy())
  with pytest.raises(ValueError, match=r"\(2, 4\).*\(3, 4\)"): t.assign(Tensor(arr(2, 4)))
  with pytest.raises(ValueError, match=r"\(3,\).*\(2, 4\)"): t[1:] = Tensor(arr(3))
  np.testing.assert_array_equal(t.numpy(), a)


def test_a_dtype_mismatch_names_both_dtypes_and_leaves_the_target_unchanged():
  a = arr(3, 4)
  t = Tensor(a.copy())
  with pytest.raises(TypeError, match="int32.*float32"): t.assign(Tensor(np.zeros((3, 4), np.int32)))
  with pytest.raises(TypeError, match="float64.*float32"): t[0] = np.zeros(4)
  np.testing.assert_array_equal(t.numpy(), a)


def test_bad_indices_raise_like_getitem():
  t = Tensor(arr(3))
  with pytest.raises(IndexError): t[5] = 1.0
  with pytest.raises(TypeError): t[[0, 1]] = 1.0


# ---- the host stage's choice, seen through realize(targets=...) ----
def test_a_kernel_reading_the_target_where_it_writes_stores_in_place():
  t = Tensor(arr(8)).realize()
  target = t.uop.src[0]
  before = t.numpy().copy()
  realize([((t * 3).uop, t.device)], targets=[(target, View.contiguous((8,)))])
  assert len(last_program().kernels_called()) == 1 and "alloc" not in str(last_program())
  np.testing.assert_allclose(t.numpy(), before * 3, rtol=1e-6)   # written into the target's own buffer


def test_a_kernel_reading_the_target_elsewhere_writes_aside_then_copies():
  a = arr(8)
  t = Tensor(a.copy()).realize()
  target = t.uop.src[0]
  realize([(t[::-1].uop, t.device)], targets=[(target, View.contiguous((8,)))])
  assert len(last_program().kernels_called()) == 2 and "alloc" in str(last_program())
  np.testing.assert_array_equal(target.arg.numpy(), a[::-1])


def test_several_targets_each_written_every_output_reading_the_old_contents():
  # output 0 copies z into X; output 1 copies X as it was before the realize into Y (the old X is kept for it by a copy
  # kernel first: its writer runs before it). Before, output 1's buffer X was taken for one a kernel computes (the
  # copy appended for output 0) and that copy's store went to Y: X kept its old value.
  for value in (lambda z: z, lambda z: z + 0):   # an existing buffer (a copy), a computed value (a kernel)
    x, y, z = (Tensor(np.full(4, v, np.float32)).realize() for v in (1, 2, 3))
    X, Y, whole = x.uop.src[0], y.uop.src[0], View.contiguous((4,))
    realize([(value(z).uop, z.device), (x.uop, x.device)], targets=[(X, whole), (Y, whole)])
    np.testing.assert_array_equal(X.arg.numpy(), [3, 3, 3, 3])
    np.testing.assert_array_equal(Y.arg.numpy(), [1, 1, 1, 1])


def test_a_swap_in_one_write_reads_both_old_values():
  a, b = Tensor(np.full(3, 1, np.float32)).realize(), Tensor(np.full(3, 2, np.float32)).realize()
  write_many([(a, View.contiguous((3,)), b * 1), (b, View.contiguous((3,)), a * 1)], private=True)
  np.testing.assert_array_equal(a.numpy(), [2, 2, 2])
  np.testing.assert_array_equal(b.numpy(), [1, 1, 1])


def test_an_update_reading_its_target_writes_in_place_unless_a_lazy_tensor_still_reads_it():
  w = Tensor(np.arange(4, dtype=np.float32)).realize()
  memory = w.uop.src[0].arg.handle
  write_many([(w, View.contiguous((4,)), w * 2)], private=True)    # nothing else reads the old w: no copy
  assert w.uop.src[0].arg.handle == memory
  kept = w + 1                                                      # lazy: reads w as it is now, [0, 2, 4, 6]
  write_many([(w, View.contiguous((4,)), w * 2)], private=True)
  np.testing.assert_array_equal(w.numpy(), [0, 4, 8, 12])
  np.testing.assert_array_equal(kept.numpy(), [1, 3, 5, 7])         # the old contents were kept aside for it


def test_a_nested_list_is_taken_in_the_tensors_dtype():
  t = Tensor(np.zeros((2, 3), np.int32))
  t[1] = [4, 5, 6]
  t[:, 0] = [7, 8]
  np.testing.assert_array_equal(t.numpy(), [[7, 0, 0], [8, 5, 6]])


def test_two_equal_tensors_realized_together_are_two_memories():
  # one graph, two tensors: hash-consing makes them one node, but a write into one must leave the other as it was
  x = Tensor(np.array([1.0, 2.0], np.float32))
  a, b = x + 1, x + 1
  Tensor.realize_all(a, b)
  a[0] = 100.0
  np.testing.assert_array_equal(b.numpy(), [2.0, 3.0])
  np.testing.assert_array_equal(a.numpy(), [100.0, 3.0])


@pytest.mark.parametrize("copy", ["clone", "pad of nothing", "cat of one"])
def test_a_copy_of_memory_keeps_its_values_when_the_original_is_written(copy):
  # numpy's pad and concatenate copy whatever the widths (the fuzz found a pad of zero width that was the tensor itself)
  make = {"clone": lambda t: t.clone(), "pad of nothing": lambda t: t.pad(((0, 0),), value=-2.0),
          "cat of one": lambda t: t.cat()}[copy]
  for realize_first in (False, True):
    x = Tensor(np.array([3.0, 2.0], np.float32))
    y = make(x)
    if realize_first: y.realize()
    x[0] = 5.0
    np.testing.assert_array_equal(y.numpy(), [3.0, 2.0])
    y[1] = 7.0
    np.testing.assert_array_equal(x.numpy(), [5.0, 2.0])
  two = Tensor(np.ones(3, np.float32)).clone()
  Tensor.realize_all(two, two.clone())
  assert two.clone().numpy().tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("op", ["abs of unsigned", "floor of ints", "ceil of ints", "trunc of ints", "clip binding nothing",
                                "sum over no axis", "max over no axis", "sum of a 0-d tensor"])
def test_an_operation_that_changes_no_value_still_makes_a_new_tensor(op):
  # numpy's results (and torch's) are new arrays even where every value stays as it was: a write into the input after
  # must not show in the result
  f = {"abs of unsigned": lambda t: t.abs(), "floor of ints": lambda t: t.floor(), "ceil of ints": lambda t: t.ceil(),
       "trunc of ints": lambda t: t.trunc(), "clip binding nothing": lambda t: t.clip(-1000, None),
       "sum over no axis": lambda t: t.sum(axis=()), "max over no axis": lambda t: t.max(axis=()),
       "sum of a 0-d tensor": lambda t: t.sum()}[op]
  x = Tensor(np.array(3, np.int32)) if op == "sum of a 0-d tensor" else Tensor(np.array([3, 2], np.uint8))
  y = f(x).realize()
  x.assign(Tensor(np.full(x.shape, 5, x.dtype.np)))
  assert y.numpy().ravel()[0] == 3 and x.numpy().ravel()[0] == 5


@pytest.mark.parametrize("op", ["repeat of ones", "repeat adding a leading dimension", "power of one"])
def test_tiles_and_a_power_of_one_are_copies_too(op):
  f = {"repeat of ones": lambda t: t.repeat(1, 1), "repeat adding a leading dimension": lambda t: t.repeat(2, 1, 1),
       "power of one": lambda t: t ** 1}[op]
  a = np.arange(6, dtype=np.float32).reshape(3, 2)
  x = Tensor(a.copy())
  y = f(x)
  x[0] = 99.0
  np.testing.assert_array_equal(y.numpy(), f(a) if op == "power of one" else np.tile(a, (2, 1, 1) if "leading" in op else (1, 1)))
