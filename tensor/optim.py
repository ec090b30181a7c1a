"""Optimizers: SGD (momentum, dampening, Nesterov, weight decay), Adam and AdamW, with torch's semantics and defaults.

`step()` builds every update as a lazy graph and writes them all in ONE realize (tensor/assign.py `write_many`): the
parameters, the optimizer's state, the gradients (kept realized in `.grad`, as torch keeps them) and the loss
backward() was called on, so the forward pass, the backward pass and the update run together. The learning rate and
the step count live in tensors, not in the graph as constants: a new learning rate or the next step reuses the
compiled program instead of compiling another, and a `jit` step (tensor/jit.py) replays it, updating that state.
"""
from __future__ import annotations
import numpy as np
from rules.strided_view import View
from .tensor import Tensor
from .assign import write_many
from .autograd import pending_losses


def _scalar(value: float, like: Tensor) -> Tensor:
  return Tensor(np.array(value, dtype=like.dtype.np), device=like.device)


class Optimizer:
  def __init__(self, params, lr: float):
    self.params: list[Tensor] = list(params)
    if not self.params: raise ValueError(f"{type(self).__name__}: the parameter list is empty")
    for p in self.params:
      if not isinstance(p, Tensor): raise TypeError(f"{type(self).__name__}: parameters must be Tensors, not {type(p).__name__}")
      if not p.requires_grad: p.requires_grad = True
    if lr < 0: raise ValueError(f"{type(self).__name__}: invalid learning rate {lr}")
    self._lr, self._lr_value = _scalar(lr, self.params[0]), lr   # the tensor the graphs read, the value as given

  @property
  def lr(self) -> float: return self._lr_value

  @lr.setter
  def lr(self, value: float):
    self._lr.assign(np.array(value, dtype=self._lr.dtype.np))
    self._lr_value = value

  def zero_grad(self) -> None:
    """Forget every parameter's gradient (torch's default, set_to_none=True): the next backward() starts afresh."""
    for p in self.params: p.grad = None

  def step(self) -> None:
    """Update every parameter that has a gradient, in one realize."""
    live = [p for p in self.params if p.grad is not None]
    if not live: raise RuntimeError(f"{type(self).__name__}.step(): no parameter has a gradient; call loss.backward() first")
    writes = []
    scalars = self._prepare()   # (a local: nothing of this step's graphs outlives the write, tensor/assign.py)
    for i, p in enumerate(self.params):
      if p.grad is None: continue
      for target, value in self._update(i, p, p.grad, scalars):
        writes.append((target, View.contiguous(target.shape), value.cast(target.dtype)))
    writes += self._counters()
    del scalars   # (read the counters' old values: held here, they would be kept aside for it)
    write_many(writes, also=[p.grad for p in live] + pending_losses(), private=True)

  def _counters(self) -> list: return []

  def _prepare(self):
    """This step's scalars that every parameter's update reads: built once, not once per parameter."""

  def _update(self, i: int, p: Tensor, g: Tensor, scalars) -> list[tuple[Tensor, Tensor]]:
    """(tensor, its new value) for parameter i and its state; `scalars` what _prepare made for this step."""
    raise NotImplementedError


class SGD(Optimizer):
  """torch.optim.SGD: g += weight_decay * p; with momentum, buf = g on the first step, then momentum * buf +
  (1 - dampening) * g; g = g + momentum * buf (nesterov) or buf; p -= lr * g."""
  def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
               nesterov: bool = False):
    super().__init__(params, lr)
    if nesterov and (momentum <= 0 or dampening != 0):
      raise ValueError("SGD: Nesterov momentum needs a momentum > 0 and zero dampening")
    self.momentum, self.dampening, self.weight_decay, self.nesterov = momentum, dampening, weight_decay, nesterov
    self.buffers: list[Tensor | None] = [None] * len(self.params)

  def _update(self, i, p, g, scalars):
    if self.weight_decay: g = g + self.weight_decay * p
    out = []
    if self.momentum:
      buf = self.buffers[i]
      if buf is None:  # the first step: the buffer is the gradient itself
        buf = self.buffers[i] = Tensor.zeros(*p.shape, dtype=p.dtype, device=p.device).contiguous().realize()
        new = g
      else: new = buf * self.momentum + g * (1 - self.dampening)
      out.append((buf, new))
      g = g + new * self.momentum if self.nesterov else new
    return out + [(p, p - self._lr * g)]


class Adam(Optimizer):
  """torch.optim.Adam: g += weight_decay * p (L2); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
  p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)."""
  decoupled = False

  def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
    super().__init__(params, lr)
    if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1): raise ValueError(f"{type(self).__name__}: invalid betas {betas}")
    self.b1, self.b2, self.eps, self.weight_decay = betas[0], betas[1], eps, weight_decay
    p0 = self.params[0]
    self.m = [Tensor.zeros(*p.shape, dtype=p.dtype, device=p.device).contiguous().realize() for p in self.params]
    self.v = [Tensor.zeros(*p.shape, dtype=p.dtype, device=p.device).contiguous().realize() for p in self.params]
    # b1^t and b2^t, updated in the same realize as the parameters
    self.b1_t, self.b2_t = _scalar(1.0, p0), _scalar(1.0, p0)

  def _counters(self):
    return [(t, View.contiguous(()), t * b) for t, b in ((self.b1_t, self.b1), (self.b2_t, self.b2))]

  def _prepare(self):
    # this step's 1 - b1^t and 1 - b2^t, and what the update reads of them: (step size, sqrt(1 - b2^t), decay)
    return (self._lr / (1 - self.b1_t * self.b1), (1 - self.b2_t * self.b2).sqrt(),
            1 - self._lr * self.weight_decay if self.weight_decay and self.decoupled else None)

  def _update(self, i, p, g, scalars):
    step_size, bias2_root, decay = scalars
    if self.weight_decay and not self.decoupled: g = g + self.weight_decay * p
    p_decayed = p if decay is None else p * decay
    m = self.m[i] * self.b1 + g * (1 - self.b1)
    v = self.v[i] * self.b2 + (g * g) * (1 - self.b2)
    new_p = p_decayed - step_size * m / (v.sqrt() / bias2_root + self.eps)
    return [(self.m[i], m), (self.v[i], v), (p, new_p)]


class AdamW(Adam):
  """torch.optim.AdamW: Adam whose weight decay is decoupled (p *= 1 - lr * weight_decay before the Adam update),
  weight_decay 0.01 by default."""
  decoupled = True

  def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
    super().__init__(params, lr, betas, eps, weight_decay)
