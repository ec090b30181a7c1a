"""Fused attention: `softmax(scores) @ values` as ONE kernel with an online softmax (no Tq x Tk buffer).

Recognized in the graph a user writes (tensor/nn.py): a matrix product `P @ V` is the sum over the last axis of
`VIEW(P) * VIEW(V)` (shape (*batch, Tq, D, Tk)), and `P = softmax(S, -1)` is `e / sum(e)` with
`e = exp2((S - max(S)) * log2(e))`. Whatever S is — `q @ k.T * scale`, plus an added mask, a masked_fill (a WHERE),
a causal mask — it stays an ordinary tensor expression that the kernel evaluates at (query row, key).

Stage `attention` (graph scope, before `realize`; rule set `attention_rules`, ctx `AttentionContext`). In: the user's
tensor graph. Out: each such product whose tiles fit becomes `REDUCE_AXIS(values, scores, arg=(OnlineSoftmax, (axis,)))`,
of the product's shape: out[..., i, d, 0] = sum_j softmax_j(scores[..., i, j]) * values[..., i, d, j]. Its scores hold
the dot product as an inner reduction; the realize stage's rule for reductions read by reductions matches one source
only, so the scores stay inline: no buffer of Tq x Tk. A product left unfused (half precision, a head dimension whose
accumulator row does not fit, probabilities read through another view) says why in the context's notes (DEBUG=2).

Stage `lower` (rule set `online_softmax_lower_rules`, in front of rules/lower.py's): the fused node, asked at
(..., i, d, 0), becomes a loop over blocks of `block` keys that carries three accumulators (running max m, sum l,
weighted sum a, all in base 2):

    m' = max(m, max_jj s_jj)      c = exp2(m - m')      p_jj = exp2(s_jj - m')
    l' = l * c + sum_jj p_jj      a' = a * c + sum_jj p_jj * v[jj, d]          result: a / l

The keys of a block are a loop marked upcast, which rules/opt/upcast.py unrolls (a register tile of keys sharing the
dot product's loop); a row entirely masked so far keeps m' = -inf, and its c and p are read against 0 (not NaN).
A carried accumulator is three loop-level nodes: `CARRY(*deps, arg=(role, initial value))` is its value at the start
of a step (deps: its loop and the values it follows, which keep copies for different outputs apart),
`NOOP(new value, CARRY)` pairs the value it takes at the end of the step with it, and `REDUCE(NOOP, loop, arg=Ops.NOOP)`
is its value after the loop. (`NOOP(x, *after)` elsewhere is x, computed after the rest: the result carries the
running max's REDUCE that way, which nothing else reads.) The linearizer needs nothing new (the CARRY lies in its
loop, before the NOOP); the renderers declare the accumulator, read it into a variable at CARRY and assign it.

The head dimension d is unrolled, so that the scores, max and sum of a row are computed once per row, not per d:
on the CPU by the kernel's plan (`attention_plan`: d in vector lanes and upcast copies, the outermost other loop on
threads, the dot product's loop `simd`), on a GPU by stage `attention_rows` (rule set `head_loop_rules`, before
stage `gpu`): one thread a query row, its accumulator row in registers. Where heads are stored side by side (a loop
of H*D), that stage splits off the inner D on the CPU too.

On the CPU that row-at-a-time kernel is what a fused attention falls back to: where its operands allow, the kernel is
rendered as the tiled kernel of renderers/attention_c.py instead (runtime/realize.py `tiled_attention`; DEBUG=2 says
which and why).
"""
from __future__ import annotations
import math
from dataclasses import dataclass, field
from rewrite import UOp, UPat, PatternMatcher, Ops, dtypes, graph_rewrite, substitute
from rewrite.env import env_flag
from .shapes import shape_of
from .strided_view import View
from .lower import LowerContext, indexed
from .opt.plan import Opt, OptKind, Plan
from .opt.upcast import upcast_rules, part_kind
from .gpu import MULTIPROCESSORS

LOG2_E = 1 / math.log(2)
BLOCK = 8              # keys per step of the online update (a register tile of dot products)
LANES, MIN_STEPS = 16, 4   # a GPU row's keys in up to 16 chunks (threads), each of at least 4 blocks
# the fused kernel is used by default, rendered as the device's tiled kernel where its operands allow
# (runtime/realize.py `tiled_attention`). CPU: always; renderers/attention_c.py (query rows x keys in registers) is as
# fast per core as the three unfused kernels (8x512x64, one thread, `bench/cpu_steps.py --only whole` alternated with
# GRAFT_ATTENTION=0: 5.86-6.09 ms against 5.82-5.92), with no T x T buffer and one parallel loop. GPU: where its query
# rows give renderers/attention_cuda.py (2 threads a row) THREADS_PER_SM threads a multiprocessor at least: its
# parallelism is the rows, the unfused products' rows x keys. H100: 32x1024x64 (65536 threads) fused 0.45 ms against 0.68 unfused; the GPT
# forward's 12 heads x 1024 causal (24576 threads) jit 7.25 ms fused against 6.70 unfused (docs/design.md)
TILED_THREADS_PER_ROW = 2
THREADS_PER_SM = 256   # threads a multiprocessor below which a GPU is not kept busy (8 warps each)
MAX_HEAD = {False: 256, True: 128}   # head dimension whose accumulator row fits, by device_loops (CPU, GPU registers)


@dataclass(frozen=True)
class OnlineSoftmax:
  """arg[0] of a fused attention node: the keys per step of its online softmax, and the chunks of keys a row is
  split into (each with its own running state, combined at the end: a GPU row's lanes)."""
  block: int
  lanes: int = 1
  def __repr__(self): return f"online_softmax(block={self.block}, lanes={self.lanes})"


@dataclass
class AttentionContext:
  """The attention stage's context: whether the device maps loops onto its threads (and its multiprocessors: the
  runtime asks the driver, rules/pipeline.py Run), and what it decided (DEBUG=2)."""
  device_loops: bool = False
  multiprocessors: int = MULTIPROCESSORS
  notes: list[str] = field(default_factory=list)
  @property
  def gpu_threads(self) -> int: return self.multiprocessors * THREADS_PER_SM
  def note(self, why: str):
    if why not in self.notes: self.notes.append(why)


# ---- recognizing softmax(S) @ V ----
def _is_log2e(u: UOp) -> bool:
  while u.op is Ops.VIEW: u = u.src[0]
  return u.op is Ops.CONST and abs(u.arg - LOG2_E) < 1e-12


def _reduced_back(view: UOp, x: UOp, op: Ops, axis: int) -> bool:
  """view is reduce(x) over `axis` (kept), broadcast back to x's shape."""
  if view.op is not Ops.VIEW or (r := view.src[0]).op is not Ops.REDUCE_AXIS or r.arg != (op, (axis,)) or r.src[0] is not x:
    return False
  return view.arg == View.contiguous(shape_of(r)).expand(shape_of(x))


def _normalized(p: UOp, last: int) -> UOp | None:
  """e when p is e divided by its sum over `last`: `e * (1 / sum(e))` (tensor/nn.py) or `e / sum(e)`; else None."""
  if p.op is Ops.FDIV and _reduced_back(p.src[1], p.src[0], Ops.ADD, last): return p.src[0]
  if p.op is not Ops.MUL: return None
  for e, r in (p.src, p.src[::-1]):
    if r.op is Ops.VIEW and r.src[0].op is Ops.RECIP and _reduced_back(r.replace(src=(r.src[0].src[0],)), e, Ops.ADD, last): return e
  return None


def softmax_scores(p: UOp) -> UOp | None:
  """S when p is softmax(S) over its last axis, as tensor/nn.py builds it; else None."""
  last = len(shape_of(p)) - 1
  if (e := _normalized(p, last)) is None or e.op is not Ops.EXP2 or e.src[0].op is not Ops.MUL: return None
  x, c = e.src[0].src if _is_log2e(e.src[0].src[1]) else e.src[0].src[::-1]
  if not _is_log2e(c) or x.op is not Ops.ADD: return None
  for s, neg in (x.src, x.src[::-1]):
    if neg.op is Ops.NEG and _reduced_back(neg.src[0], s, Ops.MAX, last): return s
  return None


def fusion_switch() -> bool | None:
  """GRAFT_ATTENTION: True fuses every attention it recognizes, False none, None (unset) every one on the CPU and on a
  GPU those with the query rows to fill it. It decides the graph, so it is part of the warm-call key
  (runtime/realize.py find_program)."""
  return env_flag("GRAFT_ATTENTION", None, "fused attention (unset: on a GPU where its query rows fill the GPU)")


def fuse_attention(ctx: AttentionContext, r: UOp, prod: UOp) -> UOp | None:
  """sum_j P[..., i, j] * V[..., j, d] with P = softmax(S): one node of an online softmax, where its tiles fit."""
  for pv, values in (prod.src, prod.src[::-1]):
    if pv.op is Ops.VIEW and (scores := softmax_scores(pv.src[0])) is not None: break
  else: return None
  shape, p_shape = shape_of(prod), shape_of(pv.src[0])
  *batch, tq, d, tk = shape
  what = f"softmax(scores {p_shape}) @ values (head dimension {d})"
  expected = View.contiguous(p_shape).reshape((*p_shape[:-1], 1, p_shape[-1]))
  if len(shape) < 3 or expected is None or tuple(p_shape) != (*batch, tq, tk) or pv.arg != expected.expand(shape):
    ctx.note(f"attention not fused: {what}: the probabilities are read through a view other than a matrix product's")
    return None
  if r.dtype is not dtypes.float32 or scores.dtype is not dtypes.float32:
    ctx.note(f"attention not fused: {what}: {r.dtype.name} (only float32 has a fused kernel so far); three kernels instead")
    return None
  if d > MAX_HEAD[ctx.device_loops]:
    ctx.note(f"attention not fused: {what}: a row of {d} accumulators does not fit "
             f"({'registers of a GPU thread' if ctx.device_loops else 'the register tile'}: at most {MAX_HEAD[ctx.device_loops]}); three kernels instead")
    return None
  rows = math.prod(batch) * tq
  if (force := fusion_switch()) is False:
    ctx.note(f"attention not fused: {what}: GRAFT_ATTENTION=0; three kernels instead")
    return None
  if force is None and ctx.device_loops and rows * TILED_THREADS_PER_ROW < ctx.gpu_threads:
    ctx.note(f"attention not fused: {what}: its {rows} query rows give the GPU's fused kernel {rows * TILED_THREADS_PER_ROW} "
             f"threads, under the {ctx.gpu_threads} that keep a GPU busy (GRAFT_ATTENTION=1 fuses it); three kernels "
             f"instead")
    return None
  block = min(BLOCK, tk)
  lanes = gpu_lanes(-(-tk // block), math.prod(batch) * tq, ctx.gpu_threads) if ctx.device_loops else 1
  ctx.note(f"attention fused: {what} is one kernel, an online softmax over blocks of {block} keys"
           f"{f' in {lanes} chunks a row' if lanes > 1 else ''} (no {tq}x{tk} buffer)")
  return UOp(Ops.REDUCE_AXIS, r.dtype, (values, scores), (OnlineSoftmax(block, lanes), r.arg[1]))


def gpu_lanes(steps: int, rows: int, gpu_threads: int) -> int:
  """Chunks of keys a GPU row is split into: one (a thread a row, the warp's loads of keys and values the same address:
  one transaction) unless the rows are too few to give the GPU `gpu_threads` threads; then up to LANES, each chunk at
  least MIN_STEPS blocks of keys long."""
  lanes = 1
  while lanes < LANES and steps >= 2 * lanes * MIN_STEPS and rows * lanes < gpu_threads: lanes *= 2
  return lanes


attention_rules = PatternMatcher([
  (UPat(Ops.REDUCE_AXIS, name="r", src=(UPat(Ops.MUL, name="prod"),)),
   lambda ctx, r, prod: fuse_attention(ctx, r, prod) if r.arg == (Ops.ADD, (len(shape_of(prod)) - 1,)) else None),
], name="attention")


# ---- lowering: the online softmax loop ----
def carried(dtype, arg: tuple, *deps: UOp) -> UOp: return UOp(Ops.CARRY, dtype, deps, arg)


def carry(value: UOp, acc: UOp, loop: UOp) -> UOp:
  """The accumulator `acc` (a CARRY) takes `value` at the end of each step of `loop`; its value after the loop."""
  return UOp(Ops.REDUCE, value.dtype, (UOp(Ops.NOOP, value.dtype, (value, acc)), loop), Ops.NOOP)


def lower_online_softmax(ctx: LowerContext, i: UOp, r: UOp, values: UOp, scores: UOp) -> UOp:
  osm, (axis,) = r.arg
  tk, block, lanes, dt = shape_of(values)[axis], osm.block, osm.lanes, r.dtype
  idxs = list(i.src[1:])   # (*batch, query row, d, 0)
  steps = -(-tk // block)
  per_lane = -(-steps // lanes)
  def reduce_loop(n: int, *tags) -> UOp:
    return UOp(Ops.RANGE, dtypes.index, (UOp.const(dtypes.index, n),), ("reduce", *tags))
  # the keys: `lanes` chunks (each its own running state, combined at the end), each a loop over blocks of keys (a
  # loop even of one step: one form of kernel for any length), each block an unrolled tile
  lane = reduce_loop(lanes, next(ctx.reduce_ranges)) if lanes > 1 else UOp.const(dtypes.index, 0)
  outer = reduce_loop(per_lane, next(ctx.reduce_ranges))
  inner = reduce_loop(block, (1, next(ctx.reduce_ranges)), ("upcast", block)) if block > 1 else UOp.const(dtypes.index, 0)
  key = (lane * per_lane + outer) * block + inner
  inf, zero = UOp.const(dt, -math.inf), UOp.const(dt, 0)
  valid = key < tk if lanes * per_lane * block != tk else None   # keys past the end: masked, their reads clamped
  if valid is not None: key = valid.where(key, UOp.const(dtypes.index, tk - 1))
  s = indexed(scores, [*idxs[:-2], key]) * LOG2_E
  if valid is not None: s = valid.where(s, inf)
  v = indexed(values, [*idxs[:-1], key])
  over = lambda x, op, loop: UOp(Ops.REDUCE, dt, (x, loop), op) if loop.op is Ops.RANGE else x
  safe = lambda m: m.ne(inf).where(m, zero)   # a row masked so far: exp2(-inf - 0) = 0, not NaN
  block_max = over(s, Ops.MAX, inner)
  m = carried(dt, ("max", -math.inf), outer, block_max)
  m_new = m.maximum(block_max)
  c, p = UOp(Ops.EXP2, dt, (m - safe(m_new),)), UOp(Ops.EXP2, dt, (s - safe(m_new),))
  block_sum, block_acc = over(p, Ops.ADD, inner), over(p * v, Ops.ADD, inner)
  l, a = carried(dt, ("sum", 0.0), outer, block_max), carried(dt, ("acc", 0.0, shape_of(values)[-2]), outer, block_acc)
  m_end, l_end, a_end = carry(m_new, m, outer), carry(l * c + block_sum, l, outer), carry(a * c + block_acc, a, outer)
  if lanes == 1: return UOp(Ops.NOOP, dt, (a_end / l_end, m_end))   # the running max is updated each step too
  # the chunks' states combined: each rescaled to the largest running max of the row
  w = UOp(Ops.EXP2, dt, (m_end - safe(over(m_end, Ops.MAX, lane)),))
  return over(a_end * w, Ops.ADD, lane) / over(l_end * w, Ops.ADD, lane)


online_softmax_lower_rules = PatternMatcher([
  (UPat(Ops.INDEXED, name="i", src=(UPat(Ops.REDUCE_AXIS, name="r", src=(UPat(name="values"), UPat(name="scores"))),),
        allow_any_len=True),
   lambda ctx, i, r, values, scores: lower_online_softmax(ctx, i, r, values, scores) if isinstance(r.arg[0], OnlineSoftmax) else None),
], name="lower_online_softmax")


# ---- the head dimension, unrolled: which loop is it ----
def carried_reductions(sink: UOp) -> list[UOp]:
  return [n for n in sink.toposort if n.op is Ops.REDUCE and n.arg is Ops.NOOP]


def head_size(sink: UOp) -> int | None:
  """D of a fused attention kernel (its weighted sum's CARRY records it), None for any other kernel."""
  return next((n.arg[2] for n in sink.toposort if n.op is Ops.CARRY and n.arg[0] == "acc"), None)


def _role(red: UOp) -> str: return red.src[0].src[1].arg[0]


def split_head(r: UOp, d: int, parts: tuple[tuple[str, int], ...]) -> UOp:
  """r as outer * d + the inner D as loop parts, innermost first: ("vector", lanes), ("upcast", copies) (the parts
  rules/opt/split.py makes, which rules/opt/upcast.py and vector.py carry out)."""
  n, inner, step = r.src[0].arg, UOp.const(r.dtype, 0), 1
  for level, (kind, amount) in enumerate(parts, 1):
    inner = inner + UOp(Ops.RANGE, r.dtype, (UOp.const(r.dtype, amount),), ("out", (len(parts) + 1 - level, r.arg[1]), (kind, amount))) * step
    step *= amount
  return (r.replace(src=(UOp.const(r.dtype, n // d),)) * d if n > d else UOp.const(r.dtype, 0)) + inner


def head_parts(d: int, device_loops: bool) -> tuple[tuple[str, int], ...]:
  """How the head dimension is unrolled: on a GPU into D copies; on the CPU into vector lanes (the widest that divides
  D) and copies of them."""
  from .opt.heuristic import vector_width
  if device_loops: return (("upcast", d),)
  width = vector_width(4)
  while width > 1 and d % width: width //= 2
  return tuple(p for p in (("vector", width), ("upcast", d // width)) if p[1] > 1)


def head_loop(sink: UOp) -> UOp | None:
  """The output loop whose inner D steps along the head dimension: the weighted sums depend on its inner part, the
  running sums do not (a loop of D, or of H*D where heads are stored side by side: the sums read its outer part).
  Found by trying: the loop split, the running sum simplified (rules/symbolic.py) must no longer read the inner part."""
  from .symbolic import symbolic_rules
  if (d := head_size(sink)) is None: return None
  sums = [red for red in carried_reductions(sink) if _role(red) == "sum"]
  accs = [red for red in carried_reductions(sink) if _role(red) == "acc"]
  for r in (n for n in accs[0].toposort if n.op is Ops.RANGE and n.arg[0] == "out" and n.src[0].arg % d == 0
            and part_kind(n) is None):   # not a part of a loop split already
    split = split_head(r, d, (("upcast", d),))
    inner = next(n for n in split.toposort if n.op is Ops.RANGE and n.arg[-1] == ("upcast", d))
    if not any(inner in graph_rewrite(substitute(red, {r: split}), symbolic_rules, name="attention.head_probe").toposort for red in sums):
      return r
  return None


def split_head_loop(ctx: AttentionContext, sink: UOp) -> UOp | None:
  """The head loop's inner D (a loop of D, or the inner D of H*D where heads are stored side by side) becomes unrolled
  parts, whatever the plan, so that a row's scores, running max and sum are computed once for its whole row of
  accumulators (the loop over keys then nests in the same loops for all of them). On the CPU: vector lanes and copies,
  carried out by the opt stages. On a GPU: copies, unrolled here, before the grid is planned (a thread holds its row
  of accumulators in registers), and so are the scores' own reductions (the dot product over d: the query row's
  loads leave the loop over keys)."""
  from .symbolic import symbolic_rules
  if (h := head_loop(sink)) is None: return None
  d = head_size(sink)
  swap = {h: split_head(h, d, head_parts(d, ctx.device_loops))}
  if ctx.device_loops:
    inside = {n for red in carried_reductions(sink) for n in red.src[0].toposort}
    swap.update({r: r.replace(arg=(*r.arg, ("upcast", r.src[0].arg))) for red in inside if red.op is Ops.REDUCE and red.arg is not Ops.NOOP
                 for r in red.src[1:] if part_kind(r) is None and r.src[0].arg <= MAX_HEAD[True]})
  sink = substitute(sink, swap)
  if ctx.device_loops: sink = graph_rewrite(sink, upcast_rules, name="attention_rows")
  return graph_rewrite(sink, symbolic_rules, name="attention_rows")


head_loop_rules = PatternMatcher([(UPat(Ops.SINK, name="sink"), split_head_loop)], name="attention_rows")


# ---- the GPU grid of a fused attention kernel ----
def lane_loops(sink: UOp) -> list[UOp]:
  """The loop over a row's chunks of keys: the loop of the reductions that combine the chunks' carried states."""
  reads_carried = set(carried_reductions(sink))   # grows, sources first, to every node over a carried reduction
  lanes: dict[UOp, None] = {}
  for n in sink.toposort:
    if n.op is Ops.REDUCE and n.arg is not Ops.NOOP and n.src[0] in reads_carried: lanes.update(dict.fromkeys(n.src[1:]))
    if any(s in reads_carried for s in n.src): reads_carried.add(n)
  return list(lanes)


def attention_grid_plan(sink: UOp, loops: list[UOp]) -> Plan | None:
  """A GPU plan: the query rows on the grid, a row's chunks of keys its lanes (a reduction spread over them, combined at
  the end), several rows a block (None for any other kernel, and for one chunk a row, which the default plan maps to
  one thread a row)."""
  from .gpu import ROW_GROUP_THREADS
  if not carried_reductions(sink) or len(lanes := lane_loops(sink)) != 1: return None
  axis, n = {r: i for i, r in enumerate(loops)}, lanes[0].src[0].arg
  return Plan((*(Opt(OptKind.GLOBAL, axis[r]) for r in loops if r.arg[0] == "out"), Opt(OptKind.GROUP, axis[lanes[0]], n),
               *((Opt(OptKind.LOCAL, -1, ROW_GROUP_THREADS // n),) if n < ROW_GROUP_THREADS else ())), "attention")


# ---- vector lanes of a carried accumulator (CPU: the head loop's lanes; in front of rules/opt/vector.py's) ----
def _vector_of(x: UOp, value: UOp) -> UOp | None:
  return x.replace(dtype=value.dtype) if x.dtype.count == 1 and value.dtype.count > 1 else None


carry_vector_rules = PatternMatcher([
  # an accumulator row in lanes: what it follows is a vector, so is it
  (UPat(Ops.CARRY, name="x"), lambda x: next((x.replace(dtype=s.dtype) for s in x.src if s.dtype.count > 1 and x.dtype.count == 1), None),
   "carry_vector"),
  (UPat(Ops.NOOP, name="x"), lambda x: _vector_of(x, x.src[0]), "value_after_vector"),
  (UPat(Ops.REDUCE, name="x", arg=Ops.NOOP), lambda x: _vector_of(x, x.src[0]), "carried_reduce_vector"),
], name="opt_vector_carry")


# ---- the CPU plan of a fused attention kernel ----
def attention_plan(sink: UOp, axes: list[UOp]) -> Plan | None:
  """The plan of a fused attention kernel on the CPU (None for any other kernel): the outermost output loop on threads
  and the dot product's loop `simd` (the head dimension's lanes and copies are parts of its loop already: stage
  attention_rows)."""
  if head_size(sink) is None: return None
  axis = {r: n for n, r in enumerate(axes)}
  untouched = [r for r in axes if part_kind(r) is None]   # not a part of a split loop
  carry_loops = {r for red in carried_reductions(sink) for r in red.src[1:]} | set(lane_loops(sink))
  opts = [Opt(OptKind.PARALLEL, axis[r]) for r in untouched if r.arg[0] == "out"][:1]
  opts += [Opt(OptKind.SIMD, axis[r]) for r in untouched if r.arg[0] == "reduce" and r not in carry_loops]
  return Plan(tuple(opts), "attention")
