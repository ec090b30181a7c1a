"""Neural-network functions, each a composition of the tensor primitives: matmul, dot, softmax, log_softmax, logsumexp,
layernorm, linear, masked_fill, one_hot, cross_entropy, conv2d and pooling.

A matrix product is a broadcast multiply followed by a sum over the shared axis, so it fuses into ONE kernel. A
convolution reads its input through ONE strided VIEW of sliding windows (shape (N, C, OH, OW, KH, KW) over the
padded input's layout), so it too is a multiply and a sum: one kernel, no im2col buffer (with padding, a copy of the
padded input comes first, so that the convolution's loops carry no masks).
"""
from __future__ import annotations
import math
import numpy as np
from rewrite import UOp, Ops
from rules.strided_view import View, compose
from .elementwise import broadcast_shape
from .recorded import recorded
from .promotion import is_scalar, py_scalar, check_fits
from .indexing import as_index, one_hot, pick


def _pair(v, what: str) -> tuple[int, int]:
  t = tuple(v) if isinstance(v, (tuple, list)) else (v, v)
  if len(t) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in t):
    raise ValueError(f"{what}={v!r}: give an int >= 0 or a pair of them")
  return t


def _mul_sum(a, b, axis, dtype=None):
  """sum(a * b) over axis. float16 (or bfloat16) operands multiply and add up in float32 (exact products, one
  rounding at the end), which is also the pattern a tensor-core rule looks for."""
  if a.dtype.is_half and a.dtype is b.dtype:
    return (a.float() * b.float()).sum(axis, dtype=dtype or a.dtype)
  return (a * b).sum(axis, dtype=dtype)


class NNMixin:
  __slots__ = ()  # the Tensor's own slots stay its only fields
  @recorded
  def matmul(self, w, dtype=None):
    """numpy's matmul: (..., n, k) @ (..., k, m) -> (..., n, m) with batch dims broadcast; a 1-d left operand is a
    row (k,), a 1-d right one a column, and their added dim is removed again. float16 accumulates in float32 and
    rounds at the end (`dtype` picks the result dtype)."""
    if not hasattr(w, "uop"): w = type(self)(w, device=self.device)
    if self.ndim == 0 or w.ndim == 0:
      raise ValueError(f"matmul of shapes {self.shape} and {w.shape}: 0-d operands are not allowed (use *)")
    a = self.reshape(1, self.shape[0]) if self.ndim == 1 else self
    b = w.reshape(w.shape[0], 1) if w.ndim == 1 else w
    if a.shape[-1] != b.shape[-2]:
      raise ValueError(f"matmul of shapes {self.shape} and {w.shape}: inner dimensions {a.shape[-1]} and {b.shape[-2]} differ")
    try: broadcast_shape(a.shape[:-2], b.shape[:-2])
    except ValueError: raise ValueError(f"matmul of shapes {self.shape} and {w.shape}: the batch dimensions "
                                        f"{a.shape[:-2]} and {b.shape[:-2]} cannot be broadcast together") from None
    # (..., n, 1, k) * (..., 1, m, k), summed over k: the product's last axis is the reduced one
    out = _mul_sum(a.unsqueeze(-2), b.transpose(-1, -2).unsqueeze(-3), -1, dtype)
    if self.ndim == 1: out = out.squeeze(-2)
    if w.ndim == 1: out = out.squeeze(-1)
    return out

  def __matmul__(self, w): return self.matmul(w)
  def __rmatmul__(self, x): return type(self)(x, device=self.device).matmul(self)

  def dot(self, w):
    """numpy's dot: * for 0-d operands, the inner product of 1-d ones, and for N-d the sum over this tensor's last
    axis and w's second-to-last (its last when 1-d): shape self.shape[:-1] + w.shape[:-2] + w.shape[-1:]."""
    if not hasattr(w, "uop"): w = type(self)(w, device=self.device)
    if self.ndim == 0 or w.ndim == 0: return self * w
    k = self.shape[-1]
    wk = w.shape[-2] if w.ndim >= 2 else w.shape[0]
    if k != wk: raise ValueError(f"dot of shapes {self.shape} and {w.shape}: summed dimensions {k} and {wk} differ")
    if w.ndim == 1: return (self * w).sum(-1)
    wt = w.transpose(-1, -2)  # (*B, m, k)
    a = self.reshape(self.shape[:-1] + (1,) * (w.ndim - 1) + (k,))
    return (a * wt.reshape((1,) * (self.ndim - 1) + wt.shape)).sum(-1)

  def linear(self, weight, bias=None):
    """x @ weight.T (+ bias), with weight of shape (out_features, in_features) as in torch.nn.Linear."""
    if weight.ndim != 2: raise ValueError(f"linear: weight must be 2-d (out, in), got shape {weight.shape}")
    out = self @ weight.T
    if bias is not None:
      if bias.shape != (weight.shape[0],):
        raise ValueError(f"linear: bias of shape {bias.shape} does not match weight of shape {weight.shape}")
      out = out + bias
    return out

  @recorded
  def softmax(self, axis: int = -1):
    """exp(x - max) / sum(exp(x - max)) along axis; subtracting the max keeps exp from overflowing. (Any constant
    shift gives the same values, so the max passes no gradient, as in torch: the backward pass never reads it.) Each
    row is multiplied by the reciprocal of its sum (as torch does), computed once: a division per element was 15% of
    the CPU's softmax kernel of the attn workload (8x512x512, one thread: 2.20 -> 1.88 ms)."""
    e = (self - self.max(axis, keepdim=True).detach()).exp()
    return e * e.sum(axis, keepdim=True).reciprocal()

  @recorded
  def log_softmax(self, axis: int = -1):
    shifted = self - self.max(axis, keepdim=True).detach()   # (a constant shift: see softmax)
    return shifted - shifted.exp().sum(axis, keepdim=True).log()

  @recorded
  def logsumexp(self, axis=-1, keepdim: bool = False):
    """log(sum(exp(x))) along axis, computed as max + log(sum(exp(x - max))) so that exp cannot overflow; a row of
    -inf gives -inf (its max is taken as 0 there, not -inf, which would make x - max NaN)."""
    m = self.max(axis, keepdim=True).detach()   # (a constant shift: see softmax)
    m = (m.abs() == math.inf).where(0.0, m) if self.dtype.is_float else m.float()
    out = (self - m).exp().sum(axis, keepdim=True).log() + m
    return out if keepdim else out.squeeze(axis)

  @recorded
  def masked_fill(self, mask, value):
    """`value` where `mask` (a bool tensor or numpy array broadcastable to this shape) is true, this tensor elsewhere;
    the result keeps this tensor's dtype (a value it cannot hold exactly raises)."""
    if not hasattr(mask, "uop"): mask = type(self)(np.asarray(mask), device=self.device)
    if not mask.dtype.is_bool: raise TypeError(f"masked_fill: the mask must be a bool tensor, not {mask.dtype.name}")
    try: ok = broadcast_shape(mask.shape, self.shape) == self.shape
    except ValueError: ok = False
    if not ok: raise ValueError(f"masked_fill: a mask of shape {mask.shape} does not broadcast to the tensor's {self.shape}")
    if hasattr(value, "uop"):
      if value.ndim != 0: raise ValueError(f"masked_fill: the value must be a scalar or a 0-d tensor, not of shape {value.shape}")
      fill = value.cast(self.dtype)
    elif is_scalar(value):
      v = py_scalar(value)
      if not self.dtype.is_float and isinstance(v, float) and not v.is_integer():
        raise TypeError(f"masked_fill: {v!r} is no value of a {self.dtype.name} tensor; cast the tensor first")
      v = bool(v) if self.dtype.is_bool else v if self.dtype.is_float else check_fits(int(v), self.dtype, "masked_fill")
      fill = self._const(v, self.dtype, ())
    else: raise TypeError(f"masked_fill: the value must be a scalar or a 0-d tensor, not {type(value).__name__}")
    return mask.where(fill, self)

  def one_hot(self, num_classes: int, dtype=None):
    """(..., num_classes): 1 at the position this integer tensor's value names, 0 elsewhere (int32 unless `dtype`);
    a value outside 0..num_classes-1 raises IndexError."""
    return one_hot(self, num_classes, dtype)

  def cross_entropy(self, target, reduction: str = "mean", ignore_index: int = -100):
    """torch's cross_entropy with integer class targets: this tensor holds logits of shape (C,), (N, C) or
    (N, C, d1, ...), the classes on axis 1 (0 when 1-d); `target` (an integer Tensor or numpy array) has that shape
    without the class axis. The loss per position is logsumexp(logits) - logits[target]; positions whose target is
    `ignore_index` count for nothing, and `reduction` "mean" divides by the others' count ("sum", "none" too)."""
    if reduction not in ("mean", "sum", "none"):
      raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', not {reduction!r}")
    if self.ndim == 0: raise ValueError("cross_entropy: the logits need a class axis (shape (C,) or (N, C, ...))")
    ax = 0 if self.ndim == 1 else 1
    want = self.shape[:ax] + self.shape[ax + 1:]
    if not hasattr(target, "uop"): target = type(self)(np.asarray(target), device=self.device)
    if target.shape != want:
      raise ValueError(f"cross_entropy: logits of shape {self.shape} need targets of shape {want}, not {target.shape}")
    x = self if self.dtype.is_float else self.float()
    keep = target.ne(ignore_index) if not target.dtype.is_bool and not target.dtype.is_float else None
    cls = as_index(x, target if keep is None else keep.where(target, 0), x.shape[ax], "cross_entropy target", negative=False)
    loss = x.logsumexp(ax) - pick(x, cls.unsqueeze(ax), ax).squeeze(ax)
    loss = keep.where(loss, 0.0)
    if reduction == "none": return loss
    return loss.sum() if reduction == "sum" else loss.sum() / keep.sum()

  @recorded
  def layernorm(self, axis=-1, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) over axis (the biased variance, as layer norm uses); no affine part. A 16-bit
    input is normalized in float32, as torch does, and the result rounded back: in half precision x - mean of two
    close values keeps a few bits of their difference ([0.5303, 0.5337] gave [-0.542, 0.4065], not +-0.4754)."""
    if self.dtype.is_float and self.dtype.itemsize == 2: return self.float().layernorm(axis, eps).cast(self.dtype)
    centered = self - self.mean(axis, keepdim=True)
    return centered * ((centered * centered).mean(axis, keepdim=True) + eps).rsqrt()

  # ---- convolution and pooling (NCHW) ----
  def _windows(self, kernel: tuple[int, int], stride: tuple[int, int], channels_last: bool = False):
    """The sliding windows of this (N, C, H, W) tensor as ONE View of shape (N, C, OH, OW, KH, KW) over its
    row-major layout: moving one output row steps stride*W elements, one kernel row W, one kernel column 1. With
    channels_last the tensor is (N, H, W, C) and the windows' shape the same (N, C, OH, OW, KH, KW)."""
    if channels_last: n, h, w, c = self.shape
    else: n, c, h, w = self.shape
    (kh, kw), (sh, sw) = kernel, stride
    oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
    px, pc = (c, 1) if channels_last else (1, h * w)   # the steps of one column and one channel
    win = View((n, c, oh, ow, kh, kw), (c * h * w, pc, sh * w * px, sw * px, w * px, px))
    u = self.uop
    if u.op is Ops.VIEW and (merged := compose(u.arg, win)) is not None:
      return self._new(UOp(Ops.VIEW, self.dtype, (u.src[0],), merged), win.shape)
    return self._new(UOp(Ops.VIEW, self.dtype, (u,), win), win.shape)

  def _check_nchw(self, kernel: tuple[int, int], padding: tuple[int, int], what: str):
    if self.ndim != 4: raise ValueError(f"{what}: input must be 4-d (N, C, H, W), got shape {self.shape}")
    if any(k < 1 for k in kernel): raise ValueError(f"{what}: kernel size {kernel} must be >= 1")
    if any(s + 2 * p < k for s, p, k in zip(self.shape[2:], padding, kernel)):
      raise ValueError(f"{what}: kernel {kernel} is larger than the input's (H, W) {self.shape[2:]} padded by {padding}")

  def conv2d(self, weight, bias=None, stride=1, padding=0):
    """2-d cross-correlation like torch's conv2d: input (N, C, H, W), weight (O, C, KH, KW), bias (O,)."""
    stride, padding = _pair(stride, "stride"), _pair(padding, "padding")
    if weight.ndim != 4: raise ValueError(f"conv2d: weight must be 4-d (O, C, KH, KW), got shape {weight.shape}")
    self._check_nchw(weight.shape[2:], padding, "conv2d")
    if stride[0] < 1 or stride[1] < 1: raise ValueError(f"conv2d: stride {stride} must be >= 1")
    if weight.shape[1] != self.shape[1]:
      raise ValueError(f"conv2d: input of shape {self.shape} has {self.shape[1]} channels, weight of shape "
                       f"{weight.shape} expects {weight.shape[1]}")
    o, c, kh, kw = weight.shape
    # a 16-bit input whose channels come in 16-byte runs is read channels-last, and summed over (kernel row, kernel
    # column, channel): 8 consecutive terms of the sum are then 16 contiguous bytes, which tensor cores' tile copies
    # take whole (rules/opt/tensor_core.py `Gather.chunked`); the filters are copied into (O, KH, KW, C) for it
    channels_last = self.dtype.is_half and c % 8 == 0
    pad = ((0, 0), (padding[0], padding[0]), (padding[1], padding[1]), (0, 0))
    x = self.permute(0, 2, 3, 1)._pad(pad) if channels_last else self._pad((pad[0], pad[3], pad[1], pad[2]))
    # the padded input is stored once (a copy the size of the input): the kernel that reads each element kh*kw*O
    # times then reads it without the masks of padding, whose branches would sit in its innermost loop
    if any(padding) or channels_last: x = x.contiguous()
    win = x._windows((kh, kw), stride, channels_last)  # (N, C, OH, OW, KH, KW)
    n, _, oh, ow, _, _ = win.shape
    if channels_last:   # (N, 1, OH, OW, KH, KW, C) * (1, O, 1, 1, KH, KW, C), summed over the last three
      xs = win.permute(0, 2, 3, 4, 5, 1).reshape(n, 1, oh, ow, kh, kw, c)
      ws = weight.permute(0, 2, 3, 1).contiguous().reshape(1, o, 1, 1, kh, kw, c)
    else:   # (N, 1, OH, OW, C, KH, KW) * (1, O, 1, 1, C, KH, KW)
      xs = win.permute(0, 2, 3, 1, 4, 5).reshape(n, 1, oh, ow, c, kh, kw)
      ws = weight.reshape(1, o, 1, 1, c, kh, kw)
    out = _mul_sum(xs, ws, (4, 5, 6))
    if bias is not None:
      if bias.shape != (o,): raise ValueError(f"conv2d: bias of shape {bias.shape} does not match {o} output channels")
      out = out + bias.reshape(1, o, 1, 1)
    return out

  def _pool(self, kernel_size, stride, what: str):
    kernel = _pair(kernel_size, "kernel_size")
    stride = kernel if stride is None else _pair(stride, "stride")
    if stride[0] < 1 or stride[1] < 1: raise ValueError(f"{what}: stride {stride} must be >= 1")
    self._check_nchw(kernel, (0, 0), what)
    return self._windows(kernel, stride)

  def max_pool2d(self, kernel_size, stride=None):
    """Max over each kernel_size window (stride defaults to kernel_size), NCHW; no padding."""
    return self._pool(kernel_size, stride, "max_pool2d").max((4, 5))

  def avg_pool2d(self, kernel_size, stride=None):
    """Mean over each kernel_size window (stride defaults to kernel_size), NCHW; no padding."""
    return self._pool(kernel_size, stride, "avg_pool2d").mean((4, 5))
