"""Linearization of a lowered kernel (its loops already shaped by the opt stages, rules/opt).

Stage `linearize` (rule set `linearize_rules`): the loop-level graph `SINK(STORE...)` becomes `SINK` of an ordered
instruction list, arg "linear": each loop is `RANGE ... END(RANGE)`, each node comes after its sources, inside the
loops whose indices it uses and none nested in the innermost of them (loop-invariant work is hoisted; a reduction
and what reads it run inside the loops around its loop), and each
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
from rewrite import UOp, UPat, PatternMatcher, Ops


def open_ranges(sink: UOp) -> dict[UOp, frozenset[UOp]]:
  """For each node, the loops it lies inside: the RANGEs it depends on, less those its REDUCEs closed (and the BARRIERs
  that say a packed buffer is filled, rules/opt/pack.py: `BARRIER(buffer, fill store, *fill loops)`)."""
  out: dict[UOp, frozenset[UOp]] = {}
  none: frozenset[UOp] = frozenset()
  for n in sink.toposort:
    if n.op is Ops.RANGE: out[n] = frozenset({n}); continue
    rs = out[n.src[0]] if n.src else none
    for s in n.src[1:]:  # most nodes lie in the loops of a source: share its set instead of building an equal one
      if (more := out[s]) is not rs and not more <= rs: rs = rs | more
    if n.op is Ops.REDUCE or n.op is Ops.BARRIER: rs = rs - set(n.src[1:])
    out[n] = rs
  return out


def nesting_key(r: UOp) -> tuple:
  """Output loops nest outside reduction loops; within each kind, by (level, position): the kernel's own loops have
  level 0 and nest in axis order (reductions in order of creation); the opt stages (rules/opt) give a loop moved
  outward level -1, the inner loops of a tiling levels 1, 2, ..., and the loops filling a packed buffer a position
  just before the loop they serve (the arg's position is then a tuple (level, position, ...))."""
  kind, pos = r.arg[0], r.arg[1]
  return (1 if kind == "reduce" else 0, *(pos if isinstance(pos, tuple) else (0, pos)))


def loop_work(r: UOp, ranges: dict[UOp, frozenset[UOp]]) -> int:
  """Iterations of r and every loop nested in it."""
  work = r.src[0].arg
  inner = {q for n, rs in ranges.items() if r in rs for q in rs if nesting_key(q) > nesting_key(r)}
  for q in inner: work *= q.src[0].arg
  return work


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
  facts.update(dict.fromkeys(ranges[n].union(closed_loops(n)) for n in ranges if closed_loops(n)))
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
  # a reduction runs where its loop sits, and what reads it after it: reductions that share a loop but not the loops
  # around it (an online softmax's running max, the same for every output its weighted sums make) run together
  out: dict[UOp, tuple[UOp, ...]] = {}
  for n in sink.toposort:
    c = innermost[ranges[n]]
    deps = [chain(parent[r]) for r in closed_loops(n)[:1]] if closed_loops(n) else [out[s] for s in n.src]
    for d in deps:
      if len(d) > len(c): c = d
    out[n] = c
  return out


def closed_loops(n: UOp) -> tuple[UOp, ...]:
  """The loops a node closes, outermost first: a REDUCE's, and those of a BARRIER that waits for a packed buffer's fill
  (`BARRIER(buffer, fill store, *fill loops)`, rules/opt/pack.py). They run, whole, before the node."""
  if n.op is Ops.REDUCE: return n.src[1:]
  if n.op is Ops.BARRIER: return tuple(s for s in n.src[2:] if s.op is Ops.RANGE)
  return ()


_NOT_STATEMENTS = (Ops.CONST, Ops.RANGE, Ops.SINK)   # constants are inline, loops open with their blocks


def start_kernel_block(sink: UOp) -> UOp:
  """SINK(STORE...) -> SINK(BLOCK((), statements)): every node of the kernel is a statement, sources first, each
  inside a BLOCK naming the loops it runs in (neighbours in the same loops share one; statements outside every loop
  stand bare). Each REDUCE adds its update, ASSIGN(REDUCE), a statement of its innermost loop, listed right after
  the value it adds when that is computed in the same loop, else after all others so that it ends that loop."""
  chains = loop_chains(sink)
  stmts = [n for n in sink.toposort if n.op not in _NOT_STATEMENTS]
  # each update follows its value at once: the C compiler keeps the order, and a register tile's products then die
  # as they are made (all products first, then all updates, needs a register per product)
  updates: dict[UOp, list[UOp]] = {}
  for r in [r for r in stmts if r.op is Ops.REDUCE]:
    update = UOp(Ops.ASSIGN, r.dtype, (r,))
    chains[update] = chains[r.src[-1]]
    value = r.src[0]   # a statement, or a loop counter / constant (sum(arange(n))), which is no statement to follow
    updates.setdefault(value if value.op not in _NOT_STATEMENTS and chains[value] == chains[update] else None, []).append(update)
  stmts = [m for n in stmts for m in (n, *updates.get(n, ()))] + updates.get(None, [])
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
  of outputs) share it, and a reduction's loop runs once per iteration of the loops around the REDUCE. The fill loop
  of a packed buffer opens, the same way, just before the first BARRIER that waits for it (several packed buffers
filled in one loop share it)."""
  depth = len(block.arg)
  waiting = {s.arg[depth] for s in block.src if s.op is Ops.BLOCK}
  first = next((s for s in block.src if (ls := closed_loops(s)) and ls[0] in waiting), None)
  if first is None: return None
  loop = closed_loops(first)[0]
  group = [s for s in block.src if (ls := closed_loops(s)) and ls[0] is loop]
  closed, rest = _gather(block.src, block.arg, loop)
  at = rest.index(first)
  hoisted: dict[UOp, None] = {}
  if len(group) > 1:   # what a later one of the group reads may come after the first: it goes in front
    after = set(rest[at + 1:])
    # one walk of what they all read (an unrolled tile's reductions read mostly the same nodes), sources first
    read = UOp(Ops.SINK, src=tuple(v for c in group for v in (c.src[:1] if c.op is Ops.REDUCE else c.src[:2])))
    hoisted = {n: None for n in read.toposort if n in after}
  accs = [UOp(Ops.DEFINE_ACC, red.dtype, (red,)) for red in group if red.op is Ops.REDUCE]
  return block.replace(src=(*rest[:at], *hoisted, *accs, closed, *(s for s in rest[at:] if s not in hoisted)))


def nest_loops_after_statements(block: UOp) -> UOp | None:
  """Every other loop (an output loop, or the inner loop of a reduction over several) is gathered after the block's
  statements, outermost first: its statements need those, and nothing here reads a value from inside it."""
  depth = len(block.arg)
  anchored = {ls[0] for s in block.src if (ls := closed_loops(s))}
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
