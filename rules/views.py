"""Views: merge stacked views and push views toward the loads, so that each load reads through as few views as it can.

In and out: a kernel `KERNEL(STORE(VIEW(BUFFER), value), ...)` at tensor level. After this stage no VIEW sits on
another VIEW that it can be merged with, and views without a mask have moved below elementwise ops (a masked view
stays where it is: padding an op's result is not padding its sources, exp(0) != 0). The values computed are unchanged.
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp


def merge_views(outer: UOp, inner: UOp, x: UOp) -> UOp | None:
  merged = inner.arg + outer.arg
  return None if merged is None else UOp(Ops.VIEW, outer.dtype, (x,), merged)


def push_view_through(v: UOp, e: UOp) -> UOp | None:
  if v.arg.mask is not None: return None
  return e.replace(src=tuple(UOp(Ops.VIEW, s.dtype, (s,), v.arg) for s in e.src))


view_rules = PatternMatcher([
  (UPat(Ops.VIEW, name="outer", src=(UPat(Ops.VIEW, name="inner", src=(UPat(name="x"),)),)), merge_views),
  (UPat(Ops.VIEW, name="v", src=(UPat(GroupOp.Elementwise, name="e"),)), push_view_through),
], name="views")
