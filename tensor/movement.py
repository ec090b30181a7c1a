"""Movement: reshape, permute, expand, pad, shrink, flip, indexing, squeeze, cat and stack, all as VIEW nodes.

Nothing is copied: each movement is a `View` (rules/strided_view.py) over its source. A movement of a tensor that is a VIEW
already is applied to that View, so chains of movements stay one VIEW; where no single View can say it (a reshape
of a permuted view, say) a new VIEW is stacked on top, reading its source's contiguous layout.
"""
from __future__ import annotations
import math
import numpy as np
from rewrite import UOp, Ops, dtypes
from rules.strided_view import View, contiguous_view, moved
from rules.shapes import shape_of
from .args import ints, normalize_axes, axis_of, AxisError, countable
from .promotion import result_dtype
from .assign import view_taken
from .indexing import advanced, gather
from .recorded import recorded


def strided(v: View, steps: tuple[int, ...]) -> View:
  """Every steps[d]-th element of each dimension d, as one View: index k of the result reads index k*step, so
  strides scale by the step and each mask interval [lo, hi) becomes [ceil(lo/step), ceil(hi/step))."""
  shape = tuple(-(-s // st) for s, st in zip(v.shape, steps))
  mask = None if v.mask is None else tuple((-(-lo // st), -(-hi // st)) for (lo, hi), st in zip(v.mask, steps))
  return View(shape, tuple(s * st for s, st in zip(v.strides, steps)), v.offset, mask)


def indexed(v: View, arg: tuple) -> View | None:
  """numpy's basic indexing as one movement (so that `x[0]` makes one tensor, not three): the box `bounds`, the axes
  `flips` reversed, every `steps`-th element, then `shape` (an integer's axis dropped, None's added: a reshape of
  size-1 axes, which any view can say)."""
  bounds, flips, steps, shape = arg
  v = v.shrink(bounds)
  if flips: v = v.flip(flips)
  if any(s != 1 for s in steps): v = strided(v, steps)
  return v.reshape(shape)


def padded_expand(v: View, shape: tuple[int, ...]) -> View | None:
  """v with size-1 dimensions added in front (a reshape) and expanded to `shape`: a broadcast as one movement, so
  that it makes one tensor, not two; None where the reshape is no single view."""
  padded = (1,) * (len(shape) - len(v.shape)) + v.shape
  r = v if padded == v.shape else v.reshape(padded)
  return None if r is None else r.expand(shape)


class MovementMixin:
  __slots__ = ()  # the Tensor's own slots stay its only fields
  def _view(self, move, arg):
    """Apply the movement `move(view, arg)` (a View method, or `strided`) to this tensor: onto its own VIEW when it is
    one and the result is a single View (move gives None where it cannot, as View.reshape does), else as a new VIEW
    on top, over the contiguous layout of this tensor. Movements are remembered by their View and arguments
    (`moved`): a model's forward asks for the same ones on every call."""
    layout = contiguous_view(self.shape)
    stacked = moved(layout, move, arg)  # also checks the arguments against this tensor's shape
    if stacked == layout: return self
    return view_taken(self._moved(move, arg, stacked), self, move, arg, stacked)   # (which memory it shares: tensor/assign.py)

  def _moved(self, move, arg, stacked: View):
    u = self.uop
    if u.op is Ops.VIEW and (merged := moved(u.arg, move, arg)) is not None:
      src = u.src[0]
      # a VIEW that reads its computed source exactly as it is says nothing: drop it (buffers and constants keep
      # theirs, the graph's forms for them are VIEW(BUFFER) and VIEW(CONST))
      if merged.is_contiguous and src.op not in (Ops.BUFFER, Ops.CONST) and shape_of(src) == merged.shape:
        return self._new(src, merged.shape)
      return self._new(UOp(Ops.VIEW, self.dtype, (src,), merged), merged.shape)
    return self._new(UOp(Ops.VIEW, self.dtype, (u,), stacked), stacked.shape)

  def reshape(self, *shape):
    """The same elements in row-major order, in `shape`; one dimension may be -1 (inferred)."""
    shape = ints(shape, "reshape")
    if shape.count(-1) > 1: raise ValueError(f"reshape{shape}: only one dimension can be -1")
    if any(s < -1 for s in shape): raise ValueError(f"reshape{shape}: dimensions must be >= 0 or -1")
    if -1 in shape:
      known = math.prod(s for s in shape if s != -1)
      if known == 0 or self.numel() % known:
        raise ValueError(f"cannot reshape a tensor of shape {self.shape} ({self.numel()} elements) to {shape}")
      shape = tuple(self.numel() // known if s == -1 else s for s in shape)
    if math.prod(shape) != self.numel():
      raise ValueError(f"cannot reshape a tensor of shape {self.shape} ({self.numel()} elements) to {shape} "
                       f"({math.prod(shape)} elements)")
    return self._view(View.reshape, shape)

  def permute(self, *order):
    order = ints(order, "permute")
    if len(order) != self.ndim or sorted(o % self.ndim if self.ndim else o for o in order) != list(range(self.ndim)) \
       or any(not -self.ndim <= o < self.ndim for o in order):
      raise ValueError(f"permute{order} of a tensor of shape {self.shape}: give each axis 0..{self.ndim - 1} once")
    order = tuple(o % self.ndim for o in order)
    return self._view(View.permute, order)

  def transpose(self, a: int = -2, b: int = -1):
    """Swap axes a and b."""
    a, b = axis_of(a, self.shape, "transpose"), axis_of(b, self.shape, "transpose")
    order = list(range(self.ndim))
    order[a], order[b] = order[b], order[a]
    return self._view(View.permute, tuple(order))   # (a permutation already: permute's checks have nothing to find)

  @property
  def T(self):
    """All axes reversed (numpy's .T): the transpose of a matrix; 0-d and 1-d tensors are returned as they are."""
    return self.permute(tuple(reversed(range(self.ndim))))

  def expand(self, *shape):
    """Size-1 dimensions repeated (without copying) to `shape`; -1 keeps a dimension; missing leading dimensions
    are added."""
    shape = ints(shape, "expand")
    if len(shape) < self.ndim:
      raise ValueError(f"expand of a tensor of shape {self.shape} to {shape}: the target has fewer dimensions")
    padded = (1,) * (len(shape) - self.ndim) + self.shape
    shape = tuple(p if s == -1 else s for s, p in zip(shape, padded))
    if any(p != s and p != 1 for s, p in zip(shape, padded)) or any(s < 0 for s in shape):
      raise ValueError(f"cannot expand a tensor of shape {self.shape} to {shape}: only size-1 dimensions can grow")
    countable(shape, f"expand of a tensor of shape {self.shape}")
    return self._view(padded_expand, shape)

  def broadcast_to(self, shape: tuple[int, ...]):
    return self if tuple(shape) == self.shape else self.expand(shape)

  def _broadcast(self, shape: tuple[int, ...]):
    """This tensor broadcast to `shape`, which the caller got from broadcast_shape (so it is one): reshape + expand
    without checking the arguments again."""
    if shape == self.shape: return self
    countable(shape, f"expand of a tensor of shape {self.shape}")
    return self._view(padded_expand, shape)

  def _reshape(self, shape: tuple[int, ...]):
    """reshape to a tuple of ints of this tensor's element count (the caller's own shapes): without checking it
    again."""
    return self._view(View.reshape, shape)

  def pad(self, padding, value=0.0):
    """Grow each dimension by (before, after) elements holding `value`; one pair per dimension, or None for (0, 0).
    A new tensor even where every width is 0 (a copy, as numpy's pad)."""
    out = self._pad(padding, value)
    return self._new_unless_self(out)

  def _pad(self, padding, value=0.0):
    """pad, for the operations built on it: the tensor itself where every width is 0."""
    padding = tuple((0, 0) if p is None else tuple(p) for p in padding)
    if len(padding) != self.ndim or any(len(p) != 2 for p in padding):
      raise ValueError(f"pad {padding} of a tensor of shape {self.shape}: give one (before, after) pair per dimension")
    if any(b < 0 or a < 0 for b, a in padding):
      raise ValueError(f"pad {padding} of a tensor of shape {self.shape}: pads must be >= 0 (use shrink to cut)")
    if all(p == (0, 0) for p in padding): return self
    countable(tuple(s + b + a for s, (b, a) in zip(self.shape, padding)), f"pad {padding} of a tensor of shape {self.shape}")
    out = self._view(View.pad, padding)
    if value == 0 and math.copysign(1, value) > 0: return out  # a masked-off element of a View reads 0 (not -0.0)
    # elsewhere: where(the padded ones mask, x, value); the mask is a padded constant, so no buffer either
    valid = self._const(True, dtypes.bool, self.shape).pad(padding)
    return valid.where(out, value)

  def shrink(self, bounds):
    """The sub-box [start, end) of each dimension; None keeps a dimension whole."""
    bounds = tuple((0, s) if b is None else tuple(b) for b, s in zip(bounds, self.shape)) + \
      ((),) * (len(bounds) - self.ndim)
    if len(bounds) != self.ndim or any(len(b) != 2 for b in bounds):
      raise ValueError(f"shrink {bounds} of a tensor of shape {self.shape}: give one (start, end) pair per dimension")
    if any(not 0 <= b <= e <= s for (b, e), s in zip(bounds, self.shape)):
      raise ValueError(f"shrink {bounds} of a tensor of shape {self.shape}: each pair needs 0 <= start <= end <= size")
    return self._view(View.shrink, bounds)

  def flip(self, axis=None):
    """Reverse the order of elements along `axis` (int or tuple; None: every axis)."""
    axes = normalize_axes(axis, self.shape, "flip")
    axes = tuple(a for a in axes if self.shape[a] > 1)
    return self._view(View.flip, axes) if axes else self

  def squeeze(self, axis=None):
    """Drop size-1 dimensions: all of them, or those named (each must have size 1)."""
    axes = normalize_axes(axis, self.shape, "squeeze")
    if axis is None: axes = tuple(d for d in axes if self.shape[d] == 1)
    elif any(self.shape[d] != 1 for d in axes):
      raise ValueError(f"squeeze({axis}) of a tensor of shape {self.shape}: only size-1 dimensions can be squeezed")
    return self._reshape(tuple(s for d, s in enumerate(self.shape) if d not in axes))

  def unsqueeze(self, axis: int):
    """A new size-1 dimension at `axis` (-ndim-1..ndim)."""
    if not -self.ndim - 1 <= axis <= self.ndim:
      raise AxisError(f"unsqueeze({axis}) of a tensor of shape {self.shape}: axis must be in {-self.ndim - 1}..{self.ndim}")
    axis = axis % (self.ndim + 1)
    return self._reshape(self.shape[:axis] + (1,) + self.shape[axis:])

  def flatten(self, start_dim: int = 0, end_dim: int = -1):
    """Dimensions start_dim..end_dim (inclusive) merged into one."""
    if self.ndim == 0: return self.reshape(1)
    s, e = axis_of(start_dim, self.shape, "flatten"), axis_of(end_dim, self.shape, "flatten")
    if s > e: raise ValueError(f"flatten({start_dim}, {end_dim}) of shape {self.shape}: start_dim comes after end_dim")
    return self.reshape(self.shape[:s] + (math.prod(self.shape[s:e + 1]),) + self.shape[e + 1:])

  def __getitem__(self, idx):
    """numpy indexing: ints, slices (any step), None and Ellipsis select a view; one integer array (a Tensor, numpy
    array or list of ints) on one axis picks elements as numpy's advanced indexing does (tensor/indexing.py):
    `W[ids]` is an embedding lookup. Indices out of range raise IndexError."""
    idx = idx if isinstance(idx, tuple) else (idx,)
    if any(hasattr(i, "uop") or isinstance(i, (np.ndarray, list)) for i in idx): return advanced(self, idx)
    for i in idx:
      if not (i is None or i is Ellipsis or isinstance(i, slice) or
              (isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)))):
        raise TypeError(f"Tensor index {i!r}: only ints, slices, None, ... and integer arrays are supported")
    if sum(i is Ellipsis for i in idx) > 1: raise IndexError("an index can only have a single ellipsis ('...')")
    n_real = sum(i is not None and i is not Ellipsis for i in idx)
    if n_real > self.ndim:
      raise IndexError(f"too many indices for a tensor of shape {self.shape}: {n_real} given, {self.ndim} dims")
    fill = (slice(None),) * (self.ndim - n_real)
    idx = tuple(x for i in idx for x in (fill if i is Ellipsis else (i,))) + (() if Ellipsis in idx else fill)
    bounds, flips, steps, out_shape, d = [], [], [], [], 0
    for i in idx:
      if i is None: out_shape.append(1); continue
      size = self.shape[d]
      if isinstance(i, slice):
        start, stop, step = i.indices(size)
        n = len(range(start, stop, step))
        if step > 0: bounds.append((start, start + (n - 1) * step + 1) if n else (start, start))
        else: bounds.append((start + (n - 1) * step, start + 1) if n else (0, 0)); flips.append(d)
        steps.append(abs(step))
        out_shape.append(n)
      else:
        if not -size <= i < size: raise IndexError(f"index {i} is out of bounds for axis {d} with size {size}")
        bounds.append((int(i) % size, int(i) % size + 1)); steps.append(1)
      d += 1
    flips = tuple(a for a in flips if bounds[a][1] - bounds[a][0] > 1)   # (reversing one element moves nothing)
    return self._view(indexed, (tuple(bounds), flips, tuple(steps), tuple(out_shape)))

  def gather(self, axis: int, index):
    """numpy's take_along_axis: out[..., j, ...] = self[..., index[..., j, ...], ...] along `axis`. `index` (an
    integer Tensor or numpy array) has this tensor's number of dimensions; the other axes broadcast."""
    return gather(self, axis, index)

  @recorded
  def tril(self, k: int = 0):
    """The lower triangle of the last two axes: elements with column - row <= k kept, the others 0."""
    return self._triangle(k, lower=True)

  @recorded
  def triu(self, k: int = 0):
    """The upper triangle of the last two axes: elements with column - row >= k kept, the others 0."""
    return self._triangle(k, lower=False)

  def _triangle(self, k: int, lower: bool):
    what = "tril" if lower else "triu"
    if self.ndim < 2: raise ValueError(f"{what} of a tensor of shape {self.shape}: it needs at least 2 dimensions")
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)): raise TypeError(f"{what}(k={k!r}): k must be an int")
    n, m = self.shape[-2:]
    offset = self.arange(m, device=self.device).reshape(1, m) - self.arange(n, device=self.device).reshape(n, 1)
    keep = offset <= int(k) if lower else offset >= int(k)
    return keep.where(self, self._const(False if self.dtype.is_bool else 0, self.dtype, ()))

  def cat(self, *others, axis: int = 0):
    """Join tensors of one shape (but along `axis`) end to end: `Tensor.cat(a, b, c, axis=0)` or `a.cat(b, c)`.
    Each is padded to the joined size with zeros, and the padded tensors are added."""
    ts = (self,) + tuple(others[0] if len(others) == 1 and isinstance(others[0], (list, tuple)) else others)
    if self.ndim == 0: raise ValueError("cat of 0-d tensors: there is no axis to join along (use stack)")
    ax = axis_of(axis, self.shape, "cat")
    for t in ts[1:]:
      if t.ndim != self.ndim or any(a != b for d, (a, b) in enumerate(zip(t.shape, self.shape)) if d != ax):
        raise ValueError(f"cat along axis {axis}: shapes {', '.join(str(x.shape) for x in ts)} differ off that axis")
    if len(ts) == 1: return self.clone()   # (numpy's concatenate is a copy, of one array too)
    dt = result_dtype(ts)
    total, start, out = sum(t.shape[ax] for t in ts), 0, None
    for t in ts:
      pads = tuple((start, total - start - t.shape[ax]) if d == ax else (0, 0) for d in range(self.ndim))
      part = t.cast(dt)._pad(pads)
      out = part if out is None else out + part
      start += t.shape[ax]
    return out

  def stack(self, *others, axis: int = 0):
    """Tensors of one shape joined along a new axis: `Tensor.stack(a, b, axis=0)` or `a.stack(b)`."""
    ts = (self,) + tuple(others[0] if len(others) == 1 and isinstance(others[0], (list, tuple)) else others)
    for t in ts[1:]:
      if t.shape != self.shape: raise ValueError(f"stack: shapes {', '.join(str(x.shape) for x in ts)} differ")
    if not -self.ndim - 1 <= axis <= self.ndim:
      raise AxisError(f"stack: axis {axis} is out of range for tensors of shape {self.shape}")
    return ts[0].unsqueeze(axis).cat(*(t.unsqueeze(axis) for t in ts[1:]), axis=axis)

  def repeat(self, *repeats):
    """The tensor tiled `repeats[d]` times along each dimension d (torch's repeat, numpy's tile)."""
    repeats = ints(repeats, "repeat")
    if len(repeats) < self.ndim: raise ValueError(f"repeat{repeats} of shape {self.shape}: give one count per dimension")
    x = self.reshape((1,) * (len(repeats) - self.ndim) + self.shape)
    inter = tuple(v for s in x.shape for v in (1, s))
    big = x.reshape(inter).expand(tuple(v for r, s in zip(repeats, x.shape) for v in (r, s)))
    out = big.reshape(tuple(r * s for r, s in zip(repeats, x.shape)))
    # a copy, as numpy's tile, also where the counts let a view say it (all 1, or new leading dimensions only)
    return out.clone() if out is self or out._viewing is not None else out
