"""Picking elements by integer tensors: `t[ids]`, `gather`, `one_hot`, and the index checks they share.

Every pick is a composition of primitives: the one-hot sum `sum_r where(ids == r, t[..., r, ...], 0)` over the
picked axis. The autograd rules and every device see only comparisons, selects and a sum; rules/one_hot.py turns the
sum into a load at the picked index once the kernel is lowered, so a lookup costs its output, not the table.

Indices follow numpy: negative ones count from the end, and any outside -n..n-1 raise IndexError at the call (an
index tensor is realized then, to check it, as torch checks on the CPU).
"""
from __future__ import annotations
import numpy as np
from rewrite import dtypes
from runtime.capture import guard
from .args import axis_of
from .assign import is_view


def _index_dtype(n: int):
  """The integer type a checked index is compared in: int32, int64 only for an axis past 2**31 - 1 (32-bit index
  arithmetic in the kernel)."""
  return dtypes.int64 if n > dtypes.max(dtypes.int32) else dtypes.int32


def as_index(t, index, n: int, what: str, negative: bool = True):
  """`index` (a Tensor or numpy array of integers, or nested lists of ints) as an integer tensor on t's device whose
  values lie in 0..n-1: negatives wrapped when `negative`, anything else out of range an IndexError."""
  lo = -n if negative else 0
  if not hasattr(index, "uop"):
    arr = np.asarray(index)
    if arr.dtype == object or arr.dtype.kind not in "iub" or arr.dtype.kind == "b":
      raise IndexError(f"{what}: indices must be integers, not {arr.dtype} (boolean masks are not supported: their "
                       f"result's shape depends on the data)")
    if arr.size and (arr.min() < lo or arr.max() >= n):
      bad = arr[(arr < lo) | (arr >= n)].flat[0]
      raise IndexError(f"{what}: index {bad} is out of bounds for an axis of size {n}")
    index = type(t)(arr.astype(_index_dtype(n).np), device=t.device)
  else:
    if index.dtype.is_bool or index.dtype.is_float:
      raise IndexError(f"{what}: indices must be an integer tensor, not {index.dtype.name} (boolean masks are not "
                       f"supported: their result's shape depends on the data)")
    if index.device != t.device:
      raise ValueError(f"{what}: the indices live on {index.device}, the tensor on {t.device}: move them with .to()")
    if index.numel():
      if is_view(index): index = index.contiguous()   # (its own memory: what the check reads, and its message)
      bad = ((index < lo) | (index >= n)).any()
      type(t).realize_all(index, bad)
      guard(bad.uop.src[0].arg, index.uop.src[0].arg,    # (a jit replay checks it again: runtime/capture.py)
            lambda arr: IndexError(f"{what}: index {arr[(arr < lo) | (arr >= n)].flat[0]} is out of bounds for an axis of size {n}"))
    index = index.cast(_index_dtype(n))  # exact: every value is in range
  return (index < 0).where(index + n, index) if negative and lo < 0 else index


def pick(t, index, axis: int):
  """Along `axis` of t, the elements at `index` (values already in 0..n-1), for each position the broadcast of t's
  other axes and index's (index and t have the same number of dimensions, index's size along `axis` is the result's):
  a one-hot sum over the axis, with the summed axis last."""
  n = t.shape[axis]
  x = t.unsqueeze(-1).transpose(axis, -1)          # the picked axis moved last, size 1 in its place
  hit = index.unsqueeze(-1) == t.arange(n, device=t.device, dtype=index.dtype)
  work = x.cast(dtypes.uint8) if x.dtype.is_bool else x   # (the rule reads sums: a bool picks as 0/1)
  out = hit.where(work, work._const(0, work.dtype, ())).sum(-1, dtype=work.dtype)
  return out.cast(t.dtype)


def take(t, index, axis: int):
  """numpy's advanced indexing by one integer array on `axis`: shape t.shape[:axis] + index.shape + t.shape[axis+1:]."""
  rest = t.shape[axis + 1:]
  # t as (..., 1 for each index dim, n, rest), index as (1 for t's leading dims, index dims, 1, 1 for rest)
  x = t.reshape(t.shape[:axis] + (1,) * index.ndim + (t.shape[axis],) + rest)
  ids = index.reshape((1,) * axis + index.shape + (1,) * (1 + len(rest)))
  return pick(x, ids, axis + index.ndim).squeeze(axis + index.ndim)


def gather(t, axis, index):
  """numpy's take_along_axis(t, index, axis): index has t's number of dimensions; the other axes broadcast."""
  ax = axis_of(axis, t.shape, "gather")
  if not hasattr(index, "uop"): index = np.asarray(index)
  if len(index.shape) != t.ndim:
    raise ValueError(f"gather: index of shape {tuple(index.shape)} needs {t.ndim} dimensions, as the tensor of shape "
                     f"{t.shape} has")
  for d, (a, b) in enumerate(zip(t.shape, index.shape)):
    if d != ax and a != b and a != 1 and b != 1:
      raise ValueError(f"gather: index of shape {tuple(index.shape)} does not broadcast with the tensor of shape {t.shape} "
                       f"off axis {ax}")
  idx = as_index(t, index, t.shape[ax], f"gather(axis={axis})")
  return pick(t, idx, ax)


def one_hot(t, n: int, dtype=None):
  """(..., n): 1 where the last index equals t's value, else 0; every value must lie in 0..n-1."""
  if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"one_hot({n!r}): the number of classes must be an int >= 1")
  idx = as_index(t, t, int(n), f"one_hot({n})", negative=False)
  return (idx.unsqueeze(-1) == t.arange(int(n), device=t.device, dtype=idx.dtype)).cast(dtype or dtypes.default_int)


def split_index(idx: tuple, ndim: int):
  """(the basic part, the axis of the result the array goes to, the array, whether its dimensions go first) for a
  numpy index tuple holding one integer array (ints beside it count as advanced indices too, as in numpy), or None
  when it holds no array."""
  is_array = [hasattr(i, "uop") or isinstance(i, (np.ndarray, list)) for i in idx]
  if not any(is_array): return None
  if sum(is_array) > 1: raise IndexError("indexing by more than one integer array at once is not supported; index one "
                                         "axis at a time")
  a = is_array.index(True)
  basic = idx[:a] + (slice(None),) + idx[a + 1:]
  if sum(i is Ellipsis for i in basic) > 1: raise IndexError("an index can only have a single ellipsis ('...')")
  n_real = sum(i is not None and i is not Ellipsis for i in basic)
  if n_real > ndim: raise IndexError(f"too many indices for a tensor of {ndim} dims: {n_real} given")
  fill = (slice(None),) * (ndim - n_real)
  full = tuple(x for i in basic for x in (fill if i is Ellipsis else (i,))) + (() if Ellipsis in basic else fill)
  a_full = sum(len(fill) if i is Ellipsis else 1 for i in basic[:a])
  # numpy: advanced indices (the array and ints) that are not side by side put their dimensions first
  adv = [k for k, i in enumerate(full) if k == a_full or _is_int(i)]
  first = adv != list(range(adv[0], adv[-1] + 1))
  axis = sum(1 for i in full[:a_full] if not _is_int(i))   # the array's axis after the basic indexing drops ints
  return full, axis, idx[a], first


def _is_int(i) -> bool: return isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))


def advanced(t, idx: tuple):
  """t[idx] for an index tuple with one integer array (split_index gave it), numpy's shape and placement."""
  full, axis, array, first = split_index(idx, t.ndim)
  b = t[full]
  out = take(b, as_index(b, array, b.shape[axis], f"t[{_show(idx)}]"), axis)
  if not first: return out
  k = len(array.shape) if hasattr(array, "shape") else np.ndim(array)
  order = tuple(range(axis, axis + k)) + tuple(range(axis)) + tuple(range(axis + k, out.ndim))
  return out.permute(order)


def _show(idx: tuple) -> str:
  return ", ".join("tensor" if hasattr(i, "uop") else "array" if isinstance(i, (np.ndarray, list)) else repr(i) for i in idx)
