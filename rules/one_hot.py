"""One-hot sums become loads at a computed index: how `t[ids]`, `gather`, `cross_entropy` run in O(output).

The tensor operations that pick elements by an integer tensor (tensor/indexing.py) are compositions of primitives:
`W[ids]` is `sum_r where(ids == r, W[r], 0)` over the indexed axis r. Written so, the autograd rules and every
device see plain elementwise ops and a sum; run so, it would read all of W once per picked row. This rule set states
the identity that makes it a lookup, on the loop-level graph the lowering stage made:

    REDUCE(ADD, WHERE(e == q + rest, f(q), 0), q, ...)  ->  WHERE(0 <= e - rest < n, f(clamp(e - rest)), 0)

for a reduction loop q over n values that the compared value e does not depend on (the other side may add terms
`rest` free of q: a split reduction reads r as q + part * length). `clamp` keeps the load inside the buffer even where
the index is out of range (then the WHERE gives 0, as the sum did), and tells the bounds analysis so: max(x, 0) % n.

Contract: the result computes the same values as the input, for every value of e (in range or not); the remaining
reduction loops, if any, stay a REDUCE. Runs in the symbolic stage, so the new index arithmetic is simplified there.
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, substitute
from .symbolic import terms_of, sum_of


def _equality(cond: UOp) -> tuple[UOp, UOp] | None:
  """(a, b) where cond is a == b, which the tensor level writes as (a != b) != True."""
  if cond.op is Ops.CMPNE and cond.src[1].op is Ops.CONST and cond.src[1].arg is True and cond.src[0].op is Ops.CMPNE:
    return cond.src[0].src[0], cond.src[0].src[1]
  return None


def _solve(side: UOp, q: UOp) -> UOp | None:
  """`rest` where side is (q + rest), an index (cast exactly to integer types), rest free of q; else None."""
  idx = side
  # casts that keep every value (an arange is an int32 counter, cast to the indices' int64, say)
  while idx.op is Ops.CAST and idx.src[0].dtype.is_int and dtypes.min(idx.dtype) <= idx.src[0].vmin \
        and idx.src[0].vmax <= dtypes.max(idx.dtype):
    idx = idx.src[0]
  if idx.dtype is not dtypes.index or not side.dtype.is_int: return None
  terms = terms_of(idx)
  if [k for t, k in terms if t is q] != [1]: return None
  rest = [(t, k) for t, k in terms if t is not q]
  if any(t is not None and q in t.toposort for t, _ in rest): return None
  return sum_of(dtypes.index, rest)


def pick_one_hot(red: UOp, cond: UOp, f: UOp, zero: UOp) -> UOp | None:
  if red.arg is not Ops.ADD or zero.arg != 0 or (eq := _equality(cond)) is None: return None
  ranges = red.src[1:]
  for q in ranges:
    for side, e in (eq, eq[::-1]):
      if q in e.toposort or (rest := _solve(side, q)) is None: continue
      n = q.src[0].arg
      at = e.cast(dtypes.index) - rest if rest.op is not Ops.CONST or rest.arg != 0 else e.cast(dtypes.index)
      valid = (at < n) & (at < 0).ne(True)
      picked = valid.where(substitute(f, {q: at.maximum(0) % n}), zero)
      others = tuple(r for r in ranges if r is not q)
      return UOp(Ops.REDUCE, red.dtype, (picked, *others), red.arg) if others else picked
  return None


one_hot_rules = PatternMatcher([
  (UPat(Ops.REDUCE, name="red", src=(UPat(Ops.WHERE, src=(UPat.var("cond"), UPat.var("f"), UPat.cvar("zero"))),),
        allow_any_len=True), pick_one_hot, "one_hot_sum_is_a_load"),
], name="one_hot")
