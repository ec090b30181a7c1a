"""Lowering: a kernel becomes loops, index arithmetic, loads, stores and accumulators.

In: `KERNEL(STORE(VIEW(BUFFER), value), ...)` whose values are tensor-level graphs over VIEWs of BUFFERs, constants,
IOTA, elementwise ops and REDUCE_AXIS. Out: `SINK(STORE(INDEX(DEFINE_GLOBAL, idx), value), ...)` where values are
ALU ops over `LOAD(INDEX(DEFINE_GLOBAL, idx)[, valid])`, `RANGE` loop indices and `REDUCE(value, *ranges)`.
No tensor-level node (VIEW, BUFFER, REDUCE_AXIS, IOTA) remains.

How: `INDEXED(x, *idxs)` asks for the element of x at the index vector idxs. A store asks for its value at its loop
indices; the rules push that request down through the graph: an elementwise op asks its sources at the same indices,
a view turns the indices into its source's (masks become validity conditions), a reduction asks its source with new
loops on the reduced axes, and a buffer turns them into a load. This is how views reach the loads and stores.
Buffers are numbered in order of first use, outputs first, so equal kernels over different buffers render the same.
"""
from __future__ import annotations
import itertools
from dataclasses import dataclass, field
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp, dtypes
from .strided_view import View, unflatten, contiguous_strides
from .shapes import shape_of


@dataclass
class LowerContext:
  buffers: dict[UOp, int] = field(default_factory=dict)      # BUFFER -> kernel argument number
  reduce_ranges: itertools.count = field(default_factory=itertools.count)

  def define_global(self, buf: UOp) -> UOp:
    # a normalized kernel's buffers are numbered slots: argument n is slot n
    n = buf.arg.number if hasattr(buf.arg, "number") else self.buffers.setdefault(buf, len(self.buffers))
    return UOp(Ops.DEFINE_GLOBAL, buf.dtype.ptr(), (), n)


def loop(size: int, arg) -> UOp:
  """The index of a loop over `size`, or the constant 0 for a loop of one iteration."""
  return UOp.const(dtypes.index, 0) if size == 1 else UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, size),), arg)


def indexed(x: UOp, idxs) -> UOp: return UOp(Ops.INDEXED, x.dtype, (x, *idxs))


def guarded(valid: UOp | None, value: UOp) -> UOp:
  return value if valid is None else valid.where(value, UOp.const(value.dtype, 0))


# ---- the rules' right-hand sides ----
def lower_store(ctx: LowerContext, st: UOp, buf: UOp, v: UOp, value: UOp) -> UOp:
  shape = v.arg.shape
  ranges = [loop(s, ("out", d, shape[:d + 1])) for d, s in enumerate(shape)]
  flat, valid = v.arg.to_index(ranges)
  assert valid is None, "an output view is never masked"
  return UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, buf.dtype.ptr(), (ctx.define_global(buf), flat)), indexed(value, ranges)))


def index_view(ctx: LowerContext, i: UOp, v: UOp, x: UOp) -> UOp:
  idxs = i.src[1:]
  flat, valid = v.arg.to_index(list(idxs))
  if x.op is Ops.BUFFER:
    if v.arg.is_padding: return UOp.const(i.dtype, 0)
    index = UOp(Ops.INDEX, x.dtype.ptr(), (ctx.define_global(x), flat))
    return UOp(Ops.LOAD, i.dtype, (index,) if valid is None else (index, valid))
  if x.op is Ops.CONST: return guarded(valid, UOp.const(i.dtype, x.arg))
  if (direct := broadcast_indices(v.arg, shape_of(x), idxs)) is not None: return indexed(x, direct)
  # where the view is padding, `flat` may lie outside x, and x's loads, computed anyway (the where is a select), would
  # read outside their buffers (GRAFT_SANITIZE found it, issue 22): there x is read at index 0 instead
  return guarded(valid, indexed(x, unflatten(flat if valid is None else valid.where(flat, UOp.const(flat.dtype, 0)), shape_of(x))))


def broadcast_indices(view: View, shape: tuple[int, ...], idxs) -> list[UOp] | None:
  """The source's indices, dimension by dimension, where the view only broadcasts its source's own layout (a row
  statistic read along the row: softmax's max); else None. Going through the flat index instead asks the symbolic
  stage to undo a division and a modulo, and it does so only after the reductions are made: a reduction read twice
  (the sum's pass and the output's) would be lowered twice, as two loops."""
  if view.mask is not None or view.offset != 0 or len(shape) != view.ndim or view.strides != contiguous_strides(shape): return None
  if any(s != n and s != 1 for s, n in zip(shape, view.shape)): return None
  return [i if s == n else UOp.const(i.dtype, 0) for i, s, n in zip(idxs, shape, view.shape)]


def index_reduce(ctx: LowerContext, i: UOp, r: UOp, x: UOp) -> UOp:
  op, axes = r.arg
  src_shape = shape_of(x)
  idxs = list(i.src[1:])
  new_ranges = []
  for a in axes:
    idxs[a] = loop(src_shape[a], ("reduce", next(ctx.reduce_ranges)))
    if idxs[a].op is Ops.RANGE: new_ranges.append(idxs[a])
  value = indexed(x, idxs)
  return UOp(Ops.REDUCE, i.dtype, (value, *new_ranges), op) if new_ranges else value


lower_rules = PatternMatcher([
  (UPat(Ops.KERNEL, name="k"), lambda k: UOp(Ops.SINK, dtypes.void, k.src, k.arg), "kernel_to_sink"),
  (UPat(Ops.STORE, name="st", src=(UPat(Ops.VIEW, name="v", src=(UPat(Ops.BUFFER, name="buf"),)), UPat.var("value"))), lower_store),
  # elementwise ops ask their sources at the same indices
  (UPat(Ops.INDEXED, name="i", src=(UPat(GroupOp.Elementwise, name="x"),), allow_any_len=True),
   lambda i, x: x.replace(src=tuple(indexed(s, i.src[1:]) for s in x.src)), "push_index_through_elementwise"),
  (UPat(Ops.INDEXED, name="i", src=(UPat(Ops.VIEW, name="v", src=(UPat(name="x"),)),), allow_any_len=True), index_view),
  (UPat(Ops.INDEXED, name="i", src=(UPat(Ops.REDUCE_AXIS, name="r", src=(UPat(name="x"),)),), allow_any_len=True), index_reduce),
  (UPat(Ops.INDEXED, src=(UPat(Ops.IOTA, name="iota"), UPat.var("idx"))), lambda iota, idx: idx.cast(iota.dtype), "iota_is_its_index"),
  (UPat(Ops.INDEXED, name="i", src=(UPat(Ops.CONST, name="c"),), allow_any_len=True), lambda i, c: c, "constant_at_any_index"),
  (UPat(Ops.INDEXED, name="i", src=(UPat(Ops.BUFFER, name="b"), UPat.var("idx"))),
   lambda ctx, i, b, idx: UOp(Ops.LOAD, i.dtype, (UOp(Ops.INDEX, b.dtype.ptr(), (ctx.define_global(b), idx)),)), "load_from_buffer"),
], name="lower")
