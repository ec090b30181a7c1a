"""In-place updates: `Tensor.assign(value)` and `t[index] = value` write into the tensor's existing memory.

Semantics are those of eager execution in program order: a lazy tensor built before an update reads the old values,
one built after reads the new ones. How:
  - The target is realized first (a lazy tensor becomes a buffer), then the update runs at once, as one realize
    whose output is written into the target's buffer through the view the index selects (rules/host.py: stored
    there directly when the kernel reads the target only at the element it writes, else computed aside and copied).
  - Lazy graphs built before the update hold the target's BUFFER node (its Buffer object is the version they read).
    When one may still read it, the old contents are kept for them: that Buffer object gets a copy of its contents in
    new memory, and the tensor continues as a new Buffer object that takes over the original memory, into which the
    update writes. "May still read it" is: the value being written reads the target (it is itself such a graph, and
    the caller may keep it), or the target's BUFFER node is still alive once this tensor lets go of it and the cyclic
    garbage collector has run. Otherwise the same Buffer object is written.
Errors (a shape that does not broadcast to the selection, another dtype) are raised before anything is written.
"""
from __future__ import annotations
import gc, weakref
import numpy as np
from rewrite import UOp, Ops, dtypes
from rules.strided_view import View
from .promotion import is_scalar, check_fits


def value_tensor(target, value, shape: tuple[int, ...], what: str):
  """`value` (a Tensor, numpy array, nested list or Python scalar) as a tensor of `shape` on the target's device, checked."""
  if is_scalar(value) and not isinstance(value, np.ndarray):
    return target._const(check_fits(value, target.dtype, what), shape=shape)
  if isinstance(value, (list, tuple)): value = type(target)(value, dtype=target.dtype, device=target.device)
  if isinstance(value, np.ndarray) and target.dtype is dtypes.bfloat16 and value.dtype.kind == 'f':
    value = type(target)(value, dtype=target.dtype, device=target.device)   # rounded to bfloat16, as Tensor() does
  if isinstance(value, np.ndarray):
    if value.dtype != target.dtype.np:
      raise TypeError(f"{what}: a numpy array of dtype {value.dtype} cannot be written into a tensor of dtype "
                      f"{target.dtype.name}; convert it first (arr.astype(np.{target.dtype.np}))")
    value = type(target)(value, device=target.device)
  if not hasattr(value, "uop"): raise TypeError(f"{what}: the value must be a Tensor, a numpy array or a scalar, not {type(value).__name__}")
  if value.dtype is not target.dtype:
    raise TypeError(f"{what}: a value of dtype {value.dtype.name} cannot be written into a tensor of dtype "
                    f"{target.dtype.name}; cast it first (value.cast(...))")
  try: from .elementwise import broadcast_shape; ok = broadcast_shape(value.shape, shape) == tuple(shape)
  except ValueError: ok = False
  if not ok: raise ValueError(f"{what}: a value of shape {value.shape} cannot be broadcast to the selection's shape {tuple(shape)}")
  return value.to(target.device).broadcast_to(tuple(shape))


def write(target, view: View, value) -> None:
  """Write tensor `value` (already of view.shape, checked) into `target`'s memory at `view`."""
  write_many([(target, view, value)])


def write_many(writes: list, also=()) -> None:
  """Each (target, view, value) of `writes` (values checked, targets distinct) written as by write(), all in ONE
  realize, which also realizes the tensors of `also` (an optimizer's step: every parameter and state, and the
  gradients and loss they read). Every value reads the old contents of every target."""
  from runtime.realize import realize
  writes = [(t, v, x) for t, v, x in writes if v.size != 0]
  if not writes: return
  type(writes[0][0]).realize_all(*(t for t, _, _ in writes))
  read = set()
  for _, _, value in writes: read.update(value.uop.toposort)
  for a in also: read.update(a.uop.toposort)
  for target, _, _ in writes:
    old = target.uop.src[0]
    reads_target = old in read
    holder, buf = weakref.ref(old), old.arg
    target.uop = None  # let go of the old version, to see who else holds it
    del old
    earlier_readers = reads_target or (holder() is not None and (gc.collect() >= 0 and holder() is not None))
    dest = buf.split_version() if earlier_readers else buf
    target.uop = UOp(Ops.VIEW, dest.dtype, (UOp(Ops.BUFFER, dest.dtype, (), dest),), View.contiguous(target.shape))
  also = [a for a in also if not a.is_realized]
  outs = realize([(value.uop, target.device) for target, _, value in writes] + [(a.uop, a.device) for a in also],
                 targets=[(target.uop.src[0], view) for target, view, _ in writes] + [None] * len(also))
  for a, u in zip(also, outs[len(writes):]): a.uop = u
