"""Gradients of tensors: `requires_grad`, `backward()`, `.grad`, `gradient()`, `detach()` and `no_grad`.

Nothing is recorded while the program runs forward: a lazy tensor already is its graph. `backward()` hands that graph
to the reverse walk of rules/gradient.py, which builds the gradient graph from the gradient rules; `.grad` is a lazy
tensor of that graph, so the next realize (the optimizer's step, say) computes forward and backward together.

A tensor takes part as a target through its node in the graph: a realized tensor through its BUFFER (so every view
of its memory, `w.T` included, passes its gradient on to it), a lazy one through its own node. Setting
requires_grad realizes a lazy tensor first (a leaf is memory of its own, as in torch): two equal lazy tensors are one
node, and would share their gradients.
"""
from __future__ import annotations
import contextlib, threading, weakref
from rewrite import UOp, Ops
from rules.gradient import gradients, reshape, shrink
from rules.shapes import shape_of

_requiring: weakref.WeakSet = weakref.WeakSet()   # every live tensor with requires_grad=True
_pending: list = []                                # weak references to tensors backward() was called on, not realized
_state = threading.local()


def grad_enabled() -> bool: return getattr(_state, "disabled", 0) == 0


class no_grad(contextlib.ContextDecorator):
  """`with no_grad(): ...` (or `@no_grad()`): tensors made inside pass no gradient to what they were made from
  (each result is detached), and backward()/gradient() refuse to run."""
  def __enter__(self): _state.disabled = getattr(_state, "disabled", 0) + 1; return self
  def __exit__(self, *exc): _state.disabled -= 1; return False


def target_node(t) -> UOp:
  """The node through which tensor t receives its gradient."""
  return t.uop.src[0] if t.is_realized else t.uop


def requiring() -> list:
  """Every live tensor with requires_grad=True."""
  return list(_requiring)


def pending_losses() -> list:
  """Tensors backward() ran on that are still alive and lazy (taken: the list empties): an optimizer's step realizes
  them with its updates, so reading the loss afterwards costs nothing."""
  alive = [t for r in _pending if (t := r()) is not None and not t.is_realized]
  _pending.clear()
  return alive


class AutogradMixin:
  __slots__ = ()  # the Tensor's own slots stay its only fields

  @property
  def requires_grad(self) -> bool: return self._requires_grad

  @requires_grad.setter
  def requires_grad(self, value: bool):
    if value:
      if not self.dtype.is_float: raise TypeError(f"only floating-point tensors can require gradients, not {self.dtype.name}")
      # a leaf is memory of its own, as torch's: two equal lazy tensors are one node (hash-consing), and as targets
      # they would share their gradients (`Tensor.full((2, 2), 1.0)` twice: each .grad the sum of both)
      if not self.is_realized: self.realize()
      _requiring.add(self)
    else: _requiring.discard(self)
    self._requires_grad = bool(value)

  def requires_grad_(self, value: bool = True):
    self.requires_grad = value
    return self

  def detach(self):
    """This tensor's value as a new tensor through which no gradient flows."""
    return self._new(UOp(Ops.DETACH, self.dtype, (self.uop,)))

  def gradient(self, *targets, gradient=None) -> list:
    """The gradients of this tensor with respect to `targets` (lazy tensors of the targets' shapes), leaving every
    `.grad` as it is. This tensor must have one element unless `gradient` (of its shape) seeds the walk. A target
    this tensor does not depend on gets zeros."""
    if not grad_enabled(): raise RuntimeError("gradient() inside no_grad(): gradients are off here")
    if not targets: raise ValueError("gradient() needs at least one target tensor")
    for t in targets:
      if not hasattr(t, "uop"): raise TypeError(f"gradient(): targets must be Tensors, not {type(t).__name__}")
      if not t.dtype.is_float: raise TypeError(f"gradient(): a target of dtype {t.dtype.name} has no gradient (floats only)")
    seed = self._seed(gradient, "gradient()")
    grads = gradients(self.uop, seed.uop, [target_node(t) for t in targets])
    return [_as_grad(t, g) for t, g in zip(targets, grads)]

  def backward(self, gradient=None) -> None:
    """Add the gradient of this tensor (one element: a loss) to the `.grad` of every tensor with requires_grad=True
    it depends on. Lazy: the gradients are computed by the next realize that needs them."""
    if not grad_enabled(): raise RuntimeError("backward() inside no_grad(): gradients are off here")
    seed = self._seed(gradient, "backward()")
    graph = self.uop.toposort
    targets = [t for t in list(_requiring) if target_node(t) in graph]
    if not targets:
      raise RuntimeError("backward(): this tensor depends on no tensor with requires_grad=True (make parameters with "
                         "Tensor(data, requires_grad=True))")
    for t, g in zip(targets, gradients(self.uop, seed.uop, [target_node(t) for t in targets])):
      if g is None: continue
      g = _as_grad(t, g)
      t.grad = g if t.grad is None else t.grad + g
    _pending.append(weakref.ref(self))

  def _seed(self, gradient, what: str):
    if not self.dtype.is_float: raise TypeError(f"{what} of a {self.dtype.name} tensor: only floats have gradients")
    if gradient is None:
      if self.numel() != 1:
        raise ValueError(f"{what} of a tensor of shape {self.shape}: only a tensor of one element (a loss) has an "
                         f"implicit gradient; pass gradient= (a tensor of shape {self.shape}) or reduce it first (.sum())")
      return self.ones_like()
    if not hasattr(gradient, "uop"): gradient = type(self)(gradient, dtype=self.dtype, device=self.device)
    if gradient.shape != self.shape:
      raise ValueError(f"{what}: gradient of shape {gradient.shape} for a tensor of shape {self.shape}")
    return gradient.cast(self.dtype)


def _as_grad(t, g: UOp | None):
  """The gradient graph of target t as a tensor of t's shape and dtype (a BUFFER's gradient is flat: reshaped at the
  graph's level, so the gradient is a tensor of its own, not a view of a temporary one)."""
  if g is None: return t.zeros_like()
  if shape_of(g) != t.shape:   # a realized target's buffer, flat: its first numel elements are the tensor
    if shape_of(g) != (t.numel(),): g = shrink(g, ((0, t.numel()),))
    g = reshape(g, t.shape)
  return t._from_uop(g, t.shape, t.device).cast(t.dtype)
