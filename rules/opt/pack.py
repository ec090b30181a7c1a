"""Packing: an operand's tile is copied into a contiguous local buffer before the loop nest that reads it.

Stage `opt_pack` (rule set `pack_rules`, ctx: `OptContext`), for each record `pack(a)` of the plan, `a` an output
loop. In: a kernel after the loop stage, before the upcast and vector stages. Out: each load of a global buffer that does not depend on loop `a` but
does on loops nested inside it (the B panel of a matrix product, for a = the rows of A) reads a local buffer
instead. The buffer (`DEFINE_LOCAL`, one per load, its unrolled copies included; its source is the loop it lives in, so each iteration of that
loop, and each thread, has its own) holds the load's values for every iteration of those inner loops, in their
order, the vector lanes innermost, so the nest reads it front to back, one vector after another, however the global
operand is strided (a packed panel of W in x @ W.T is W transposed).
It is filled by a loop nest of its own (RANGE kind "pack"), first inside the last loop the load depends on (where
the buffer is declared); the reads take
`BARRIER(buffer, fill store, *fill loops)` as their buffer: a value that exists once the fill is done (the
linearizer closes the fill loops there, as a REDUCE closes its loops). Values are unchanged.
"""
from __future__ import annotations
import math
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes
from rules.linearize import nesting_key
from .plan import OptContext, OptKind
from .upcast import at_values, part_kind

MAX_LOCAL_BYTES = 256 << 10   # a packed buffer lives on the stack of its thread


def pack_load(ctx: OptContext, ld: UOp, buf: UOp, idx: UOp) -> UOp | None:
  if buf.op is not Ops.DEFINE_GLOBAL or len(ld.src) != 1: return None
  loops = sorted((n for n in idx.toposort if n.op is Ops.RANGE), key=nesting_key)
  for o in ctx.opts_of_kind(OptKind.PACK):
    a = ctx.current_loop(o.axis)
    if a is None or a in ld.toposort: continue
    # the buffer's layout: the order the nest reads it in: the loops in nesting order, then the unrolled copies (a
    # register tile's vectors of one step, side by side), then the vector lanes (rules/opt/vector.py reads them with
    # vector loads). One stream: copies in buffers of their own would sit a power of two apart, in one cache set
    inner = sorted((q for q in loops if nesting_key(q) > nesting_key(a)), key=lambda q: (part_kind(q) == "vector", part_kind(q) == "upcast", nesting_key(q)))
    outer = [q for q in loops if nesting_key(q) < nesting_key(a)]
    size = math.prod(q.src[0].arg for q in inner)
    # a load that varies only along the lanes is one vector: nothing to pack (and the read would sit beside the fill,
    # not inside a loop after it, which the linearizer orders only by its loops)
    if all(part_kind(q) == "vector" for q in inner) or size * ld.dtype.itemsize > MAX_LOCAL_BYTES: continue
    # the fill nests right inside the last loop it depends on, before any other loop there (nesting_key: a tuple
    # that extends another sorts right after it)
    at = nesting_key(outer[-1])[1:] if outer else (-2,)
    fill_loops = [UOp(Ops.RANGE, q.dtype, q.src, ("pack", (*at, m), q.arg)) for m, q in enumerate(inner)]
    local = UOp(Ops.DEFINE_LOCAL, ld.dtype.ptr("local"), tuple(outer[-1:]), (ctx.next_local(), size))
    def slot(qs) -> UOp:
      flat = qs[0]
      for q in qs[1:]: flat = flat * q.src[0].arg + q
      return flat
    fill = UOp(Ops.STORE, dtypes.void, (UOp(Ops.INDEX, local.dtype, (local, slot(fill_loops))), at_values(ld, dict(zip(inner, fill_loops)))))
    filled = UOp(Ops.BARRIER, local.dtype, (local, fill, *fill_loops))
    return UOp(Ops.LOAD, ld.dtype, (UOp(Ops.INDEX, local.dtype, (filled, slot(inner))),))
  return None


pack_rules = PatternMatcher([
  (UPat(Ops.LOAD, name="ld", src=(UPat(Ops.INDEX, src=(UPat.var("buf"), UPat.var("idx"))),)), pack_load),
], name="opt_pack")
