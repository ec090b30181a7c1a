"""Splitting loops: one loop of the plan becomes an outer loop times inner loops, one per splitting record.

Stage `opt_split` (rule set `split_rules`, ctx: `OptContext` with the plan attached by stage `opt`). In: a kernel
whose loops are those the plan numbers. Out: every loop named by split/upcast/vector records is replaced, wherever
it is used, by `((outer*a2 + inner2)*a1 + inner1)` (a1 the first record's amount: the innermost part); a REDUCE over
a split loop runs over its parts. Values are unchanged.

An inner part's RANGE arg is `(kind, (level, position), ..., (opt kind, amount))`: "upcast" and "vector" parts are
consumed by their own stages (rules/opt/upcast.py, rules/opt/vector.py); a "split" part stays a loop and, by its level,
nests inside every loop of the original nest (that is tiling: `i, j -> i_o, j_o, i_i, j_i`).
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops
from rules.linearize import nesting_key
from .plan import OptContext, trip_product


def loop_position(r: UOp) -> tuple[int, int]:
  """(level, position) of a loop: level 0 for the kernel's own loops, -1 hoisted outward, >0 inner tile loops."""
  pos = r.arg[1]
  return pos if isinstance(pos, tuple) else (0, pos)


def split_loop(ctx: OptContext, r: UOp) -> UOp | None:
  if (axis := ctx.axis_of.get(r, ctx.padded.get(r))) is None or not (parts := ctx.opts(axis, *ctx.splitting())): return None
  kind, (level, pos), rest = r.arg[0], loop_position(r), r.arg[2:]
  trips = r.src[0].arg // trip_product(parts)
  outer = r.replace(src=(UOp.const(r.dtype, trips),)) if trips > 1 else UOp.const(r.dtype, 0)
  ctx.loop_axis.pop(r)   # the original loop is gone; records after this one act on its outer part, if any
  if trips > 1: ctx.loop_axis[outer] = axis
  expr = outer
  for depth, o in enumerate(reversed(parts), 1):   # the last record is the outermost of the inner parts
    inner = UOp(Ops.RANGE, r.dtype, (UOp.const(r.dtype, o.amount),), (kind, (level + depth, pos), *rest, (o.kind.value, o.amount)))
    expr = expr * o.amount + inner
  return expr


def reduce_over_parts(red: UOp) -> UOp | None:
  """A REDUCE over a loop that was split runs over its parts, outer first."""
  if all(s.op is Ops.RANGE for s in red.src[1:]): return None
  loops: dict[UOp, None] = {}
  for s in red.src[1:]:
    for n in sorted((n for n in s.toposort if n.op is Ops.RANGE), key=nesting_key): loops[n] = None
  return red.replace(src=(red.src[0], *loops))


split_rules = PatternMatcher([
  (UPat(Ops.RANGE, name="r"), split_loop),
  (UPat(Ops.REDUCE, name="red"), reduce_over_parts),
], name="opt_split")
