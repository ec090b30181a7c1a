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

The tile (`product_tile`): 128x128 of 8x8 registers (256 lanes) where its blocks are BIG_TILE_BLOCKS per multiprocessor
or more (4096^3), else 64x128 or 128x64 of 8x8 (128 lanes: 8 loads from shared memory per 64 multiply-adds, against
8 per 16 with 4x4) where those blocks occupy the multiprocessors (`fills`: 7 in 8 of them at least), else the first
smaller tile that does, else the smallest that divides. A product whose 8x8 tiles leave multiprocessors idle is
offered, by the host stage, with its reduction split into parts (rules/split.py `product_split_plan`), each part a
product of the batch of partials, which then has the blocks to take the 8x8 tile: the GPT forward's 1024x768 products,
96 blocks of 64x128, run as 4 x 96.
Measured on an H100 (bench/gpu_tiles.py --gpt, time over cuBLAS's for the bare product): 1024x768x3072 as one kernel of
64x64 tiles of 4x4 (192 blocks) 1.8x, split into 4 x 96 blocks of 64x128 tiles of 8x8 0.94x; 1024x3072x768 as 128x128
tiles (192 blocks) 1.18x, 64x128 of 8x8 (384 blocks) 0.93-1.03x.
"""
from __future__ import annotations
from rewrite import UOp, Ops
from .plan import Opt, OptKind, Plan

# (BM, BN, TM, TN) from the largest (see the module's docstring for which is taken)
TILES = ((128, 128, 8, 8), (64, 128, 8, 8), (128, 64, 8, 8), (64, 64, 4, 4), (64, 32, 4, 2), (32, 32, 2, 2))
SLICES = (16, 8)   # BK, the reduction's slice staged in shared memory at once: the first that divides k. 16 halves the
                   # barriers of 8; with a lane's fill read as floatx4 and prefetched, the 256-lane tile holds it in 127
                   # registers (an H100, 4096^3: 2.87 ms against 2.97 with 8; the 128-lane tiles took 16 before)
WIDE_SLICE = SLICES[0]
GROUP = 8   # blocks grouped along the rows
BIG_TILE_BLOCKS = 6     # blocks per multiprocessor the 256-lane tile needs (fewer: 1024x3072, 192 blocks, 1.18x cuBLAS)
FILL_BLOCKS = 2.5       # blocks per multiprocessor a split product's parts are given (1024x768 on an H100: 384 blocks of
                        # 128 lanes 1.03x cuBLAS, 288 1.17x, 576 of 128-long parts 1.21x)
MIN_PART = 128          # a part of a split reduction keeps at least this much of it (8 slices of WIDE_SLICE)


def fills(blocks: int, multiprocessors: int) -> bool:
  """A grid of `blocks` leaves at most 1 in 8 multiprocessors idle (1024^3 in 64x128 tiles: 128 blocks on 132)."""
  return 8 * blocks >= 7 * multiprocessors


def split_parts(k: int) -> list[int]:
  """The parts (2 or more) a reduction of k may be split into: each a whole number of WIDE_SLICE slices, MIN_PART long."""
  return [p for p in range(2, k // MIN_PART + 1) if k % p == 0 and (k // p) % WIDE_SLICE == 0]


def tiles_of(m: int, n: int) -> list[tuple[int, int, int, int]]:
  """The TILES that divide an m x n product."""
  return [t for t in TILES if m % t[0] == 0 and n % t[1] == 0 and m >= t[0] and n >= t[1]]


def product_tile(m: int, n: int, batch: int, multiprocessors: int) -> tuple[int, int, int, int] | None:
  """The tile of an m x n product (a batch of `batch`) (the module's docstring); None where none divides."""
  fits = tiles_of(m, n)
  for t in fits:
    blocks = batch * (m // t[0]) * (n // t[1])
    if blocks >= BIG_TILE_BLOCKS * multiprocessors if t == TILES[0] else fills(blocks, multiprocessors): return t
  return fits[-1] if fits else None


def slice_of(k: int) -> int | None:
  """BK: the first of SLICES that divides k; None where none does."""
  return next((s for s in SLICES if k % s == 0), None)


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
  if (tile := product_tile(size(i), size(j), batch, multiprocessors)) is None: return None
  if (bk := slice_of(size(k))) is None: return None
  bm, bn, tm, tn = tile
  batch_axes = [n[r] for r in axes if r.arg[0] == "out" and r is not i and r is not j]
  return Plan(tile_opts(n[i], n[j], n[k], (bm, bn, tm, tn), bk, GROUP if size(i) // bm % GROUP == 0 else 0, batch_axes), "heuristic")


def tile_opts(i: int, j: int, k: int, tile: tuple[int, int, int, int], bk: int, group: int = 0, batch=()) -> tuple[Opt, ...]:
  """The records of a tile plan over axes i, j, k (and batch axes on blocks): `tile` (BM, BN, TM, TN), slices of bk,
  blocks grouped by `group` along i (0: not grouped)."""
  bm, bn, tm, tn = tile
  half = tn // 2
  opts = [Opt(OptKind.UPCAST, i, tm), Opt(OptKind.LOCAL, i, bm // tm), Opt(OptKind.GLOBAL, i, group)]
  opts += [Opt(OptKind.UPCAST, j, half)] * (half > 1) + [Opt(OptKind.LOCAL, j, bn // tn), Opt(OptKind.UPCAST, j, 2), Opt(OptKind.GLOBAL, j)]
  opts += [Opt(OptKind.GLOBAL, b) for b in batch]
  return tuple(opts + [Opt(OptKind.SPLIT, k, bk), Opt(OptKind.PACK, k)])
