"""Upcasting: an inner loop part marked "upcast" (rules/opt/split.py) is unrolled into copies of the code.

Stage `opt_upcast` (rule set `upcast_rules`). In: a kernel whose RANGEs may carry an ("upcast", n) part. Out: no such
RANGE is left. A store over an upcast output loop becomes n stores, one per value of the loop; the copies share
every node that does not depend on it (hash-consing), so a tile of outputs shares its loads, and their reductions,
all over the same loops, share one loop (a register tile of accumulators). A reduction over an upcast loop adds
its n copies of the value in each step (the loop is unrolled; the order of the additions changes).
"""
from __future__ import annotations
import functools, itertools
from rewrite import UOp, UPat, PatternMatcher, Ops, splice_sinks, substitute


def at_values(u: UOp, values: dict[UOp, UOp]) -> UOp:
  """u with some loops replaced by values (a constant index, say): a copy of u for those iterations."""
  return substitute(u, values, name="opt.loops_at_values")


def part_kind(r: UOp) -> str | None:
  """"upcast", "vector" or "split" for an inner part of a split loop; None for any other loop."""
  tag = r.arg[-1] if isinstance(r.arg, tuple) and r.arg else None
  return tag[0] if isinstance(tag, tuple) and len(tag) == 2 and isinstance(tag[0], str) else None


def parts_in(u: UOp, kind: str) -> list[UOp]:
  return [n for n in u.loops if part_kind(n) == kind]


def copies(u: UOp, loops: list[UOp]) -> list[UOp]:
  """u once for each value of the loops (the first loop varies slowest)."""
  return [at_values(u, {r: UOp.const(r.dtype, c) for r, c in zip(loops, values)})
          for values in itertools.product(*(range(r.src[0].arg) for r in loops))]


def unroll_store(st: UOp) -> UOp | None:
  if not (ups := parts_in(st, "upcast")): return None
  return UOp(Ops.SINK, st.dtype, tuple(copies(st, ups)))


def unroll_reduce(red: UOp) -> UOp | None:
  ups = [r for r in red.src[1:] if part_kind(r) == "upcast"]
  if not ups: return None
  value = functools.reduce(lambda a, b: UOp(red.arg, red.dtype, (a, b)), copies(red.src[0], ups))
  rest = tuple(r for r in red.src[1:] if r not in ups)
  return red.replace(src=(value, *rest)) if rest else value


upcast_rules = PatternMatcher([
  (UPat(Ops.REDUCE, name="red"), unroll_reduce),
  (UPat(Ops.STORE, name="st"), unroll_store),
  (UPat(Ops.SINK, name="node"), splice_sinks)   # the copies of an unrolled store,
], name="opt_upcast")
