"""How loops run: interchange, parallel threads, and the C compiler's vectorizer, as marks on the loops' args.

Stage `opt_loops` (rule set `loop_rules`, ctx: `OptContext`). In: a kernel after the splitting stages, the context
knowing which axis of the plan each remaining loop came from. Out: the loop of each `interchange` record nests
outside every other loop of its kind (its position gets level -1, see `rules.linearize.nesting_key`); the loop of
each `parallel` record gains the mark "parallel" (the C renderer runs it with OpenMP threads) and that of each
`simd` record the mark "simd" (`#pragma omp simd` with the reductions it closes); a REDUCE lists its loops in
their (new) nesting order. Values are unchanged.
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops
from .plan import OptContext, OptKind
from .split import loop_position
from rules.linearize import nesting_key

MARKS = ("parallel", "simd")


def _relabel(ctx: OptContext, r: UOp, arg: tuple) -> UOp:
  new = r.replace(arg=arg)
  ctx.loop_axis[new] = ctx.loop_axis[r]
  return new


def interchange_loop(ctx: OptContext, r: UOp) -> UOp | None:
  if (axis := ctx.loop_axis.get(r)) is None or not ctx.opts(axis, OptKind.INTERCHANGE) or loop_position(r)[0] < 0: return None
  return _relabel(ctx, r, (r.arg[0], (-1, loop_position(r)[1]), *r.arg[2:]))


def _mark(kind: OptKind):
  def mark(ctx: OptContext, r: UOp) -> UOp | None:
    if (axis := ctx.loop_axis.get(r)) is None or not ctx.opts(axis, kind) or r.arg[-1] in MARKS: return None
    return _relabel(ctx, r, r.arg + (kind.value,))
  mark.__name__ = mark.__qualname__ = f"mark_{kind.value}_loop"
  return mark


mark_parallel_loop, mark_simd_loop = _mark(OptKind.PARALLEL), _mark(OptKind.SIMD)


def reduce_loops_in_nesting_order(red: UOp) -> UOp | None:
  """A REDUCE lists its loops outermost first (the linearizer opens the first and accumulates in the last)."""
  loops = tuple(sorted(red.src[1:], key=nesting_key))
  return None if loops == red.src[1:] else red.replace(src=(red.src[0], *loops))


loop_rules = PatternMatcher([
  (UPat(Ops.RANGE, name="r"), interchange_loop),
  (UPat(Ops.RANGE, name="r"), mark_parallel_loop),
  (UPat(Ops.RANGE, name="r"), mark_simd_loop),
  (UPat(Ops.REDUCE, name="red"), reduce_loops_in_nesting_order),
], name="opt_loops")
