"""Padding: an output loop runs a multiple of a tile's trips, so a tile that does not divide it still fits.

Stage `opt_pad` (rule set `pad_rules`, ctx: `OptContext`), before the splitting stage. In: a kernel whose loops are
those the plan numbers. Out: the loop of each `pad(a, n)` record, of N trips, runs ceil(N / n) * n trips, and every
use of its index reads `min(index, N - 1)`: the iterations past the end redo the last one (they read what it reads
and store what it stores: the same values, to the same place, in the same tile), so the kernel's values are
unchanged. The padded loop is the one the records after it split: a 6-row register tile of a 1024-row matrix is
`pad(0, 6) upcast(0, 6)`, 171 tiles whose last computes row 1023 three times.
Only output loops are padded: a reduction would add its last term again.
"""
from __future__ import annotations
import math
from rewrite import UOp, UPat, PatternMatcher, Ops
from .plan import OptContext, OptKind


def padded_trips(trips: int, amounts) -> int:
  for n in amounts: trips = math.ceil(trips / n) * n
  return trips


def pad_loop(ctx: OptContext, r: UOp) -> UOp | None:
  if (axis := ctx.axis_of.get(r)) is None or not (pads := ctx.opts(axis, OptKind.PAD)): return None
  trips = r.src[0].arg
  if (padded := padded_trips(trips, (o.amount for o in pads))) == trips: return None
  longer = r.replace(src=(UOp.const(r.dtype, padded),))
  # the longer loop stands for the axis from now on: the splitting stage splits it
  ctx.padded[longer] = ctx.loop_axis[longer] = ctx.loop_axis.pop(r)
  return longer.minimum(trips - 1)


pad_rules = PatternMatcher([(UPat(Ops.RANGE, name="r"), pad_loop)], name="opt_pad")
