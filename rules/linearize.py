"""Optimization marks and linearization of a lowered kernel.

Stage `opt` (rule set `opt_rules`, ctx: `OptContext`): on the kernel's SINK, marks the outermost loop worth running
in parallel (`RANGE.arg` gains "parallel") and the innermost reduction loops a vector unit can run (`RANGE.arg`
gains "simd"). Values are unchanged; only how loops run.

Stage `linearize` (rule set `linearize_rules`): the loop-level graph `SINK(STORE...)` becomes `SINK` of an ordered
instruction list, arg "linear": each loop is `RANGE ... END(RANGE)`, each node comes after its sources, inside the
loops whose indices it uses and none nested in the innermost of them (loop-invariant work is hoisted), and each
`REDUCE` becomes `DEFINE_ACC(REDUCE)` before its loops, `ASSIGN(REDUCE)` (acc = acc op value) at the end of its
innermost loop, and the REDUCE itself (its result) after the loops. Reductions over the same loops (an unrolled
tile) share one loop.
Rules: `start_kernel_block` wraps each statement in a BLOCK naming the chain of loops it runs in (`loop_chains`);
in each block, `open_reduction_loop` gathers a reduction's loop into one closed block (BLOCKEND) just before its
first REDUCE, behind the accumulators and what they need, and `nest_loops_after_statements` gathers every other
loop after the block's statements; `flatten_kernel_block` lays the finished top block out as the instruction list.
"""
from __future__ import annotations
import itertools
from typing import Iterator
from dataclasses import dataclass
from rewrite import UOp, UPat, PatternMatcher, Ops, substitute
from .symbolic import terms_of


def open_ranges(sink: UOp) -> dict[UOp, frozenset[UOp]]:
  """For each node, the loops it lies inside: the RANGEs it depends on, less those its REDUCEs closed."""
  out: dict[UOp, frozenset[UOp]] = {}
  for n in sink.toposort:
    if n.op is Ops.RANGE: out[n] = frozenset({n}); continue
    rs = frozenset().union(*(out[s] for s in n.src)) if n.src else frozenset()
    if n.op is Ops.REDUCE: rs = rs - set(n.src[1:])
    out[n] = rs
  return out


def nesting_key(r: UOp) -> tuple:
  """Output loops nest in axis order, outside reduction loops, which nest in order of creation. A reduction loop
  moved among the output loops ("acc", by accumulate_in_memory) has a fractional axis position."""
  kind, n = r.arg[0], r.arg[1]
  return (0, n) if kind in ("out", "acc") else (1, n)


def loop_work(r: UOp, ranges: dict[UOp, frozenset[UOp]]) -> int:
  """Iterations of r and every loop nested in it."""
  work = r.src[0].arg
  inner = {q for n, rs in ranges.items() if r in rs for q in rs if nesting_key(q) > nesting_key(r)}
  for q in inner: work *= q.src[0].arg
  return work


# ---- reductions that read across rows accumulate in the output instead ----
def _coefficient(index: UOp, r: UOp) -> int:
  """How far the flat index moves when loop r steps by one (0 if it does not depend on r linearly)."""
  return sum(k for t, k in terms_of(index) if t is r)


def accumulate_in_memory(ctx: OptContext, store: UOp, idx: UOp, value: UOp) -> UOp | None:
  """out[i, j] = g(sum_k f(i, j, k)) with loops i, j, k becomes loops i, k, j with out[i, j] holding the partial sum,
  when the innermost output loop j walks memory contiguously and the reduction does not (a matrix product, a
  convolution): the inner loop then streams rows and vectorizes. The first k reads nothing, the last applies g."""
  if not ctx.parallel: return None
  reduces = [n for n in value.toposort if n.op is Ops.REDUCE]
  if len(reduces) != 1 or idx.dtype.base is not reduces[0].dtype: return None
  red = reduces[0]
  if red.arg not in (Ops.ADD, Ops.MAX) or not red.dtype.is_float: return None
  outs = sorted((n for n in idx.toposort if n.op is Ops.RANGE and n.arg[0] == "out"), key=nesting_key)
  if not outs or any(n.op is Ops.RANGE and n.arg[0] == "acc" for n in value.toposort): return None
  j, ks = outs[-1], red.src[1:]
  loads = [n.src[0].src[1] for n in red.src[0].toposort if n.op is Ops.LOAD]
  streams_j = any(_coefficient(i, j) == 1 for i in loads)
  short_or_strided = ks[-1].src[0].arg < 32 or any(_coefficient(i, ks[-1]) not in (0, 1) for i in loads)
  if not (streams_j and short_or_strided) or any(_coefficient(i, ks[-1]) == 1 and _coefficient(i, j) not in (0, 1) for i in loads): return None
  pos = j.arg[1]
  moved = {k: k.replace(arg=("acc", pos - 1 + (m + 1) / (len(ks) + 1), k.arg)) for m, k in enumerate(ks)}
  # j gets a loop of its own inside the moved ones: another store of this kernel may share the old j
  moved[j] = j.replace(arg=j.arg + (("inside", ks[-1].arg),))
  val, idx, value = (substitute(u, moved, "opt.move") for u in (red.src[0], idx, value))
  red = next(n for n in value.toposort if n.op is Ops.REDUCE)
  not_first, not_last = None, None
  for k in (moved[k] for k in ks):
    nf, nl = k.ne(0), k.ne(k.src[0].arg - 1)
    not_first = nf if not_first is None else not_first | nf
    not_last = nl if not_last is None else not_last | nl
  identity = UOp.const(red.dtype, 0.0 if red.arg is Ops.ADD else float("-inf"))
  before = not_first.where(UOp(Ops.LOAD, red.dtype, (idx, not_first)), identity)
  partial = UOp(red.arg, red.dtype, (before, val))
  if value is red: return store.replace(src=(idx, partial))
  final = substitute(value, {red: partial}, "opt.move")
  return store.replace(src=(idx, not_last.where(partial, final)))


# ---- dot products: a tile of outputs shares its loads ----
UPCAST = 4


def upcast_outputs(ctx: OptContext, sink: UOp) -> UOp | None:
  """A store of a reduction along contiguous memory (a dot product: x @ w.T, q @ k.T) computes a tile of UPCAST x
  UPCAST outputs at once: each output loop that some load does not depend on is split into loop*UPCAST + copy, and
  the copies, sharing the reduction loop, share the loads that do not move with them (hash-consing merges them)."""
  if not ctx.parallel or sink.arg == "linear" or any(n.op is Ops.RANGE and "up" in n.arg for n in sink.toposort): return None
  stores = []
  for st in sink.src:
    reduces = [n for n in st.src[1].toposort if n.op is Ops.REDUCE] if st.op is Ops.STORE else []
    tiled = _tile(st, reduces[0]) if len(reduces) == 1 else None
    stores += tiled if tiled else [st]
  return None if len(stores) == len(sink.src) else sink.replace(src=tuple(stores))


def _tile(st: UOp, red: UOp) -> list[UOp] | None:
  if red.arg is not Ops.ADD or not red.dtype.is_float or any(r.arg[0] != "reduce" for r in red.src[1:]): return None
  loads = [n.src[0].src[1] for n in red.src[0].toposort if n.op is Ops.LOAD]
  k = red.src[-1]
  if not any(_coefficient(i, k) == 1 for i in loads): return None
  outs = sorted((n for n in st.src[0].toposort if n.op is Ops.RANGE and n.arg[0] == "out"), key=nesting_key)
  chosen = [r for r in outs if r.src[0].arg % UPCAST == 0 and r.src[0].arg >= 2 * UPCAST and
            any(r not in i.toposort for i in loads)][-2:]
  if not chosen: return None
  split = {r: UOp(Ops.RANGE, r.dtype, (UOp.const(r.dtype, r.src[0].arg // UPCAST),), r.arg + ("up",)) for r in chosen}
  tiles = []
  for copies in itertools.product(range(UPCAST), repeat=len(chosen)):
    sub = {r: split[r] * UPCAST + c for r, c in zip(chosen, copies)}
    tiles.append(substitute(st, sub, "opt.upcast"))
  return tiles


@dataclass
class OptContext:
  parallel_threshold: int = 1 << 15   # iterations below which starting threads costs more than it saves
  parallel: bool = True               # a device whose loops become thread indices has no use for the mark


def mark_loops(ctx: OptContext, sink: UOp) -> UOp | None:
  if any(n.op is Ops.RANGE and len(n.arg) > 2 and n.arg[-1] in ("parallel", "simd", "serial") for n in sink.toposort): return None
  ranges = open_ranges(sink)
  marks: dict[UOp, str] = {}
  all_ranges = [n for n in sink.toposort if n.op is Ops.RANGE]
  for r in all_ranges:
    outer = {q for n, rs in ranges.items() if r in rs for q in rs if nesting_key(q) < nesting_key(r)}
    if not outer and r.arg[0] == "out" and ctx.parallel and loop_work(r, ranges) >= ctx.parallel_threshold: marks[r] = "parallel"
  for red in (n for n in sink.toposort if n.op is Ops.REDUCE):
    rs = red.src[1:]
    inner_loops = {q for n, qs in ranges.items() if rs[-1] in qs for q in qs if nesting_key(q) > nesting_key(rs[-1])}
    if red.dtype.is_float and not inner_loops and red.arg in (Ops.ADD, Ops.MAX): marks[rs[-1]] = "simd"
  if not marks: marks = {all_ranges[0]: "serial"} if all_ranges else {}
  if not marks: return None
  swap = {r: r.replace(arg=r.arg + (m,)) for r, m in marks.items()}
  return substitute(sink, swap, "opt.mark")


opt_rules = PatternMatcher([
  (UPat(Ops.STORE, name="store", src=(UPat(Ops.INDEX, name="idx"), UPat.var("value"))), accumulate_in_memory),
  (UPat(Ops.SINK, name="sink"), upcast_outputs),
  (UPat(Ops.SINK, name="sink"), lambda ctx, sink: None if sink.arg == "linear" else mark_loops(ctx, sink)),
], name="opt")


# ---- linearization: loop blocks, built, placed and closed by rules ----

def loop_chains(sink: UOp) -> dict[UOp, tuple[UOp, ...]]:
  """For each node, the chain of loops it runs inside, outermost first. Loops form a tree: a loop sits inside the
  deepest loop that encloses any node inside it, so a node runs inside every loop of the chain down to its innermost
  loop, even one whose index it does not use (x[i, k] of a loop nest i, j, k is read inside j: loop k exists once).
  A reduction's loops sit inside the loops of its REDUCE (sum_k x[i] runs k inside i, though no node uses both).
  Loops nest by `nesting_key`, and loops of equal key in order of appearance."""
  ranges = open_ranges(sink)
  order = {r: (nesting_key(r), i) for i, r in enumerate(n for n in sink.toposort if n.op is Ops.RANGE)}
  # the loops each node runs in, and each reduction's loops with those of its REDUCE (the SINK, inside every loop,
  # says nothing about their nesting)
  facts = dict.fromkeys(rs for n, rs in ranges.items() if n.op is not Ops.SINK)
  facts.update(dict.fromkeys(ranges[n].union(n.src[1:]) for n in ranges if n.op is Ops.REDUCE))
  parent: dict[UOp, UOp | None] = {}
  for rs in facts:
    nest = sorted(rs, key=order.__getitem__)
    for outer, r in zip((None, *nest), nest):
      if r not in parent or (outer is not None and (parent[r] is None or order[outer] > order[parent[r]])):
        parent[r] = outer
  chains: dict[UOp | None, tuple[UOp, ...]] = {None: ()}
  def chain(r: UOp | None) -> tuple[UOp, ...]:
    if r not in chains: chains[r] = chain(parent[r]) + (r,)
    return chains[r]
  innermost = {rs: chain(max(rs, key=order.__getitem__)) if rs else () for rs in dict.fromkeys(ranges.values())}
  return {n: innermost[rs] for n, rs in ranges.items()}


_NOT_STATEMENTS = (Ops.CONST, Ops.RANGE, Ops.SINK)   # constants are inline, loops open with their blocks


def start_kernel_block(sink: UOp) -> UOp:
  """SINK(STORE...) -> SINK(BLOCK((), statements)): every node of the kernel is a statement, sources first, each
  inside a BLOCK naming the loops it runs in (neighbours in the same loops share one; statements outside every loop
  stand bare). Each REDUCE adds its update, ASSIGN(REDUCE), a statement of its innermost loop, listed after all
  others so that it ends that loop."""
  chains = loop_chains(sink)
  stmts = [n for n in sink.toposort if n.op not in _NOT_STATEMENTS]
  for r in [r for r in stmts if r.op is Ops.REDUCE]:
    stmts.append(update := UOp(Ops.ASSIGN, r.dtype, (r,)))
    chains[update] = chains[r.src[-1]]
  top: list[UOp] = []
  for chain, run in itertools.groupby(stmts, key=chains.__getitem__):
    if chain: top.append(UOp(Ops.BLOCK, src=tuple(run), arg=chain))
    else: top.extend(run)
  return sink.replace(src=(UOp(Ops.BLOCK, src=tuple(top), arg=()),))


def _gather(stmts: tuple[UOp, ...] | list[UOp], outer: tuple[UOp, ...], loop: UOp) -> tuple[UOp, list[UOp]]:
  """(the closed block of `loop`, inside the loops `outer`, holding the statements of every fragment of it among
  stmts; the other statements)."""
  depth = len(outer)
  body: list[UOp] = []
  rest: list[UOp] = []
  for s in stmts:
    if s.op is not Ops.BLOCK or s.arg[depth] is not loop: rest.append(s)
    elif len(s.arg) == depth + 1: body.extend(s.src)   # statements of this very loop
    else: body.append(s)                               # statements of a loop inside it: placed in there, alike
  return UOp(Ops.BLOCKEND, src=(UOp(Ops.BLOCK, src=tuple(body), arg=outer + (loop,)),)), rest


def open_reduction_loop(block: UOp) -> UOp | None:
  """The loop of a reduction whose REDUCE is a statement here opens just before its first REDUCE, behind what it needs
  from this block and one accumulator (DEFINE_ACC) per reduction: reductions over the same loops (an unrolled tile
  of outputs) share it, and a reduction's loop runs once per iteration of the loops around the REDUCE."""
  depth = len(block.arg)
  waiting = {s.arg[depth] for s in block.src if s.op is Ops.BLOCK}
  first = next((s for s in block.src if s.op is Ops.REDUCE and s.src[1] in waiting), None)
  if first is None: return None
  loop = first.src[1]
  group = [s for s in block.src if s.op is Ops.REDUCE and s.src[1] is loop]
  closed, rest = _gather(block.src, block.arg, loop)
  at = rest.index(first)
  hoisted: dict[UOp, None] = {}
  if len(group) > 1:   # what a later reduction of the group reads may come after the first REDUCE: it goes in front
    after = set(rest[at + 1:])
    hoisted = {n: None for red in group for n in red.src[0].toposort if n in after}
  accs = [UOp(Ops.DEFINE_ACC, red.dtype, (red,)) for red in group]
  return block.replace(src=(*rest[:at], *hoisted, *accs, closed, *(s for s in rest[at:] if s not in hoisted)))


def nest_loops_after_statements(block: UOp) -> UOp | None:
  """Every other loop (an output loop, or the inner loop of a reduction over several) is gathered after the block's
  statements, outermost first: its statements need those, and nothing here reads a value from inside it."""
  depth = len(block.arg)
  anchored = {s.src[1] for s in block.src if s.op is Ops.REDUCE}
  loops = {s.arg[depth]: None for s in block.src if s.op is Ops.BLOCK and s.arg[depth] not in anchored}
  if not loops: return None
  rest: tuple[UOp, ...] | list[UOp] = block.src
  closed: list[UOp] = []
  for loop in sorted(loops, key=nesting_key):
    c, rest = _gather(rest, block.arg, loop)
    closed.append(c)
  return block.replace(src=(*rest, *closed))


def flatten_kernel_block(sink: UOp, top: UOp) -> UOp:
  """SINK(BLOCK((), statements)), finished -> the linear SINK: each closed block becomes its loop, RANGE, its
  statements, END(RANGE). (Rewriting bottom-up finishes a block before its parent, and the top block last.)"""
  return UOp(Ops.SINK, sink.dtype, tuple(_flat(top)), "linear")


def _flat(block: UOp) -> Iterator[UOp]:
  for s in block.src:
    if s.op is not Ops.BLOCKEND: yield s; continue
    inner = s.src[0]
    yield inner.arg[-1]
    yield from _flat(inner)
    yield UOp(Ops.END, src=(inner.arg[-1],))


linearize_rules = PatternMatcher([
  (UPat(Ops.SINK, name="sink", src=(UPat(Ops.BLOCK, name="top"),)), flatten_kernel_block),
  (UPat(Ops.SINK, name="sink", src=UPat(Ops.STORE)), start_kernel_block),
  (UPat(Ops.BLOCK, name="block"), open_reduction_loop),
  (UPat(Ops.BLOCK, name="block"), nest_loops_after_statements),
], name="linearize")
