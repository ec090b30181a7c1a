"""Vector lanes: the inner loop part marked "vector" (rules/opt/split.py) becomes the lanes of vector values.

Stage `opt_vector` (rule set `vector_rules`). In: a kernel where one RANGE (the lane loop, n trips) carries a
("vector", n) part. Out: no node depends on that RANGE; values that did are vectors of n lanes (dtype `T.vec(n)`):
- a load whose address moves by one element per lane is one vector load from the address of lane 0 (with a validity
  per lane when it is masked); any other load is a gather (a `VECTORIZE` of one scalar load per lane);
- float and int32 `+ * - /` of vectors are vector ops, a lane-independent operand broadcast (`VECTORIZE` of one
  source); so are `<` and `!=` of float32 or int32 vectors (a `bool` vector: a mask of 0 or -1 per lane, of the
  operands' width), a select (`WHERE`) of float32 or int32 vectors, and float32 `exp2` and reciprocal, so that a
  product's epilogue (relu, GELU's tanh) stays in vector registers beside the tile; any other op reads its vector
  operands lane by lane (`GEP(vector, lane)`) and stays scalar until a vector op, a reduction or a store asks for
  all lanes, which then gets one copy per lane;
- a float sum over other loops accumulates a vector; a sum over the lane loop itself adds up its lanes at the end;
- a store of contiguous lanes is one vector store, any other a store per lane.
Values are unchanged, except that a float sum over the lane loop adds in another order.
In: no vector values (no stage before this one makes any). Out, and at every step: each vector is built from values at
fixed lanes (a load from lane 0's address, copies at lanes 0..n-1, a broadcast), so no vector depends on the lane
loop; the copies and searches of a lane (`at_lane`, `uses_lane`) rely on it and do not enter vectors.
"""
from __future__ import annotations
import functools
from rewrite import UOp, UPat, PatternMatcher, Ops, GroupOp, dtypes, splice_sinks, substitute
from rules.symbolic import terms_of
from .upcast import parts_in, at_values

VECTOR_TYPES = (dtypes.float32, dtypes.float64, dtypes.int32)   # what the C renderer declares vector types of
VECTOR_OPS = (Ops.ADD, Ops.MUL, Ops.NEG, Ops.FDIV)
MASK_TYPES = (dtypes.float32, dtypes.int32)   # lanes a comparison's mask (32-bit lanes) and a select fit


def has_vector_form(x: UOp) -> bool:
  """Whether an op on vectors is one vector op (else it reads its operands lane by lane)."""
  if x.op in VECTOR_OPS: return x.dtype.scalar in VECTOR_TYPES
  if x.op in (Ops.CMPLT, Ops.CMPNE): return x.src[0].dtype.scalar in MASK_TYPES
  if x.op in (Ops.EXP2, Ops.RECIP): return x.dtype.scalar is dtypes.float32   # (renderers/c.py: g_exp2f_x16, 1.0f/v)
  return x.op is Ops.WHERE and x.dtype.scalar in MASK_TYPES


def lane_loop(u: UOp) -> UOp | None:
  lanes = parts_in(u, "vector")
  if len(lanes) > 1: raise ValueError("a kernel has one vector loop at most")
  return lanes[0] if lanes else None


def is_vector(u: UOp) -> bool: return u.dtype.count > 1


def uses_lane(u: UOp, lane: UOp) -> bool:
  """Whether u depends on the lane loop. The search does not enter vectors (see at_lane): a store's lanes are
  decided without reading the tile of accumulators under it."""
  seen, stack = set(), [u]
  while stack:
    if (n := stack.pop()) is lane: return True
    if n in seen or is_vector(n): continue
    seen.add(n)
    stack.extend(n.src)
  return False


def at_lane(u: UOp, lane: UOp, c: int) -> UOp:
  """u's value in lane c: a lane of a vector, or u with the lane loop at c (u itself when it does not depend on it).
  The copy does not enter vector values: this stage builds every vector from values at fixed lanes (all_lanes, a
  load from lane 0's address), so no vector depends on the lane loop, and a store's lane copies need not walk the
  vector accumulators (and all their loads) under it."""
  if is_vector(u): return UOp(Ops.GEP, u.dtype.scalar, (u, UOp.const(dtypes.index, c)))
  return substitute(u, {lane: UOp.const(lane.dtype, c)}, name="opt.loops_at_values", opaque=is_vector)


def all_lanes(u: UOp, lane: UOp) -> UOp:
  """u as a vector: itself, a broadcast of a lane-independent value, or one copy per lane."""
  if u.dtype.count > 1: return u
  n = lane.src[0].arg
  if (first := at_lane(u, lane, 0)) is u: return UOp(Ops.VECTORIZE, u.dtype.vec(n), (u,))
  return UOp(Ops.VECTORIZE, u.dtype.vec(n), (first, *(at_lane(u, lane, c) for c in range(1, n))))


def contiguous_base(idx: UOp, lane: UOp) -> UOp | None:
  """idx at lane 0 when idx moves by exactly one element per lane (and the lane appears nowhere else)."""
  terms = terms_of(idx)
  if sum(k for t, k in terms if t is lane) != 1 or any(t is not lane and t is not None and uses_lane(t, lane) for t, _ in terms): return None
  return at_values(idx, {lane: UOp.const(lane.dtype, 0)})


# ---- the rules' right-hand sides (ctx: OptContext; ctx.lane is the lane loop, met first: rewriting is bottom-up) ----
def find_lane_loop(ctx, r: UOp) -> None:
  if lane_loop(r) is r: ctx.lane = r


def vector_load(ctx, ld: UOp, buf: UOp, idx: UOp) -> UOp | None:
  """A load of contiguous lanes is one vector load. A masked one (padding) keeps one validity per lane, or one for all
  lanes when the mask does not depend on the lane: `LOAD(index of lane 0, *valid)`; the renderer loads the vector
  at once when every lane is valid and lane by lane otherwise."""
  if ld.dtype not in VECTOR_TYPES or not uses_lane(idx, ctx.lane) or (base := contiguous_base(idx, ctx.lane)) is None: return None
  valid = ld.src[1:]
  if valid and uses_lane(valid[0], ctx.lane): valid = tuple(at_lane(valid[0], ctx.lane, c) for c in range(ctx.lane.src[0].arg))
  return UOp(Ops.LOAD, ld.dtype.vec(ctx.lane.src[0].arg), (ld.src[0].replace(src=(buf, base)), *valid))


def gather_load(ctx, ld: UOp) -> UOp | None:
  if ld.dtype not in VECTOR_TYPES or ctx.lane is None or not uses_lane(ld, ctx.lane): return None
  return all_lanes(ld, ctx.lane)


def vector_alu(ctx, x: UOp) -> UOp | None:
  if x.dtype.count > 1 or not any(s.dtype.count > 1 for s in x.src) or not has_vector_form(x): return None
  return x.replace(dtype=x.dtype.vec(ctx.lane.src[0].arg), src=tuple(all_lanes(s, ctx.lane) for s in x.src))


def read_lane_by_lane(ctx, x: UOp) -> UOp | None:
  """An op with no vector form reads its vector operands at the lane loop's index: it stays a scalar of the lane."""
  if x.dtype.count > 1 or not any(s.dtype.count > 1 for s in x.src) or has_vector_form(x): return None
  return x.replace(src=tuple(UOp(Ops.GEP, s.dtype.scalar, (s, ctx.lane)) if s.dtype.count > 1 else s for s in x.src))


def vector_reduce(ctx, red: UOp) -> UOp | None:
  """A float sum of lane-dependent values accumulates a vector; other reductions stay scalars of the lane."""
  lane, value = ctx.lane, red.src[0]
  if lane is None or red.dtype.count > 1 or lane in red.src[1:] or red.arg is not Ops.ADD or red.dtype not in VECTOR_TYPES[:2]: return None
  if value.dtype.count == 1 and not uses_lane(value, lane): return None
  vec = all_lanes(value, lane)
  return UOp(Ops.REDUCE, vec.dtype, (vec, *red.src[1:]), red.arg)


def sum_over_lanes(ctx, red: UOp) -> UOp | None:
  """A sum over the lane loop itself: accumulate vectors over the other loops, then add up the lanes."""
  lane = ctx.lane
  if lane is None or lane not in red.src[1:] or red.arg is not Ops.ADD or red.dtype not in VECTOR_TYPES[:2]: return None
  rest = tuple(r for r in red.src[1:] if r is not lane)
  vec = all_lanes(red.src[0], lane)
  acc = UOp(Ops.REDUCE, vec.dtype, (vec, *rest), red.arg) if rest else vec
  return functools.reduce(lambda a, b: a + b, (at_lane(acc, lane, c) for c in range(lane.src[0].arg)))


def reduce_lane_by_lane(ctx, red: UOp) -> UOp | None:
  """Any other reduction over the lane loop: one reduction per lane, combined."""
  lane = ctx.lane
  if lane is None or lane not in red.src[1:]: return None
  rest = tuple(r for r in red.src[1:] if r is not lane)
  values = [at_lane(red.src[0], lane, c) for c in range(lane.src[0].arg)]
  per_lane = [red.replace(src=(v, *rest)) if rest else v for v in values]
  return functools.reduce(lambda a, b: UOp(red.arg, red.dtype, (a, b)), per_lane)


def vector_store(ctx, st: UOp, buf: UOp, idx: UOp, val: UOp) -> UOp | None:
  if (lane := ctx.lane) is None or val.dtype.count == 1 and not uses_lane(st, lane): return None
  if val.dtype.scalar in VECTOR_TYPES and (base := contiguous_base(idx, lane)) is not None:
    return st.replace(src=(st.src[0].replace(src=(buf, base)), all_lanes(val, lane)))
  return None


def store_lane_by_lane(ctx, st: UOp) -> UOp | None:
  if (lane := ctx.lane) is None or not uses_lane(st, lane): return None
  return UOp(Ops.SINK, st.dtype, tuple(UOp(Ops.STORE, st.dtype, tuple(at_lane(s, lane, c) for s in st.src))
                                       for c in range(lane.src[0].arg)))


index = UPat(Ops.INDEX, src=(UPat.var("buf"), UPat.var("idx")))
vector_rules = PatternMatcher([
  (UPat(Ops.RANGE, name="r"), find_lane_loop),
  (UPat(Ops.LOAD, name="ld", src=(index,), allow_any_len=True), vector_load),
  (UPat(Ops.LOAD, name="ld"), gather_load),
  (UPat(Ops.REDUCE, name="red"), sum_over_lanes),
  (UPat(Ops.REDUCE, name="red"), reduce_lane_by_lane),
  (UPat(Ops.REDUCE, name="red"), vector_reduce),
  (UPat(Ops.REDUCE, name="x"), read_lane_by_lane),
  (UPat((*GroupOp.ALU, Ops.CAST, Ops.BITCAST), name="x"), vector_alu),
  (UPat((*GroupOp.ALU, Ops.CAST, Ops.BITCAST), name="x"), read_lane_by_lane),
  (UPat(Ops.STORE, name="st", src=(index, UPat.var("val"))), vector_store),
  (UPat(Ops.STORE, name="st"), store_lane_by_lane),
  (UPat(Ops.SINK, name="node"), splice_sinks),
], name="opt_vector")
