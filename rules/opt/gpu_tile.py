"""The GPU's heuristic for a product: a tile plan (rules/gpu.py `lay_out_tiles` carries its lanes and blocks out).

A kernel of one store of a float sum of products of two operands (a matrix product, batched, with anything
elementwise around it: a bias, an activation, a residual, a scale, a cast; and in it: a prologue) whose rows i (the loop one operand does not
depend on) and columns j (the other's) divide a tile, and whose reduction k divides a slice:

- a block computes a BM x BN tile of outputs with BM/TM x BN/TN lanes, each lane a TM x TN register tile (upcast
  records): its rows TM consecutive ones, its columns two groups of TN/2 consecutive ones BN/2 apart, so the lanes of a
  warp read consecutive words of a shared tile (no bank conflicts) and write consecutive addresses;
- k is split into slices of BK (`split`), and for each slice the operands' tiles are staged in shared memory (`pack`
  of the reduction loop: rules/opt/pack.py), filled by all the block's lanes with reads that follow memory, then read
  from there by every lane of the block (each element read from memory once per block, not once per output; an
  operand's prologue computed once per element, as its tile is filled);
- blocks run in groups of 8 along i (`global(i, 8)`), so blocks that run at once share their tiles of B in L2;
- every other output loop (a batch) runs on blocks.
The epilogue is part of the store: each register of the tile goes through it before it is written. Sizes that do not
divide a tile, and other kernels, get the rows plan (rules/gpu.py `grid_plan`).
"""
from __future__ import annotations
from rewrite import UOp, Ops
from .plan import Opt, OptKind, Plan

# (BM, BN, TM, TN) from the largest; the first whose blocks fill the GPU's multiprocessors is taken
TILES = ((128, 128, 8, 8), (128, 64, 8, 4), (64, 64, 4, 4), (64, 32, 4, 2), (32, 32, 2, 2))
SLICE = 8   # BK: the reduction's slice staged in shared memory at once (16 for a lane's tile of 16 registers or fewer:
            # 1024^3 on an H100, 64x64 tiles of 4x4: 0.083 ms against 0.098 with 8; 128x128 of 8x8 at 4096^3: 8 is faster)
GROUP = 8   # blocks grouped along the rows


def product_loops(sink: UOp, axes: list[UOp]) -> tuple[UOp, UOp, UOp] | None:
  """(i, j, k) of a kernel whose one store holds one float sum over one loop k of a product of two factors (loads, or
  elementwise expressions of loads: a prologue), one moving with i and not j, the other with j and not i (j the
  innermost output loop), both with k; else None."""
  if len(sink.src) != 1 or sink.src[0].op is not Ops.STORE: return None
  reds = [n for n in sink.src[0].src[1].toposort if n.op is Ops.REDUCE]
  if len(reds) != 1 or reds[0].arg is not Ops.ADD or not reds[0].dtype.is_float or len(reds[0].src) != 2: return None
  red, outs = reds[0], [r for r in axes if r.arg[0] == "out"]
  if len(outs) < 2 or red.src[0].op is not Ops.MUL: return None
  j, k = outs[-1], red.src[1]
  fa, fb = red.src[0].src
  if j in fa.toposort: fa, fb = fb, fa
  if j in fa.toposort or j not in fb.toposort or k not in fa.toposort or k not in fb.toposort: return None
  rows = [r for r in outs[:-1] if r in fa.toposort and r not in fb.toposort]
  return (rows[-1], j, k) if rows else None


def tile_plan(sink: UOp, axes: list[UOp], multiprocessors: int) -> Plan | None:
  if (loops := product_loops(sink, axes)) is None: return None
  i, j, k = loops
  n = {r: a for a, r in enumerate(axes)}
  size = lambda r: r.src[0].arg
  batch = 1
  for r in axes:
    if r.arg[0] == "out" and r is not i and r is not j: batch *= size(r)
  fits = [t for t in TILES if size(i) % t[0] == 0 and size(j) % t[1] == 0 and size(i) >= t[0] and size(j) >= t[1]]
  if not fits: return None
  bm, bn, tm, tn = next((t for t in fits if batch * (size(i) // t[0]) * (size(j) // t[1]) >= multiprocessors), fits[-1])
  bk = next((s for s in ((16, SLICE) if tm * tn <= 16 else (SLICE,)) if size(k) % s == 0), None)
  if bk is None: return None
  half = tn // 2
  opts = [Opt(OptKind.UPCAST, n[i], tm), Opt(OptKind.LOCAL, n[i], bm // tm), Opt(OptKind.GLOBAL, n[i], GROUP if size(i) // bm % GROUP == 0 else 0)]
  opts += [Opt(OptKind.UPCAST, n[j], half)] * (half > 1) + [Opt(OptKind.LOCAL, n[j], bn // tn), Opt(OptKind.UPCAST, n[j], 2), Opt(OptKind.GLOBAL, n[j])]
  opts += [Opt(OptKind.GLOBAL, n[r]) for r in axes if r.arg[0] == "out" and r is not i and r is not j]
  opts += [Opt(OptKind.SPLIT, n[k], bk), Opt(OptKind.PACK, n[k])]
  return Plan(tuple(opts), "heuristic")
