"""One-pass rows on the CPU: which row reductions a reader's kernel computes itself (the gpu_fuse stage's decision,
rules/gpu.py, with the CPU's limits; one mechanism on both devices).

Inlined, a softmax or a layer norm is one kernel whose threads take rows: each row is read from memory once (the max,
or the mean), then again from cache (the sum, the variance, the normalized output), where three kernels read it
from memory three times and write and read back the row statistics in between. On a GPU a row's lanes hold it in
registers, of any length. On the CPU a row must stay in a core's cache between its passes, and the rows are the only
parallel loop of the fused kernel, so `cpu_rows_fit(reductions)` admits a reduction only where
- its rows are at least MIN_ROWS (threads have work; a full reduction, one row, keeps its parallel reader), and
- one row of everything it reads, `row elements x (bytes of an element of each buffer it reads)`, is at most
  ROW_CACHE_BYTES (a core's share of L2 on the machines we run on).
"""
from __future__ import annotations
import math
from rewrite import UOp, Ops
from rules.shapes import shape_of

MIN_ROWS = 16
ROW_CACHE_BYTES = 256 << 10


def _buffers_read(value: UOp) -> list[UOp]:
  return list(dict.fromkeys(n for n in value.toposort if n.op is Ops.BUFFER))


def cpu_rows_fit(reductions: list[UOp]) -> bool:
  for red in reductions:
    shape, axes = shape_of(red.src[0]), red.arg[1]
    row = math.prod(shape[a] for a in axes)
    rows = math.prod(shape) // max(row, 1)
    if rows < MIN_ROWS or row * sum(b.dtype.itemsize for b in _buffers_read(red.src[0])) > ROW_CACHE_BYTES: return False
  return True
