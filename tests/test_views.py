"""Views write through, both ways, as in numpy and torch (tensor/assign.py): a tensor made by reshape, permute,
slicing, flip or expand shares its source's memory; pad and reshapes that need a copy make a new tensor, as in numpy.
Each case runs the same steps on a numpy array and on a Tensor and compares every array of the story."""
import numpy as np
import pytest
from tensor import Tensor


def both(a: np.ndarray):
  return a.copy(), Tensor(a.copy())


def same(t: Tensor, a: np.ndarray): np.testing.assert_array_equal(t.numpy(), a)


def test_the_reshape_chain_of_issue_22_writes_into_its_source():
  a, t = both(np.arange(4.))
  u, v = a.reshape(2, 2)[:, :].reshape(4), t.reshape(2, 2)[:, :].reshape(4)
  u[0:1] = 99; v[0:1] = 99
  same(t, a); same(v, u)
  assert a.tolist() == [99, 1, 2, 3]


def test_a_row_set_to_zero_zeroes_the_matrix_row():
  a, t = both(np.arange(12, dtype=np.float32).reshape(3, 4))
  row_a, row_t = a[0], t[0]
  row_a[:] = 0; row_t[:] = 0
  same(t, a)
  a[0, 1] = 5; t[0, 1] = 5          # and the other way: the source written, the view sees it
  same(row_t, row_a)


VIEWS = {  # name: a view of a (3, 4, 5) array, the same for numpy and Tensor
  "slice": lambda x: x[1:, ::2],
  "negative step": lambda x: x[::-1, 1:4, ::-2],
  "int index": lambda x: x[1, :, 2],
  "reshape": lambda x: x.reshape(12, 5),
  "permute": lambda x: x.transpose(2, 0, 1) if isinstance(x, np.ndarray) else x.permute(2, 0, 1),
  "flip": lambda x: np.flip(x, 1) if isinstance(x, np.ndarray) else x.flip(1),
  "chain": lambda x: (x.transpose(1, 0, 2) if isinstance(x, np.ndarray) else x.permute(1, 0, 2))[::2, 1:].reshape(2, 2, 5)[:, ::-1],
  "none and ellipsis": lambda x: x[None, ..., 3],
}


@pytest.mark.parametrize("name", sorted(VIEWS))
def test_views_write_through_both_ways(name):
  a, t = both(np.arange(60, dtype=np.float32).reshape(3, 4, 5))
  va, vt = VIEWS[name](a), VIEWS[name](t)
  assert np.shares_memory(va, a)
  vt.numpy()                          # read once (realized into a cache of its own): it must still follow
  va[...] = -va; vt[...] = -vt        # through the view
  same(t, a); same(vt, va)
  a += 1; t.assign(t + 1)             # through the source
  same(vt, va)
  other_a, other_t = VIEWS[name](a), VIEWS[name](t)   # a second view sees the first one's writes
  va.reshape(-1)[0] = 1000; vt.reshape(-1)[0] = 1000
  same(other_t, other_a); same(t, a)


def test_an_expanded_view_sees_its_source_and_refuses_writes_to_shared_elements():
  a, t = both(np.arange(4, dtype=np.float32))
  e = t.reshape(1, 4).expand(3, 4)
  t[2] = 9; a[2] = 9
  same(e, np.broadcast_to(a, (3, 4)))
  with pytest.raises(ValueError, match="expand"): e[:, 0] = 1
  e[0, 1] = 7; a[1] = 7                 # one element of memory: allowed, as in torch
  same(t, a)


def test_pad_and_a_reshape_that_needs_a_copy_make_new_tensors_as_in_numpy():
  a, t = both(np.arange(6, dtype=np.float32).reshape(2, 3))
  pa, pt = np.pad(a, ((1, 0), (0, 1))), t.pad(((1, 0), (0, 1)))
  ra, rt = a.T.reshape(6), t.T.reshape(6)
  assert not np.shares_memory(ra, a)
  pt[1, 0] = 50; pa[1, 0] = 50; rt[0] = 60; ra[0] = 60
  same(t, a); same(pt, pa); same(rt, ra)
  t[0, 0] = 70; a[0, 0] = 70
  same(pt, pa); same(rt, ra)


def test_a_view_of_a_lazy_tensor_views_its_memory_once_it_is_written():
  a, t = np.ones(5, np.float32) * 2, Tensor(np.ones(5, np.float32)) * 2
  va, vt = a[1:4], t[1:4]
  t[2] = 7; a[2] = 7                  # t is realized by the update; vt was taken before
  same(vt, va)
  vt[0] = -1; va[0] = -1
  same(t, a)


def test_lazy_computations_built_before_an_update_keep_the_old_values():
  a, t = both(np.arange(5, dtype=np.float32))
  doubled_a, doubled_t = a * 2, t * 2
  view_a, view_t = a[::2], t[::2]
  t[0] = 100; a[0] = 100
  same(doubled_t, doubled_a); same(view_t, view_a)


def test_contiguous_float_and_tensor_of_a_tensor_are_views_as_in_torch():
  t = Tensor(np.arange(3, dtype=np.float32))
  for alias in (t.contiguous(), t.float(), Tensor(t)):
    alias[0] = 5
    assert t.numpy()[0] == 5
    t[0] = 0
    assert alias.numpy()[0] == 0


def test_a_view_of_a_constant_tensor_sees_updates_as_a_kv_cache_needs():
  a, t = np.zeros((2, 6), np.float32), Tensor.zeros(2, 6)
  seen_a, seen_t = a[:, :3], t[:, :3]
  for step in range(3):
    a[:, step] = step + 1; t[:, step] = step + 1
  same(seen_t, seen_a); same(t, a)


def test_views_still_write_through_after_many_others_came_and_went():
  # the registry forgets views that are gone (and buffers that are) in batches: the live ones must stay in it
  a, t = both(np.zeros((4, 4), np.float32))
  row_a, row_t = a[1], t[1]
  lazy = Tensor(np.ones((4, 4), np.float32)) * 2
  col = lazy[:, 2]
  kept = []
  for i in range(300):
    t[i % 4].T, Tensor(np.zeros(3, np.float32))[1:], lazy[i % 4]   # made and dropped
    b = Tensor(np.zeros(3, np.float32)); kept.append((b, b[1:]))
  t[1, 2] = 7; a[1, 2] = 7
  lazy[3, 2] = 5
  same(row_t, row_a); same(t, a)
  np.testing.assert_array_equal(col.numpy(), [2, 2, 2, 5])
  for i, (b, view) in enumerate(kept): b[2] = np.full((), i, np.float32)   # (data, not a constant: one program)
  assert [(int(b.numpy()[2]), int(view.numpy()[1])) for b, view in kept] == [(i, i) for i in range(300)]


def test_a_reshape_round_trip_of_a_lazy_tensor_is_still_a_view():
  a, t = np.arange(6, dtype=np.float32) * 2, Tensor(np.arange(6, dtype=np.float32)) * 2
  ra, rt = a.reshape(2, 3).reshape(6), t.reshape(2, 3).reshape(6)
  t[0] = -1; a[0] = -1
  same(rt, ra)


def test_a_view_passed_to_a_jit_function_is_its_values():
  from tensor.jit import jit
  double = jit(lambda x: x * 2)
  a = np.arange(12, dtype=np.float32).reshape(3, 4)
  base = Tensor(a)
  for start in (1, 0, 1, 0):   # captured, then replayed with another view of the same shape
    same(double(base[:, start::2]), a[:, start::2] * 2)


def test_realize_of_a_view_of_a_lazy_tensor_computes_that_tensor():
  """A product's result is a view (a reshape) of its lazy reduction: realize() computes the reduction, and the view
  then reads its memory (a benchmark timing `(a @ b).realize()` times the product, not nothing)."""
  a, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((4, 2), np.float32)
  y = (Tensor(a) @ Tensor(b)).realize()
  assert y.is_realized
  s = (Tensor(a) * 2)[1:]
  s.realize()
  assert s.uop.src[0].op.name == "BUFFER"
  same(y, a @ b); same(s, (a * 2)[1:])
