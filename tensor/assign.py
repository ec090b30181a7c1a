"""In-place updates: `Tensor.assign(value)` and `t[index] = value` write into the tensor's memory, and views write
through, as in numpy and torch.

Views. A tensor made from another by movements that one strided view can say, without padding (reshape, permute,
slicing and indexing with any step, flip, expand, squeeze...), is a view of that tensor: they share memory, and an
update through either is seen by both (`row = W[0]; row[:] = 0` zeroes W's first row; `W[0, 0] = 5` shows in `row`),
as in numpy and torch. A movement that numpy answers with a copy is a new tensor here too: `pad`, and a reshape that
no single strided view can say (of a permuted tensor, say). Writing into an expanded view, whose elements share
memory, is a ValueError, as in torch. A view of a lazy tensor becomes a view of its memory when that tensor is
realized (an update of it realizes it first). The registry below knows, for each view tensor alive, what it views:
a Buffer (memory) and where, or the lazy tensor it was taken from.

Other lazy tensors follow eager execution in program order: one built before an update reads the old values, one
built after reads the new ones. How:
  - The update runs at once, as one realize whose output is written into the target's buffer through the view the
    index selects (rules/host.py: stored there directly when the kernel reads the target only at the element it
    writes, else computed aside and copied).
  - Lazy graphs built before the update hold the target's BUFFER node (its Buffer object is the version they read).
    When one may still read it, the old contents are kept for them: that Buffer object gets a copy of its contents in
    new memory, and the views continue as a new Buffer object that takes over the original memory, into which the
    update writes. "May still read it" is: the value being written reads the target (it is itself such a graph, and
    the caller may keep it), or the target's BUFFER node is still alive once the views let go of it and the cyclic
    garbage collector has run. Otherwise the same Buffer object is written.
Errors (a shape that does not broadcast to the selection, another dtype) are raised before anything is written.
"""
from __future__ import annotations
import gc, threading, weakref
import numpy as np
from rewrite import UOp, Ops, dtypes
from rules.strided_view import View, moved
from .promotion import is_scalar, check_fits


def value_tensor(target, value, shape: tuple[int, ...], what: str):
  """`value` (a Tensor, numpy array, nested list or Python scalar) as a tensor of `shape` on the target's device, checked."""
  if is_scalar(value) and not isinstance(value, np.ndarray):
    return target._const(check_fits(value, target.dtype, what), shape=shape)
  if isinstance(value, (list, tuple)): value = type(target)(value, dtype=target.dtype, device=target.device)
  if isinstance(value, np.ndarray) and target.dtype is dtypes.bfloat16 and value.dtype.kind == 'f':
    value = type(target)(value, dtype=target.dtype, device=target.device)   # rounded to bfloat16, as Tensor() does
  if isinstance(value, np.ndarray):
    if value.dtype != target.dtype.np:
      raise TypeError(f"{what}: a numpy array of dtype {value.dtype} cannot be written into a tensor of dtype "
                      f"{target.dtype.name}; convert it first (arr.astype(np.{target.dtype.np}))")
    value = type(target)(value, device=target.device)
  if not hasattr(value, "uop"): raise TypeError(f"{what}: the value must be a Tensor, a numpy array or a scalar, not {type(value).__name__}")
  if value.dtype is not target.dtype:
    raise TypeError(f"{what}: a value of dtype {value.dtype.name} cannot be written into a tensor of dtype "
                    f"{target.dtype.name}; cast it first (value.cast(...))")
  try: from .elementwise import broadcast_shape; ok = broadcast_shape(value.shape, shape) == tuple(shape)
  except ValueError: ok = False
  if not ok: raise ValueError(f"{what}: a value of shape {value.shape} cannot be broadcast to the selection's shape {tuple(shape)}")
  return value.to(target.device).broadcast_to(tuple(shape))


# ---- the registry of views ----
# Each tensor's own entry is its `_viewing` slot (None: it views nothing). The index from a base to the tensors that
# may view it holds plain weak references (no callback: a tensor made and dropped costs no bookkeeping when it dies);
# a reference that is dead, or whose tensor now views something else, is skipped when read and pruned once its
# base's table has doubled since the last pruning (and bases that are gone, once the index has).

class _Entry:
  __slots__ = ("base", "view", "key", "root")
  def __init__(self, base, view: View, key: int):
    self.base = base    # a Buffer (the view is of memory), or a weakref to the lazy tensor the view was taken from
    self.view = view    # where the tensor's elements are in the base's memory, or in its contiguous layout
    self.key = key      # id of the base when registered (the index below)
    # the lazy tensor itself, kept alive by its views: two views of one (y = (a @ b).reshape(6); z = y[::-1]) share its
    # memory once it is realized, as numpy's do, though the caller dropped it (its graph lives in theirs anyway)
    self.root = base() if base.__class__ is weakref.ref else None

  def base_is(self, base) -> bool: return (self.base() if self.base.__class__ is weakref.ref else self.base) is base


class _Viewers(dict):   # id(tensor) -> weakref to it, for one base
  __slots__ = ("limit",)


_by_base: dict[int, _Viewers] = {}        # id(Buffer or lazy tensor) -> the tensors that may view it
_index_limit = 64                         # prune bases that are gone once the index holds this many
_lock = threading.RLock()                 # (tensors are made and realized from several threads)


def _register(t, base, view: View) -> None:
  key = id(base() if base.__class__ is weakref.ref else base)
  t._viewing = _Entry(base, view, key)
  with _lock:
    if (viewers := _by_base.get(key)) is None:
      if len(_by_base) >= _index_limit: _prune_index()
      viewers = _by_base[key] = _Viewers(); viewers.limit = 16
    viewers[id(t)] = weakref.ref(t)
    if len(viewers) > viewers.limit:
      for tid, ref in list(viewers.items()):
        if (v := ref()) is None or v._viewing is None or v._viewing.key != key: del viewers[tid]
      viewers.limit = max(16, 2 * len(viewers))


def _prune_index() -> None:
  global _index_limit
  for key, viewers in list(_by_base.items()):
    if not any((v := ref()) is not None and v._viewing is not None and v._viewing.key == key for ref in viewers.values()):
      del _by_base[key]
  _index_limit = max(64, 2 * len(_by_base))


def _unregister(t) -> None: t._viewing = None


def drop_internal_view(t) -> None:
  """t is a recorded composite's first result (tensor/recorded.py): a view it takes of a lazy tensor is of one made
  inside the composite, which no one else holds. It is no view, as the composite's replays are not (and its first
  call's program is theirs)."""
  if (e := t._viewing) is not None and isinstance(e.base, weakref.ref): _unregister(t)


def _viewers(base) -> list:
  """The live tensors that view `base` (a Buffer or a lazy tensor), with their entries."""
  with _lock: refs = list(_by_base.get(id(base), {}).values())
  return [(t, e) for r in refs if (t := r()) is not None and (e := t._viewing) is not None and e.base_is(base)]


def _entry(t) -> _Entry | None: return t._viewing


def is_view(t) -> bool:
  """Whether t views another tensor's memory (or a lazy tensor's, which will be memory): realizing it means nothing."""
  e = _entry(t)
  return e is not None and (isinstance(e.base, weakref.ref) or not (t.uop.op is Ops.VIEW and t.uop.arg.is_contiguous
                                                                    and t.uop.arg.size == e.base.size))


def to_realize(t):
  """The tensor whose realize makes t memory: t itself (no view), the lazy tensor it views (which makes t a view of
  that tensor's memory, `realized`, and which the view keeps alive), or None when t views memory already."""
  e = _entry(t)
  if e is None: return t
  if not isinstance(e.base, weakref.ref): return None if is_view(t) else t
  return e.root


def pending(tensors) -> list:
  """The tensors whose realize makes all of `tensors` memory (`to_realize`), each once, in order; none already memory."""
  return [r for r in dict.fromkeys(to_realize(t) for t in tensors if not t.is_realized) if r is not None and not r.is_realized]


def note(t):
  """Record that t views memory, if its graph is VIEW(BUFFER) without padding (the owner of a buffer, or a view of
  it); returns t. Called for every tensor that Tensor makes."""
  u = t.uop
  if u.op is Ops.VIEW and u.src[0].op is Ops.BUFFER and u.arg.mask is None: _register(t, u.src[0].arg, u.arg)
  return t


def view_taken(t, parent, move, arg, stacked: View):
  """t was made from `parent` by the movement `move(view, arg)` (tensor/movement.py), which reads the contiguous
  layout of the parent as `stacked`. When the parent is lazy, t is a view of the lazy tensor at the root of the
  movements, where the movement (applied to where the parent's elements are in the root) says a single view without
  padding; otherwise it is a copy, as numpy's reshape makes one."""
  if (e := _entry(t)) is not None and not isinstance(e.base, weakref.ref): return t   # a view of memory (note)
  pe = _entry(parent)
  if pe is None:
    if parent.uop.op is Ops.VIEW and parent.uop.src[0].op is Ops.BUFFER: return t    # (a padded view of memory)
    root, where = parent, stacked
  elif isinstance(pe.base, weakref.ref): root, where = pe.root, moved(pe.view, move, arg)
  else: return t
  if where is None or where.mask is not None: _unregister(t)
  else: _register(t, weakref.ref(root), where)
  return t


def realized(t) -> None:
  """t (no view) was just realized into memory of its own: it owns that memory now, and the views taken from it while
  it was lazy view the memory."""
  u = t.uop
  _register(t, u.src[0].arg, u.arg)
  for v, e in _viewers(t):
    v.uop = UOp(Ops.VIEW, v.dtype, (u.src[0],), e.view)
    _register(v, u.src[0].arg, e.view)


def _as_memory_view(target) -> None:
  """Make target.uop VIEW(BUFFER) of the memory it views: realizing the lazy tensor it is a view of, or itself when it
  is no view (it then owns the memory)."""
  e = _entry(target)
  if e is not None and isinstance(e.base, weakref.ref):
    e.root.realize()   # the view becomes a view of its memory (`realized`)
    e = _entry(target)
  if e is None or isinstance(e.base, weakref.ref):
    target.realize()
    if _entry(target) is None: note(target)
    return
  buf = e.base
  target.uop = UOp(Ops.VIEW, buf.dtype, (UOp(Ops.BUFFER, buf.dtype, (), buf),), e.view)


def setitem(target, index, value) -> None:
  _as_memory_view(target)
  view = target._selected_view(index)
  write(target, view, value_tensor(target, value, view.shape, f"t[{index!r}] = ..."))


def assign(target, value) -> None:
  if hasattr(value, "shape") and not is_scalar(value) and tuple(value.shape) != target.shape:
    raise ValueError(f"assign: a value of shape {tuple(value.shape)} cannot be assigned to a tensor of shape {target.shape}")
  _as_memory_view(target)
  write(target, target.uop.arg, value_tensor(target, value, target.shape, "assign"))


def write(target, view: View, value) -> None:
  """Write tensor `value` (already of view.shape, checked) into the memory target views, at `view` of that memory."""
  write_many([(target, view, value)])


def _lose(t, dtype, error: BaseException) -> None:
  """t (emptied for a realize that failed) as a tensor without a value, whose every use names the failure."""
  from runtime.buffer import LostBuffer
  buf = LostBuffer(t.device, t.numel(), dtype, f"{type(error).__name__}: {error}")
  t.uop = UOp(Ops.VIEW, dtype, (UOp(Ops.BUFFER, dtype, (), buf),), View.contiguous(t.shape))


def write_many(writes: list, also=(), private: bool = False) -> None:
  """Each (target, view, value) of `writes` (targets views of memory, values checked, no two targets one memory)
  written as by write(), all in ONE realize, which also realizes the tensors of `also` (an optimizer's step: every
  parameter and state, and the gradients and loss its updates read). Every value reads the old contents of every
  target. `private`: the caller keeps none of the value tensors (an optimizer's updates, made for this write): they
  are emptied once the program is found, so only the caller's other lazy tensors count as readers of the old
  contents (see the module's docstring)."""
  from runtime.realize import realize
  writes = [(t, v, x) for t, v, x in writes if v.size != 0]
  for _, view, _ in writes:
    if any(st == 0 and n > 1 for n, st in zip(view.shape, view.strides)):
      raise ValueError(f"an in-place update of {view.shape} elements of which several are one element in memory (a "
                       f"view made by expand): write into the tensor it expands, or into a copy of it (t + 0)")
  if not writes: return
  also = pending(also)
  bufs = [target.uop.src[0].arg for target, _, _ in writes]
  outputs = [(value.uop, target.device) for target, _, value in writes] + [(a.uop, a.device) for a in also]
  targets = [(target.uop.src[0], view) for target, view, _ in writes] + [None] * len(also)
  holders = [weakref.ref(target.uop.src[0]) for target, _, _ in writes]
  lent = list({id(t): t for t in also + ([value for _, _, value in writes] if private else [])}.values())
  lent_dtypes = [t.dtype for t in lent]
  views = [[(t, e.view) for t, e in _viewers(buf)] for buf in bufs]
  dests = list(bufs)

  def keep_old_contents(inputs: list) -> list:
    # the program is found: every graph of this write lets go of the old versions (the tensors it realizes get their
    # results, the views their new version, below), so a BUFFER node still alive is held by a lazy graph of the
    # caller's, which must read the old contents after the write: they are copied aside for it (split_version)
    outputs.clear(); targets.clear()
    for t in lent: t.uop = None
    for t, _ in (tv for vs in views for tv in vs): t.uop = None
    if any(h() is not None for h in holders): gc.collect()   # (once for all targets: a collection is not cheap)
    swap = {}
    for i, (buf, holder) in enumerate(zip(bufs, holders)):
      if holder() is not None: dests[i] = swap[buf] = buf.split_version()
    return [swap.get(b, b) for b in inputs] if swap else inputs

  try: outs = realize(outputs, targets, keep_old_contents)
  except BaseException as e:   # the tensors it was computing had let their graphs go: each says so when used
    for t, dtype in zip(lent, lent_dtypes):
      if t.uop is None: _lose(t, dtype, e)
    if (written := getattr(e, "written_inputs", None)) is not None:
      new = sum(any(d is w for w in written) for d in dests)
      e.add_note(f"the in-place update stopped partway: {new} of the {len(dests)} tensors it writes hold their new "
                 f"values, the others their old ones")
    raise
  finally:   # (after a failure too: the views stay usable, over what the run had written)
    for buf, dest, vs in zip(bufs, dests, views):
      node = UOp(Ops.BUFFER, dest.dtype, (), dest)
      for t, v in vs:
        t.uop = UOp(Ops.VIEW, dest.dtype, (node,), v)
        _register(t, dest, v)
  for a, u in zip(also, outs[len(writes):]):
    a.uop = u
    realized(a)
