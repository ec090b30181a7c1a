"""The default policy: a plan from the kernel's shape, without trying anything (the search in runtime/search.py
tries candidates around it).

- Every kernel: the outermost output loop runs on threads when the work under it pays for starting them.
- A reduction: its innermost loop is vectorized by the C compiler (`simd`), as the reduction of a row.
- A sum of products of loads (a matrix product, batched as in attention, or a linear layer), two kinds of register
  tiles, the shape of a BLAS microkernel (the first also serves a sum down columns, `x.sum(axis=0)`):
  - "broadcast" (A @ B with B read along the innermost output loop j): j is split into vector lanes (and unrolled
    into two vectors), the output loop i that B does not depend on is unrolled U times: U x 2 vector accumulators;
    each step of the reduction loads two vectors of B and broadcasts U elements of A;
  - "dot" (x @ W.T: every load reads along the innermost reduction loop k): k is split into vector lanes, the two
    output loops some load does not depend on are unrolled 4 x 4: 16 vector accumulators of partial sums, whose lanes
    are added at the end.
- A convolution (a sum of products whose input load reads a window: it depends on the innermost output loop and on
  several reduction loops, and the weight load does not depend on that loop): the lanes go across the output
  channels, whose weights are packed into a panel (lanes innermost), and the tile unrolls output channels and output
  columns, so each step of the reduction loads a few vectors of weights and broadcasts a few input elements, as in
  the matrix product's broadcast form. The input is never read as whole vectors: its padding (masks) and strides
  cost one scalar load per column of the tile, not a masked vector.
"""
from __future__ import annotations
import functools, math
from rewrite import UOp, Ops, dtypes
from rules.linearize import open_ranges, loop_work, nesting_key
from .plan import Opt, OptKind, Plan
from .pack import coefficient

PARALLEL_WORK = 1 << 15  # iterations below which starting threads costs more than it saves
# a packed panel of B (per vector of columns; a tile's two vectors pack twice this) this large stays in the L2 cache:
# 256 KiB packs a GPT's fc2 (3072 x 32 floats, 384 KiB), which read strided from W ran 2.4x slower (11.0 against 4.6 ms,
# 128x3072x768, one thread); packed panels are at most MAX_LOCAL_BYTES (rules/opt/pack.py)
PANEL_BYTES = 256 << 10
B_IN_CACHE_BYTES = 128 << 10   # a whole B up to this is packed whole and each tile of rows sweeps it (P @ V)
CONV_PANEL_BYTES = 256 << 10   # a convolution's packed weights (tests measured at this size)
CONV_ACCUMULATORS = {8: 8, 16: 16}   # vector accumulators of a convolution's tile: half the registers (AVX2, AVX-512)


def vector_width(itemsize: int) -> int:
  """Lanes of the widest vector register this CPU has (AVX-512: 64 bytes, else AVX: 32)."""
  return (64 if _has_avx512() else 32) // itemsize


@functools.cache
def _has_avx512() -> bool:
  try:
    with open("/proc/cpuinfo") as f: return " avx512f" in f.read()
  except OSError: return False


def loads_of(u: UOp) -> list[UOp]: return [n for n in u.toposort if n.op is Ops.LOAD]


def heuristic_plan(sink: UOp, axes: list[UOp]) -> Plan:
  from rules.attention import attention_plan   # a fused attention kernel has a plan of its own
  if (plan := attention_plan(sink, axes)) is not None: return plan
  opts: list[Opt] = []
  ranges = open_ranges(sink)
  axis = {r: i for i, r in enumerate(axes)}
  tile = conv_tile(sink, axes) or register_tile(sink, axes)
  if tile: opts += tile
  elif (simd := simd_loops(sink, ranges)): opts += [Opt(OptKind.SIMD, axis[r]) for r in simd]
  # the loop moved outermost (a packed panel's), else the first, runs on threads
  outer = next((o.axis for o in opts if o.kind is OptKind.INTERCHANGE and axes[o.axis].arg[0] == "out"), 0)
  if axes and axes[outer].arg[0] == "out" and loop_work(axes[0], ranges) >= PARALLEL_WORK: opts.append(Opt(OptKind.PARALLEL, outer))
  return Plan(tuple(opts), "heuristic")


def simd_loops(sink: UOp, ranges) -> list[UOp]:
  """The innermost loop of each float sum or max that has no loop inside it (today's row reductions)."""
  out = []
  for red in (n for n in sink.toposort if n.op is Ops.REDUCE):
    last = red.src[-1]
    inner = {q for qs in ranges.values() if last in qs for q in qs if nesting_key(q) > nesting_key(last)}
    if red.dtype.is_float and not inner and red.arg in (Ops.ADD, Ops.MAX) and last not in out: out.append(last)
  return out


def tile_rows(size: int, most: int) -> int | None:
  """Rows of a register tile of broadcasts: as many as the registers hold (12 accumulators of 2 x 8 lanes leave AVX2's
  other 4 registers for B's vectors and a broadcast), the loop padded to a multiple of them (rules/opt/pad.py) when
  that wastes under 1/16 of it; else the most that divide it."""
  best = next((u for u in (8, 6, 4, 3, 2) if u <= most and size >= 2 * u), None)
  if best is None or (-size % best) * 16 < size: return best   # -size % best: the rows padding adds
  return next((u for u in (8, 6, 4, 3, 2) if u <= most and size % u == 0 and size >= 2 * u), None)


def register_tile(sink: UOp, axes: list[UOp]) -> list[Opt] | None:
  """The opts of a register tile for a kernel of a float sum of products of loads, else None. The kernel may store
  several values computed from that one sum, all at one index (a layer's output and the values between it and the
  product that a backward pass reads): each register of the tile then feeds every store."""
  if not sink.src or any(st.op is not Ops.STORE for st in sink.src): return None
  st = sink.src[0]
  if any(other.src[0].src[1] is not st.src[0].src[1] for other in sink.src[1:]): return None
  reds = list(dict.fromkeys(n for other in sink.src for n in other.src[1].toposort if n.op is Ops.REDUCE))
  if len(reds) != 1 or reds[0].arg is not Ops.ADD or not reds[0].dtype.is_float or reds[0].dtype.itemsize != 4: return None
  red = reds[0]
  loads = loads_of(red.src[0])
  outs = [r for r in axes if r.arg[0] == "out"]
  if not loads or not outs or len(red.src) < 2: return None
  n = {r: i for i, r in enumerate(axes)}
  size = lambda r: r.src[0].arg
  idx = [ld.src[0].src[1] for ld in loads]
  j, k, w = outs[-1], red.src[-1], vector_width(4)
  def unrolled(r: UOp, most: int) -> int | None:
    return next((u for u in (8, 6, 4, 3, 2) if u <= most and size(r) % u == 0 and size(r) >= 2 * u), None)
  along_j = [ld for ld, i in zip(loads, idx) if j in i.toposort]
  others = [r for r in outs[:-1] if all(r not in ld.toposort for ld in along_j)]
  panel = math.prod(size(r) for r in red.src[1:]) * w * 4
  # a panel of B that a block of rows reads (every k, this block of columns) can be packed once per block of columns
  packable = bool(others) and panel <= PANEL_BYTES and all(len(ld.src) == 1 for ld in along_j)
  contiguous = all(coefficient(ld.src[0].src[1], j) == 1 for ld in along_j)
  if coefficient(st.src[0].src[1], j) == 1 and along_j and size(j) % w == 0 and (contiguous or packable):
    # broadcast form: the loads along j are vectors (read from a packed panel when they are strided: x @ W.T),
    # another output loop they do not depend on is unrolled
    rows = size(j) // w
    vecs = 2 if rows % 2 == 0 else next(v for v in (7, 6, 5, 4, 3, 2, 1) if rows % v == 0)
    opts = [Opt(OptKind.VECTOR, n[j], w)] + ([Opt(OptKind.UPCAST, n[j], vecs)] if vecs > 1 else [])
    # the small reduction loops (a convolution's window) move outward: the masks of padding, which depend on them
    # and not on the long one (the channels), are computed once per window position
    longest = max(red.src[1:], key=size)
    opts += [Opt(OptKind.INTERCHANGE, n[r]) for r in red.src[1:] if r is not longest]
    if others and (u := tile_rows(size(others[-1]), max(1, (16 if w == 16 else 14) // vecs))):
      opts += ([Opt(OptKind.PAD, n[others[-1]], u)] if size(others[-1]) % u else []) + [Opt(OptKind.UPCAST, n[others[-1]], u)]
      # a B larger than a panel: its loop of column blocks moves outermost, the rows stream A past a panel that stays
      # in cache; a B no larger is packed whole and stays, and each tile of rows sweeps it all while its A stays in
      # L1 (attention's P @ V: 1.3x faster than streaming P four times)
      if packable and (rows > vecs or not contiguous):
        whole = math.prod(size(r) for r in red.src[1:]) * size(j) * 4
        opts += [Opt(OptKind.PACK, n[others[-1]])] + ([Opt(OptKind.INTERCHANGE, n[j])] if rows > vecs and whole > B_IN_CACHE_BYTES else [])
    if contiguous or any(o.kind is OptKind.PACK for o in opts): return opts
  if len(loads) > 1 and all(coefficient(i, k) == 1 for i in idx) and size(k) % w == 0 and all(len(ld.src) == 1 for ld in loads):
    # dot form: vector partial sums along k, a 4 x 4 tile of outputs
    opts = [Opt(OptKind.VECTOR, n[k], w)]
    for r in [r for r in outs if any(r not in i.toposort for i in idx)][-2:]:
      if (u := unrolled(r, 4)): opts.append(Opt(OptKind.UPCAST, n[r], u))
    return opts
  return None


def conv_tile(sink: UOp, axes: list[UOp]) -> list[Opt] | None:
  """The opts of a convolution's register tile (see the module's docstring), else None."""
  if len(sink.src) != 1 or sink.src[0].op is not Ops.STORE: return None
  reds = [n for n in sink.src[0].src[1].toposort if n.op is Ops.REDUCE]
  if len(reds) != 1 or reds[0].arg is not Ops.ADD or reds[0].dtype != dtypes.float32 or len(reds[0].src) < 3: return None
  red, outs, w = reds[0], [r for r in axes if r.arg[0] == "out"], vector_width(4)
  loads = loads_of(red.src[0])
  if len(loads) != 2 or not outs: return None
  j, window = outs[-1], set(red.src[1:])
  size = lambda r: r.src[0].arg
  for x, wt in (loads, loads[::-1]):
    # x: the input, read through a window; wt: the weights, one panel per block of output channels c
    if j not in x.toposort or len(window & set(x.toposort)) < 2 or j in wt.toposort or len(wt.src) != 1: continue
    channels = [r for r in outs if r in wt.toposort and r not in x.toposort and size(r) % w == 0]
    panel = math.prod(size(r) for r in red.src[1:]) * w * 4
    if not channels or panel > CONV_PANEL_BYTES: continue
    c, n = channels[-1], {r: i for i, r in enumerate(axes)}
    # two vectors of channels x (accumulators / 2) columns: each step loads two vectors of weights and broadcasts
    # one input element per column
    vecs = 2 if size(c) // w % 2 == 0 else 1
    cols = next(u for u in (CONV_ACCUMULATORS[w] // vecs, 4, 2, 1) if u <= CONV_ACCUMULATORS[w] // vecs and size(j) % u == 0)
    opts = [Opt(OptKind.VECTOR, n[c], w)] + [Opt(OptKind.UPCAST, n[c], vecs)] * (vecs > 1) + [Opt(OptKind.UPCAST, n[j], cols)] * (cols > 1)
    # an input read through masks (padding that conv2d did not store) moves the window's loops outward, so the
    # masks are computed once per window position, not once per channel;
    # the weight panel is packed once per block of output channels (it does not depend on the columns)
    longest = max(red.src[1:], key=size)
    if len(x.src) > 1: opts += [Opt(OptKind.INTERCHANGE, n[r]) for r in red.src[1:] if r is not longest]
    return opts + [Opt(OptKind.PACK, n[j])]
  return None
