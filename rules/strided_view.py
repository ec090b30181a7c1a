"""View: how a movement (reshape, permute, expand, pad, shrink, flip) reads its source.

A View maps an index vector `i` of its shape to the flat source position `offset + sum(i[d] * strides[d])`, or to
the pad value (0) where `i` lies outside `mask` (one half-open interval per dimension). The source is flat memory, or
the contiguous layout of the shape of the node the view sits on.

Views are kept in one canonical form, so that two views that read the same elements from the same places are equal
(and hash equal): a dimension with a single readable index (size 1, or masked down to one index) has stride 0 and its
position is folded into the offset; a mask that covers everything is None; a view whose mask is empty somewhere is the
all-padding view (strides 0, offset 0, every interval (0, 0)); a view with no elements has strides 0 and offset 0.

`compose(inner, outer)` merges two stacked views into one where a single view can say the same thing; `to_index`
`unflatten` and `to_index_chain` turn views into the index arithmetic of a kernel.
"""
from __future__ import annotations
from dataclasses import dataclass
import functools, math
from rewrite import UOp, dtypes

Interval = tuple[int, int]
MAX_MEMO = 1 << 14   # entries each memo below keeps (all dropped at once when full): a model's views are a few hundred


@functools.lru_cache(maxsize=MAX_MEMO)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
  strides, acc = [], 1
  for s in reversed(shape):
    strides.append(acc if s != 1 else 0)
    acc *= s
  return tuple(reversed(strides))


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
  """Row-major strides of `shape`, with 0 on size-1 dimensions (canonical form)."""
  return _contiguous_strides(shape if shape.__class__ is tuple else tuple(shape))


@dataclass(frozen=True)
class View:
  shape: tuple[int, ...]
  strides: tuple[int, ...]
  offset: int = 0
  mask: tuple[Interval, ...] | None = None

  def __post_init__(self):
    shape, strides, offset = tuple(int(s) for s in self.shape), [int(s) for s in self.strides], int(self.offset)
    mask = None if self.mask is None else tuple((int(lo), int(hi)) for lo, hi in self.mask)
    if any(s < 0 for s in shape): raise ValueError(f"View shape {shape} has a negative dimension")
    if len(strides) != len(shape): raise ValueError(f"View shape {shape} and strides {tuple(strides)} differ in length")
    if mask is not None and len(mask) != len(shape): raise ValueError(f"View shape {shape} and mask {mask} differ in length")
    if 0 in shape: strides, offset, mask = [0] * len(shape), 0, None
    elif mask is not None:
      mask = tuple((min(max(lo, 0), s), max(min(hi, s), 0)) for (lo, hi), s in zip(mask, shape))
      if any(lo >= hi for lo, hi in mask): strides, offset, mask = [0] * len(shape), 0, ((0, 0),) * len(shape)
      else:
        for d, (lo, hi) in enumerate(mask):
          if hi - lo == 1: offset, strides[d] = offset + lo * strides[d], 0  # one readable index: its stride is moot
        if all(m == (0, s) for m, s in zip(mask, shape)): mask = None
    strides = tuple([0 if s == 1 else st for s, st in zip(shape, strides)])
    d = self.__dict__   # (a frozen dataclass: its fields are set past __setattr__)
    d["shape"], d["strides"], d["offset"], d["mask"] = shape, strides, offset, mask
    d["_hash"] = hash((shape, strides, offset, mask))   # views key the movement memo: hashed once

  # equal by value, hashed once (the dataclass's own would build and hash the tuple of fields on every lookup)
  def __hash__(self) -> int: return self._hash
  def __eq__(self, other) -> bool:
    return self is other or (other.__class__ is View and self._hash == other._hash and self.shape == other.shape and
                             self.strides == other.strides and self.offset == other.offset and self.mask == other.mask)
  # the hash is not pickled: a hash of None differs between processes
  def __getstate__(self) -> dict: return {k: v for k, v in self.__dict__.items() if k != "_hash"}
  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self.__dict__["_hash"] = hash((self.shape, self.strides, self.offset, self.mask))

  # ---- construction and properties ----
  @staticmethod
  def contiguous(shape: tuple[int, ...]) -> View:
    return contiguous_view(_check_shape(shape, "View.contiguous"))

  @staticmethod
  def padding(shape: tuple[int, ...]) -> View | None:
    """The view that reads nothing but padding; None for shape () where no mask can say that."""
    shape = _check_shape(shape, "View.padding")
    return View(shape, (0,) * len(shape), 0, ((0, 0),) * len(shape)) if shape else None

  @property
  def size(self) -> int: return math.prod(self.shape)
  @property
  def ndim(self) -> int: return len(self.shape)
  @property
  def is_contiguous(self) -> bool:
    return self.offset == 0 and self.mask is None and self.strides == contiguous_strides(self.shape)
  @property
  def is_padding(self) -> bool:
    """True when no element is read from the source (every element is the pad value)."""
    return self.mask is not None and any(lo >= hi for lo, hi in self.mask)

  # ---- movements ----
  def permute(self, order: tuple[int, ...]) -> View:
    order = tuple(order)
    if sorted(order) != list(range(self.ndim)):
      raise ValueError(f"permute{order} of shape {self.shape}: the order must list each of the axes 0..{self.ndim - 1} once")
    return View(tuple(self.shape[d] for d in order), tuple(self.strides[d] for d in order), self.offset,
                None if self.mask is None else tuple(self.mask[d] for d in order))

  def expand(self, new_shape: tuple[int, ...]) -> View:
    new_shape = _check_shape(new_shape, "expand")
    if len(new_shape) != self.ndim or any(s != n and s != 1 for s, n in zip(self.shape, new_shape)):
      raise ValueError(f"expand of shape {self.shape} to {new_shape}: only size-1 dimensions can grow, and the number "
                       f"of dimensions must stay {self.ndim} (reshape first to add dimensions)")
    # a size-1 dimension's mask is (0, 1) or empty: it grows to cover all, or stays empty
    mask = None if self.mask is None else \
      tuple(m if s == n else (0, n if m[1] > m[0] else 0) for m, s, n in zip(self.mask, self.shape, new_shape))
    return View(new_shape, tuple(st if s == n else 0 for st, s, n in zip(self.strides, self.shape, new_shape)),
                self.offset, mask)

  def pad(self, padding: tuple[tuple[int, int], ...]) -> View:
    padding = tuple(tuple(p) for p in padding)
    if len(padding) != self.ndim or any(len(p) != 2 for p in padding):
      raise ValueError(f"pad {padding} of shape {self.shape}: give one (before, after) pair per dimension")
    if any(b < 0 or a < 0 for b, a in padding):
      raise ValueError(f"pad {padding} of shape {self.shape}: pads must be >= 0 (use shrink to cut)")
    mask = self.mask if self.mask is not None else tuple((0, s) for s in self.shape)
    return View(tuple(s + b + a for s, (b, a) in zip(self.shape, padding)), self.strides,
                self.offset - sum(b * st for (b, _), st in zip(padding, self.strides)),
                tuple((lo + b, hi + b) for (lo, hi), (b, _) in zip(mask, padding)))

  def shrink(self, bounds: tuple[tuple[int, int], ...]) -> View:
    bounds = tuple(tuple(b) for b in bounds)
    if len(bounds) != self.ndim or any(len(b) != 2 for b in bounds):
      raise ValueError(f"shrink {bounds} of shape {self.shape}: give one (start, end) pair per dimension")
    if any(not 0 <= b <= e <= s for (b, e), s in zip(bounds, self.shape)):
      raise ValueError(f"shrink {bounds} of shape {self.shape}: each pair needs 0 <= start <= end <= size")
    mask = None if self.mask is None else tuple((lo - b, hi - b) for (lo, hi), (b, _) in zip(self.mask, bounds))
    return View(tuple(e - b for b, e in bounds), self.strides,
                self.offset + sum(b * st for (b, _), st in zip(bounds, self.strides)), mask)

  def flip(self, axes: tuple[int, ...]) -> View:
    axes = tuple(axes)
    norm = tuple(a + self.ndim if a < 0 else a for a in axes)
    if any(not 0 <= a < self.ndim for a in norm) or len(set(norm)) != len(norm):
      raise ValueError(f"flip{axes} of shape {self.shape}: axes must be distinct and within -{self.ndim}..{self.ndim - 1}")
    strides, offset = list(self.strides), self.offset
    mask = None if self.mask is None else list(self.mask)
    for a in norm:
      s = self.shape[a]
      offset += (s - 1) * strides[a]  # index 0 now reads what index s-1 read
      strides[a] = -strides[a]
      if mask is not None: mask[a] = (s - mask[a][1], s - mask[a][0])
    return View(self.shape, tuple(strides), offset, None if mask is None else tuple(mask))

  def reshape(self, new_shape: tuple[int, ...]) -> View | None:
    """The single view reading like this one reshaped to `new_shape`; None when no single view can (then stack
    `View.contiguous(new_shape)` on top instead)."""
    new_shape = _check_shape(new_shape, "reshape")
    if math.prod(new_shape) != self.size:
      raise ValueError(f"reshape of shape {self.shape} ({self.size} elements) to {new_shape} "
                       f"({math.prod(new_shape)} elements): the element count must stay the same")
    if new_shape == self.shape: return self
    if self.size == 0 or self.is_contiguous: return View.contiguous(new_shape)
    if self.is_padding: return View.padding(new_shape)
    if self.mask is None:
      strides = _reshape_strides(self.shape, self.strides, new_shape)
      return None if strides is None else View(new_shape, strides, self.offset, None)
    # Masked: the readable box must stay a box in the new shape; then reshape the box itself (shrunk to an unmasked
    # view, where dimensions with a single readable index become size 1 and so impose no stride) and pad it back.
    new_mask = [(0, s) for s in new_shape]
    for old_dims, new_dims in _blocks(self.shape, new_shape):
      flat = _box_to_range([self.mask[d] for d in old_dims], [self.shape[d] for d in old_dims])
      box = None if flat is None else _range_to_box(*flat, [new_shape[d] for d in new_dims])
      if box is None: return None
      for d, m in zip(new_dims, box): new_mask[d] = m
    box_view = self.shrink(self.mask)
    strides = _reshape_strides(box_view.shape, box_view.strides, tuple(hi - lo for lo, hi in new_mask))
    if strides is None: return None
    return View(new_shape, strides, box_view.offset - sum(lo * st for (lo, _), st in zip(new_mask, strides)), tuple(new_mask))

  def __add__(self, outer: View) -> View | None: return compose(self, outer)

  # ---- index arithmetic ----
  def to_index(self, idxs: list[UOp]) -> tuple[UOp, UOp | None]:
    """(flat source index, validity) for one index UOp per dimension; validity is None when nothing is masked."""
    if len(idxs) != self.ndim: raise ValueError(f"to_index of a view of shape {self.shape} needs {self.ndim} indices, got {len(idxs)}")
    dtype = idxs[0].dtype if idxs else dtypes.index
    terms = [i if st == 1 else i * st for i, st in zip(idxs, self.strides) if st != 0]
    flat = UOp.const(dtype, self.offset) if not terms else _sum(terms) if self.offset == 0 else _sum(terms) + self.offset
    if self.mask is None: return flat, None
    checks = []
    for i, (lo, hi), s in zip(idxs, self.mask, self.shape):
      if lo > 0: checks.append(i > lo - 1)  # there is no >=: i >= lo is lo-1 < i
      if hi < s: checks.append(i < hi)
    valid = checks[0]
    for c in checks[1:]: valid = valid & c
    return flat, valid


def unflatten(flat: UOp, shape: tuple[int, ...]) -> list[UOp]:
  """Per-dimension indices of a flat index into the contiguous layout of `shape` (the outermost needs no modulo:
  flat < size wherever the element is read)."""
  out, first = [], True
  for s, st in zip(shape, contiguous_strides(shape)):
    if s == 1: out.append(UOp.const(flat.dtype, 0)); continue
    i = flat if st == 1 else flat // st
    out.append(i if first else i % s)
    first = False
  return out


def to_index_chain(views: list[View], idxs: list[UOp]) -> tuple[UOp, UOp | None]:
  """(flat index into the innermost view's source, validity) of a stack of views, outermost last: the index
  arithmetic the lower stage builds one view at a time (used to check `compose`, and by the symbolic benchmark)."""
  if not views: raise ValueError("to_index_chain needs at least one view")
  flat, valid = views[-1].to_index(idxs)
  for inner in reversed(views[:-1]):
    flat, v = inner.to_index(unflatten(flat, inner.shape))
    if v is not None: valid = v if valid is None else valid & v
  return flat, valid


def compose(inner: View, outer: View) -> View | None:
  """The one view equal to reading `inner` through `outer` (whose source is the contiguous layout of inner.shape),
  or None when no single view says the same thing."""
  if outer.size == 0: return View.contiguous(outer.shape)
  if outer.is_padding: return outer
  if inner.is_padding: return View.padding(outer.shape)
  if inner.is_contiguous: return outer
  if outer.is_contiguous and outer.size == inner.size and (r := inner.reshape(outer.shape)) is not None: return r
  if (r := _compose_affine(inner, outer)) is not None: return r
  # outer may read inner through a reshape first (a split dim permuted, say): split inner along outer's strides
  outer_strides = {abs(st) for st in outer.strides if st != 0}
  for strides in (outer_strides | (set(contiguous_strides(inner.shape)) - {0}), outer_strides):
    split = _factor_shape(inner.size, strides)
    if split is None or split == inner.shape: continue
    if (split_inner := inner.reshape(split)) is not None and (r := _compose_affine(split_inner, outer)) is not None: return r
  return None


@functools.lru_cache(maxsize=MAX_MEMO)
def contiguous_view(shape: tuple[int, ...]) -> View:
  """View.contiguous of a shape already checked (a tuple of non-negative ints): one lookup."""
  return View(shape, contiguous_strides(shape), 0, None)


@functools.lru_cache(maxsize=MAX_MEMO)
def scalar_view(shape: tuple[int, ...]) -> View:
  """The View reading one element at every index of `shape` (all strides 0): how a constant gets a shape."""
  return View(shape, (0,) * len(shape))


_moves: dict[tuple, View | None] = {}


def moved(view: View, move, arg) -> View | None:
  """`move(view, arg)` (a View method such as View.reshape, or `strided`), remembered: a pure function of hashable
  values, which a model's forward asks again with the same views on every call. Errors are raised, not remembered."""
  key = (move, view, arg)
  try: return _moves[key]
  except KeyError: pass
  out = move(view, arg)
  if len(_moves) >= MAX_MEMO: _moves.clear()
  _moves[key] = out
  return out


# ---- helpers ----
def _check_shape(shape, what: str) -> tuple[int, ...]:
  shape = tuple(shape)
  if any(not isinstance(s, int) or s < 0 for s in shape): raise ValueError(f"{what}: shape {shape} must be non-negative ints")
  return shape


def _sum(terms: list[UOp]) -> UOp:
  acc = terms[0]
  for t in terms[1:]: acc = acc + t
  return acc


def _blocks(shape: tuple[int, ...], new_shape: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
  """Pair the non-1 dimensions of two shapes of one element count into the smallest groups of equal product."""
  old = [d for d, s in enumerate(shape) if s != 1]
  new = [d for d, s in enumerate(new_shape) if s != 1]
  blocks, i, j = [], 0, 0
  while i < len(old):  # all sizes are >= 2 and the totals agree, so both lists run out together
    po, pn, bi, bj = shape[old[i]], new_shape[new[j]], i, j
    i, j = i + 1, j + 1
    while po != pn:
      if po < pn: po, i = po * shape[old[i]], i + 1
      else: pn, j = pn * new_shape[new[j]], j + 1
    blocks.append((old[bi:i], new[bj:j]))
  return blocks


def _reshape_strides(shape, strides, new_shape) -> tuple[int, ...] | None:
  """Strides reading an unmasked strided layout as `new_shape` without copying (numpy's rule: within each group of
  dimensions being merged or split, the old ones must nest like a row-major block); None when impossible."""
  new_strides = [0] * len(new_shape)
  for old_dims, new_dims in _blocks(shape, new_shape):
    for a, b in zip(old_dims, old_dims[1:]):
      if strides[a] != strides[b] * shape[b]: return None
    st = strides[old_dims[-1]]
    for d in reversed(new_dims): new_strides[d], st = st, st * new_shape[d]
  return tuple(new_strides)


def _box_to_range(box: list[Interval], sizes: list[int]) -> Interval | None:
  """The flat row-major range covered by a box of indices, or None when the box is not one contiguous range: it is
  one when, past the outermost dimension holding more than one index, every dimension is full."""
  j = next((d for d, (lo, hi) in enumerate(box) if hi - lo > 1), len(box) - 1)
  if any(box[d] != (0, sizes[d]) for d in range(j + 1, len(box))): return None
  lo = sum(l * math.prod(sizes[d + 1:]) for d, (l, _) in enumerate(box))
  return lo, lo + (box[j][1] - box[j][0]) * math.prod(sizes[j + 1:])


def _range_to_box(lo: int, hi: int, sizes: list[int]) -> list[Interval] | None:
  """The box of indices covering exactly the flat range [lo, hi) of `sizes`, or None when the range is no box."""
  for j in range(len(sizes)):
    inner = math.prod(sizes[j + 1:])
    if lo % inner or hi % inner: continue
    a, b = lo // inner, hi // inner  # the range as whole steps of dimension j
    if a // sizes[j] != (b - 1) // sizes[j]: continue  # it must not cross a step of the dimensions outside j
    box, prefix = [], a // sizes[j]
    for s in reversed(sizes[:j]): box.append((prefix % s, prefix % s + 1)); prefix //= s
    return box[::-1] + [(a % sizes[j], (b - 1) % sizes[j] + 1)] + [(0, s) for s in sizes[j + 1:]]
  return None


def _factor_shape(size: int, strides: set[int]) -> tuple[int, ...] | None:
  """The shape of `size` elements whose row-major strides are exactly `strides` (plus 1), or None if they don't nest."""
  chain = sorted(strides | {1, size}, reverse=True)
  if chain[0] != size: return None
  if any(a % b for a, b in zip(chain, chain[1:])): return None
  return tuple(a // b for a, b in zip(chain, chain[1:]))


def _compose_affine(inner: View, outer: View) -> View | None:
  """Merge when each moving dimension of `outer` steps along one dimension of inner's contiguous layout (stride
  +-that dimension's contiguous stride) and never carries into the next: then each inner index is an affine function
  of at most one outer index, which is what a single view can express."""
  cstrides = contiguous_strides(inner.shape)
  dim_of = {c: k for k, (c, s) in enumerate(zip(cstrides, inner.shape)) if s != 1}
  lo = [m[0] for m in outer.mask] if outer.mask is not None else [0] * outer.ndim
  hi = [m[1] for m in outer.mask] if outer.mask is not None else list(outer.shape)
  # the first readable element of outer, as inner indices: every readable element is this corner plus per-dim steps
  corner = outer.offset + sum(st * l for st, l in zip(outer.strides, lo))
  if not 0 <= corner < inner.size: return None
  base = [(corner // c) % s if s != 1 else 0 for c, s in zip(cstrides, inner.shape)]
  strides, used = [0] * outer.ndim, {}
  for d, st in enumerate(outer.strides):
    if st == 0: continue
    k = dim_of.get(abs(st))
    if k is None or k in used: return None
    sign = 1 if st > 0 else -1
    if not 0 <= base[k] + sign * (hi[d] - 1 - lo[d]) < inner.shape[k]: return None  # it would carry
    used[k] = d
    base[k] -= sign * lo[d]  # inner index k = base[k] + sign * outer index d
    strides[d] = sign * inner.strides[k]
  mask = list(zip(lo, hi))
  if inner.mask is not None:
    for k, (ml, mh) in enumerate(inner.mask):
      if (d := used.get(k)) is None:
        if not ml <= base[k] < mh: return View.padding(outer.shape)
        continue
      # ml <= base + sign*i < mh, solved for i
      bounds = (ml - base[k], mh - base[k]) if outer.strides[d] > 0 else (base[k] - mh + 1, base[k] - ml + 1)
      mask[d] = (max(mask[d][0], bounds[0]), min(mask[d][1], bounds[1]))
  return View(outer.shape, tuple(strides), inner.offset + sum(st * b for st, b in zip(inner.strides, base)), tuple(mask))
