"""Symbolic simplification: constant folding, algebraic identities, and range-aware `//` and `%`.

Contract: the result computes the same values as the input for every value of its variables within their bounds
(`vmin`/`vmax` of each UOp), with C semantics for integer `//` and `%` (truncation toward zero). Index arithmetic
comes out as sums of `term * constant`, with divisions and remainders removed wherever the bounds allow.
"""
from __future__ import annotations
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp, dtypes

x, y, z = UPat.var("x"), UPat.var("y"), UPat.var("z")
c1, c2 = UPat.cvar("c1"), UPat.cvar("c2")
ints = tuple(d for d in dtypes.all() if d.is_int)
xi = UPat.var("x", dtype=ints)


def _c_div(a: int, b: int) -> int: q = abs(a) // abs(b); return q if (a >= 0) == (b > 0) else -q
def _c_mod(a: int, b: int) -> int: return a - b * _c_div(a, b)


def _wrap(dtype, v):
  """A value wrapped to the width of an integer dtype, as the C code computes it."""
  if not dtype.is_int: return v
  bits = 8 * dtype.itemsize
  v &= (1 << bits) - 1
  return v - (1 << bits) if not dtype.is_unsigned and v >= 1 << (bits - 1) else v


_FOLD = {
  Ops.ADD: lambda a, b: a + b, Ops.MUL: lambda a, b: a * b, Ops.MAX: max,
  Ops.IDIV: lambda a, b: _c_div(a, b) if b != 0 else None, Ops.MOD: lambda a, b: _c_mod(a, b) if b != 0 else None,
  Ops.CMPLT: lambda a, b: a < b, Ops.CMPNE: lambda a, b: a != b,
  Ops.AND: lambda a, b: a & b, Ops.OR: lambda a, b: a | b, Ops.XOR: lambda a, b: a ^ b,
  Ops.SHL: lambda a, b: a << b if 0 <= b < 64 else None, Ops.SHR: lambda a, b: a >> b if 0 <= b < 64 else None,
  Ops.NEG: lambda a: -a, Ops.WHERE: lambda c, a, b: a if c else b,
}


def fold_constants(u: UOp) -> UOp | None:
  # integer and boolean arithmetic only: float folding in Python (double) could differ from the target's float32
  if not (u.dtype.is_int or u.dtype.is_bool) or any(s.op is not Ops.CONST for s in u.src): return None
  if u.op is Ops.WHERE: return u.src[1] if u.src[0].arg else u.src[2]
  if any(not (s.dtype.is_int or s.dtype.is_bool) for s in u.src) or (f := _FOLD.get(u.op)) is None: return None
  v = f(*(s.arg for s in u.src))
  return None if v is None else UOp.const(u.dtype, _wrap(u.dtype, v) if u.dtype.is_int else v)


def fold_by_bounds(u: UOp) -> UOp | None:
  """An integer or boolean node whose bounds say it has one value is that constant."""
  if u.op is Ops.CONST or u.op in (Ops.LOAD, Ops.DEFINE_GLOBAL, Ops.INDEX) or not (u.dtype.is_int or u.dtype.is_bool): return None
  lo, hi = u.vmin, u.vmax
  return UOp.const(u.dtype, lo) if lo == hi and lo is not None else None


# ---- sums of terms: divisions and remainders by constants ----
def terms_of(u: UOp) -> list[tuple[UOp | None, int]]:
  """u as a sum of (term, coefficient); the constant part has term None."""
  out, stack = [], [(u, 1)]
  while stack:
    n, k = stack.pop()
    if n.op is Ops.ADD: stack += [(s, k) for s in n.src]
    elif n.op is Ops.CONST: out.append((None, n.arg * k))
    elif n.op is Ops.MUL and n.src[1].op is Ops.CONST: stack.append((n.src[0], k * n.src[1].arg))
    else: out.append((n, k))
  return out


def sum_of(dtype, terms: list[tuple[UOp | None, int]]) -> UOp:
  const = sum(k for t, k in terms if t is None)
  parts = [t if k == 1 else t * k for t, k in terms if t is not None and k != 0]
  out = parts[0] if parts else UOp.const(dtype, const)
  for p in parts[1:]: out = out + p
  return out + const if parts and const else out


def divide_terms(u: UOp, num: UOp, c: int, want_mod: bool) -> UOp | None:
  """(sum of terms) // c or % c, when the terms not divisible by c stay within one period of c."""
  if c <= 0 or num.vmin < 0: return None
  terms = terms_of(num)
  whole = [(t, k // c) for t, k in terms if k % c == 0]
  rest = [(t, k) for t, k in terms if k % c != 0]
  if len(terms) == 1 and not whole: return None  # nothing to split off: only bounds can help (fold_by_bounds)
  if rest:
    lo = sum((k * (t.vmin if k > 0 else t.vmax)) if t is not None else k for t, k in rest)
    hi = sum((k * (t.vmax if k > 0 else t.vmin)) if t is not None else k for t, k in rest)
    if lo < 0 or lo // c != hi // c:
      # still split off the multiples of c when the rest is non-negative: (a*c + b) // c = a + b // c
      if lo < 0 or not whole or all(t is None for t, _ in whole): return None
      rest_sum = sum_of(num.dtype, rest)
      if want_mod: return UOp(Ops.MOD, u.dtype, (rest_sum, UOp.const(u.dtype, c)))
      return sum_of(num.dtype, whole) + UOp(Ops.IDIV, u.dtype, (rest_sum, UOp.const(u.dtype, c)))
    q = lo // c
  else: q = 0
  if want_mod: return sum_of(num.dtype, rest + [(None, -q * c)]) if rest else UOp.const(u.dtype, 0)
  return sum_of(num.dtype, whole + [(None, q)])


def simplify_mod(u: UOp, a: UOp, c: int) -> UOp | None:
  if c > 0 and a.vmin >= 0 and a.vmax < c: return a
  return divide_terms(u, a, c, want_mod=True)


def combine_terms(u: UOp) -> UOp | None:
  """Collect like terms of an integer sum: x*2 + x*3 + 4 + 1 -> x*5 + 5."""
  terms = terms_of(u)
  merged: dict[UOp | None, int] = {}
  for t, k in terms: merged[t] = merged.get(t, 0) + k
  if len(merged) == len(terms) and sum(1 for t, _ in terms if t is None) <= 1: return None
  out = sum_of(u.dtype, [(t, k) for t, k in merged.items() if k != 0 or t is None])
  return None if out is u else out


def drop_cast_to_own_type(u: UOp, x: UOp) -> UOp | None:
  """A cast to the type its value already has is the value (index_width's int32/int64 typing makes these too)."""
  return x if u.dtype is x.dtype else None


symbolic_rules = PatternMatcher([
  # constant folding (integers and booleans)
  (UPat(GroupOp.ALU, name="u", src=UPat(Ops.CONST)), fold_constants),
  # identities
  (xi + 0, lambda x: x, "add-zero"),  # integers only: for floats, -0.0 + 0 is +0.0
  (x * 1, lambda x: x, "mul-one"),   # exact for floats too, NaN and -0.0 included
  (xi * 0, lambda x: UOp.const(x.dtype, 0), "mul-zero"),
  (x // 1, lambda x: x, "div-one"),
  (xi % 1, lambda x: UOp.const(x.dtype, 0), "mod-one"),
  (UPat(Ops.WHERE, src=(UPat.var("cond"), x, x)), lambda cond, x: x, "where-same-branches"),
  (UPat(Ops.WHERE, src=(UPat.const(dtypes.bool, True), x, y)), lambda x, y: x, "where-true"),
  (UPat(Ops.WHERE, src=(UPat.const(dtypes.bool, False), x, y)), lambda x, y: y, "where-false"),
  (UPat(Ops.AND, src=[UPat.var("x", dtypes.bool), UPat.const(dtypes.bool, True)]), lambda x: x, "and-true"),
  (UPat(Ops.CAST, name="u", src=(x,)), drop_cast_to_own_type, "cast-to-same-dtype"),
  # bounds decide
  (UPat(GroupOp.Comparison | {Ops.IDIV, Ops.MOD, Ops.ADD, Ops.MUL, Ops.AND, Ops.OR, Ops.MAX}, name="u"), fold_by_bounds),
  # index arithmetic: linear sums, and // and % that the bounds allow to remove
  (UPat(Ops.ADD, dtype=ints, name="u"), combine_terms),
  ((xi * c1) * c2, lambda x, c1, c2: x * (c1.arg * c2.arg), "mul-constants"),
  (UPat(Ops.IDIV, name="u", src=(xi, c1)), lambda u, x, c1: divide_terms(u, x, c1.arg, want_mod=False), "div-by-constant"),
  (UPat(Ops.MOD, name="u", src=(xi, c1)), lambda u, x, c1: simplify_mod(u, x, c1.arg), "mod-by-constant"),
  ((xi // c1) // c2, lambda x, c1, c2: x // (c1.arg * c2.arg) if c1.arg > 0 and c2.arg > 0 and x.vmin >= 0 else None, "div-div"),
], name="symbolic")
