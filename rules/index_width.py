"""Index width: each index node becomes an int32 where its values fit in 32 bits, an int64 where they do not.

In: a kernel after every stage that builds index arithmetic (lower, symbolic, the gpu stages, opt). Loop counters
(`RANGE`), thread indices (`SPECIAL`), their constants, and the sums, products, `//`, `%`, `max` and selects over them
have dtype `dtypes.index`: a 64-bit integer, so their bounds (`vmin`, `vmax`) are exact.

Out: the same kernel with no node of dtype `index` left, computing the same values:
- a node is int32 when its own bounds and all its index sources fit in int32, else int64. A loop counter's source is
  its trip count, so `for (i = 0; i < n; i++)` is 64-bit as soon as n itself is past 2^31 - 1 (i reaches n);
- an int64 node's int32 sources are widened (a constant is remade at 64 bits, anything else gets a CAST), so C
  computes in 64 bits everything that is past 32 bits anywhere (products of a 32-bit index by a large stride);
- a comparison of an int32 with an int64 index compares in 64 bits; a cast to the width a value already has is gone.
So kernels of ordinary sizes keep the int32 arithmetic they always had, and only indices into buffers past 2^31 - 1
elements (or loops past that many trips) pay for 64-bit arithmetic.
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp, dtypes
from .symbolic import drop_cast_to_own_type


def fits_int32(u: UOp) -> bool: return dtypes.min(dtypes.int32) <= u.vmin and u.vmax <= dtypes.max(dtypes.int32)


def widen(u: UOp, dtype) -> UOp:
  """u as a `dtype` integer (bool sources, the conditions of a select, stay as they are)."""
  if u.dtype is dtype or not u.dtype.is_int: return u
  return UOp.const(dtype, u.arg) if u.op is Ops.CONST else u.cast(dtype)


def index_as_int32_or_int64(u: UOp) -> UOp:
  # sources are finished first (bottom-up), so an int64 source here is an index that needed 64 bits
  wide = not fits_int32(u) or any(s.dtype is dtypes.int64 for s in u.src)
  width = dtypes.int64 if wide else dtypes.int32
  if u.op is Ops.CONST: return UOp.const(width, u.arg)
  return UOp(u.op, width, tuple(widen(s, width) for s in u.src), u.arg)


def compare_in_the_wider_type(u: UOp, x: UOp, y: UOp) -> UOp | None:
  if x.dtype is y.dtype or not (x.dtype.is_int and y.dtype.is_int): return None
  wider = x.dtype if x.dtype.itemsize > y.dtype.itemsize else y.dtype
  return u.replace(src=(widen(x, wider), widen(y, wider)))


index_width_rules = PatternMatcher([
  # (a CAST to index: a loaded integer used as an index, rules/one_hot.py)
  (UPat(GroupOp.ALU | {Ops.CONST, Ops.RANGE, Ops.SPECIAL, Ops.CAST}, dtype=dtypes.index, name="u"), index_as_int32_or_int64),
  (UPat(GroupOp.Comparison, name="u", src=(UPat.var("x"), UPat.var("y"))), compare_in_the_wider_type),
  (UPat(Ops.CAST, name="u", src=(UPat.var("x"),)), drop_cast_to_own_type),
], name="index_width")
