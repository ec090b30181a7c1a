"""Reductions: sum, mean, max, min, var, std, argmax/argmin, any/all, cumsum, built on REDUCE_AXIS with Ops.ADD or Ops.MAX.

REDUCE_AXIS keeps the reduced axes as size 1; without keepdim a reshape (a VIEW) drops them. The graph has only
ADD and MAX reductions: min is max of the order-reversed values, mean is sum / n, var sums squared deviations.
"""
from __future__ import annotations
import math
from rewrite import UOp, Ops, dtypes
from .promotion import to_dtype
from .args import normalize_axes, axis_of
from .recorded import recorded


def _order_flip(x):
  """A dtype-preserving bijection that reverses order: min(x) is flip(max(flip(x)))."""
  if x.dtype.is_float: return -x
  return ~x  # bitwise not reverses both signed and unsigned order, and cannot overflow like -x can


class ReduceMixin:
  __slots__ = ()  # the Tensor's own slots stay its only fields
  def _reduce(self, op: Ops, axis, keepdim: bool, what: str):
    axes = normalize_axes(axis, self.shape, what)
    if not axes: return self
    kept = tuple(1 if d in axes else s for d, s in enumerate(self.shape))
    if self.dtype is dtypes.bfloat16:   # compared in float32 (exact), like its arithmetic (elementwise._alu)
      return self.float()._reduce(op, axis, keepdim, what).cast(dtypes.bfloat16)
    out = self._new(UOp(Ops.REDUCE_AXIS, self.dtype, (self.uop,), (op, axes)), kept)
    return out if keepdim else out._reshape(tuple(s for d, s in enumerate(self.shape) if d not in axes))

  def _reduced_count(self, axis) -> int:
    return math.prod(self.shape[d] for d in normalize_axes(axis, self.shape, "reduce"))

  @recorded   # (a warm call of a row reduction, realized at once, builds no node: tensor/recorded.py)
  def sum(self, axis=None, keepdim=False, dtype=None):
    """Sum over `axis` (int, tuple or None for all). bool and small ints sum as int32, int64 as int64 (`dtype`
    overrides); a float16 or bfloat16 result adds up in float32 and rounds once at the end."""
    if dtype is not None: out = to_dtype(dtype)
    elif self.dtype.is_float: out = self.dtype
    else: out = dtypes.int64 if self.dtype is dtypes.int64 else dtypes.int32
    acc = dtypes.float32 if out.is_half else out
    total = self.cast(acc)._reduce(Ops.ADD, axis, keepdim, "sum").cast(out)
    return self._new_unless_self(total)   # (over no axis)

  @recorded
  def mean(self, axis=None, keepdim=False):
    """Sum / count; integers average as float32."""
    out = self.dtype if self.dtype.is_float else dtypes.default_float
    acc = dtypes.float32 if out.is_half else out
    n = self._reduced_count(axis)
    return (self.cast(acc)._reduce(Ops.ADD, axis, keepdim, "mean") / (n if n else math.nan)).cast(out)

  @recorded
  def max(self, axis=None, keepdim=False):
    if any(self.shape[d] == 0 for d in normalize_axes(axis, self.shape, "max")):
      raise ValueError(f"max/min/argmax over an empty axis of a tensor of shape {self.shape}: there is no value to "
                       f"return (numpy raises too)")
    if self.dtype.is_bool: return self.cast(dtypes.uint8)._reduce(Ops.MAX, axis, keepdim, "max").cast(dtypes.bool)
    return self._new_unless_self(self._reduce(Ops.MAX, axis, keepdim, "max"))   # (over no axis)

  def min(self, axis=None, keepdim=False):
    if self.dtype.is_bool: return self.cast(dtypes.uint8).min(axis, keepdim).cast(dtypes.bool)
    normalize_axes(axis, self.shape, "min")  # report a bad axis as min's
    return _order_flip(_order_flip(self).max(axis, keepdim))

  def any(self, axis=None, keepdim=False): return self.bool().max(axis, keepdim)
  def all(self, axis=None, keepdim=False): return self.bool().min(axis, keepdim)

  def var(self, axis=None, keepdim=False, correction=1):
    """Mean squared deviation with `correction` subtracted from the count (1: the unbiased sample variance;
    0: numpy's default). A count at or below the correction gives inf or NaN, as in numpy."""
    x = self if self.dtype.is_float else self.float()
    work = x.float() if x.dtype.is_half else x
    dev = work - work.mean(axis, keepdim=True)
    dof = max(self._reduced_count(axis) - correction, 0)
    # numpy divides by a zero count and gets inf (or NaN for 0/0); dividing by a float 0.0 does the same
    return ((dev * dev).sum(axis, keepdim) / float(dof)).cast(x.dtype)

  def std(self, axis=None, keepdim=False, correction=1): return self.var(axis, keepdim, correction).sqrt()

  def argmax(self, axis=None, keepdim=False):
    """Index (int32) of the first largest value along `axis`; over the flattened tensor when axis is None. A NaN
    counts as the largest value (the first NaN wins), as in numpy."""
    if axis is None:
      flat = self.flatten().argmax(0)
      return flat.reshape((1,) * self.ndim) if keepdim else flat
    ax = axis_of(axis, self.shape, "argmax")
    n = self.shape[ax]
    is_max = self == self.max(ax, keepdim=True)
    # max propagates NaN, and then no element equals it: the NaNs are the candidates
    if self.dtype.is_float: is_max = is_max | self.isnan()
    # count down from n, so the largest marked score is the first index holding the maximum
    score = self.arange(n, 0, -1, device=self.device).reshape(tuple(n if d == ax else 1 for d in range(self.ndim)))
    return (n - is_max.where(score, 0).max(ax, keepdim)).cast(dtypes.int32)

  def argmin(self, axis=None, keepdim=False):
    if self.dtype.is_bool: return self.logical_not().argmax(axis, keepdim)
    return _order_flip(self).argmax(axis, keepdim)

  def cumsum(self, axis=None, dtype=None):
    """Running sums along `axis` (over the flattened tensor when None, as numpy); the dtype is sum's. Each output sums
    its prefix (`where(j <= i, x[j], 0)` over j): one kernel, n*n/2 additions along the axis, no loop-carried order."""
    if axis is None: return self.flatten().cumsum(0, dtype)
    ax = axis_of(axis, self.shape, "cumsum")
    n = self.shape[ax]
    x = self.unsqueeze(-1).transpose(ax, -1)   # the summed position j last, size 1 in the axis' place
    i = self.arange(n, device=self.device).reshape(tuple(n if d == ax else 1 for d in range(self.ndim)) + (1,))
    j = self.arange(n, device=self.device)
    zero = x._const(False if x.dtype.is_bool else 0, x.dtype, ())
    return (j <= i).where(x, zero).sum(-1, dtype=dtype)
