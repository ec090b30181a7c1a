"""Tensor: a lazy handle on a tensor-level UOp graph (docs/design.md, "The tensor-level graph"), its creation and its
realization.

Operations only build graph; `realize()`, `numpy()`, `tolist()` and `item()` hand the graph to
`runtime.realize.realize`, after which the Tensor holds the realized `VIEW(BUFFER)` form. numpy only carries data
into buffers and out of them: no value of a tensor operation is ever computed by numpy.

The operations themselves live in mixins, one module per area: elementwise.py, reduce.py, movement.py, nn.py and
random.py. A mixin builds new tensors through `self._new(uop, shape)` and `self._const(...)`, so it never imports this
module.
"""
from __future__ import annotations
import math
import numpy as np
from rewrite import UOp, Ops, DType, dtypes
from rewrite.dtypes import bf16_bits, bf16_to_float32, bf16_round
from rules.strided_view import View, scalar_view
from rules.realize import CLONE, is_constant
from .promotion import to_dtype, is_scalar, py_scalar, check_fits
from .args import shape_arg, device_name, countable
from .elementwise import ElementwiseMixin
from .reduce import ReduceMixin
from .movement import MovementMixin
from .nn import NNMixin
from .random import RandomMixin
from .assign import note, realized, is_view, setitem, assign, pending
from .autograd import AutogradMixin, grad_enabled
from runtime.capture import check_read


def const_uop(value, dtype: DType, shape: tuple[int, ...]) -> UOp:
  """A constant of `shape`: VIEW(CONST) with all strides 0, so it is never stored anywhere. A bfloat16 constant holds
  its rounded value (its literal is rendered from its bits, and a cast of it to float32 folds to that value)."""
  c = value.__class__
  # remembered for Python numbers and a tuple shape; the class and a float's bits tell 1, 1.0, True and -0.0 apart
  key = (dtype, c, value.hex() if c is float else value, shape) if c in (float, int, bool) and shape.__class__ is tuple else None
  if key is not None and (u := _consts.get(key)) is not None: return u
  if dtype is dtypes.bfloat16: value = bf16_round(value)
  u = UOp(Ops.VIEW, dtype, (UOp.const(dtype, value),), scalar_view(tuple(shape)))
  if key is not None:
    if len(_consts) >= 4096: _consts.clear()
    _consts[key] = u
  return u


_consts: dict[tuple, UOp] = {}   # the constants tensors asked for lately: a model's forward asks for the same ones


class Tensor(ElementwiseMixin, ReduceMixin, MovementMixin, NNMixin, RandomMixin, AutogradMixin):
  """An n-dimensional array on one device, computed lazily. `Tensor(data, dtype=None, device=None,
  requires_grad=False)` takes a numpy array (its dtype is kept), nested lists or a Python scalar (int -> int32,
  float -> float32, bool -> bool); `requires_grad=True` makes it a target of `backward()` (tensor/autograd.py).
  bfloat16 (which numpy lacks) is made from float data with `dtype=dtypes.bfloat16` (rounded to nearest even) and
  `numpy()` gives its values as float32 (exactly); `Tensor.from_bf16_bits` / `bf16_bits()` move the raw uint16 bits."""
  # _requires_grad and grad belong to the gradient API (tensor/autograd.py); weak references: the registry of views
  # (assign.py) and of tensors that require gradients (autograd.py); _viewing: what it views (assign.py's registry);
  # _unbuilt: set (and `uop` not) on a recorded composite's result whose nodes are not made yet (tensor/recorded.py)
  __slots__ = ("uop", "shape", "device", "_requires_grad", "grad", "_viewing", "_unbuilt", "__weakref__")
  __array_ufunc__ = None    # `np.float32(2) * t` must come to our reflected operators, not to a numpy loop
  __hash__ = object.__hash__  # `==` builds a graph, so tensors hash by identity

  def __init__(self, data, dtype=None, device=None, requires_grad: bool = False):
    self._requires_grad, self.grad, self._viewing = False, None, None
    self._init(data, dtype, device)
    if requires_grad: self.requires_grad = True

  def _init(self, data, dtype, device):
    device = device_name(device)
    dt = None if dtype is None else to_dtype(dtype)
    if isinstance(data, Tensor):
      t = data.to(device) if dt is None else data.cast(dt).to(device)
      self.uop, self.shape, self.device = t.uop, t.shape, t.device
      note(self)   # a view of t's memory, as torch.as_tensor(t)
      return
    if is_scalar(data) and not isinstance(data, np.generic):
      # a Python scalar is a constant of the graph, not data
      dt = dt or dtypes.from_py(data)
      self.uop, self.shape, self.device = const_uop(check_fits(data, dt, "Tensor"), dt, ()), (), device
      return
    arr = _as_array(data, dt)
    buf = _buffer(device, arr, dt)
    self.uop = UOp(Ops.VIEW, buf.dtype, (UOp(Ops.BUFFER, buf.dtype, (), buf),), View.contiguous(arr.shape))
    self.shape, self.device = tuple(arr.shape), device
    note(self)

  @classmethod
  def _from_uop(cls, uop, shape: tuple[int, ...], device: str) -> Tensor:
    """The tensor of graph `uop`; or of a recorded composite's result not built yet (tensor/recorded.py Unbuilt), its
    graph made when first read (`__getattr__`)."""
    t = object.__new__(cls)
    t.shape, t.device, t._requires_grad, t.grad, t._viewing = \
      shape if shape.__class__ is tuple else tuple(shape), device, False, None, None
    if uop.__class__ is not UOp:
      t._unbuilt = uop
      return t
    t.uop = uop
    return note(t)   # the memory it views, if it is a view of memory (tensor/assign.py)

  def __getattr__(self, name: str):
    # called only for an attribute not found: `uop` of an unbuilt result is made here. Built, then set, then the
    # record let go: a thread reading the tensor meanwhile finds one or the other (both build the one node)
    if name == "uop":
      try: unbuilt = _unbuilt_slot.__get__(self)
      except AttributeError:   # none, or another thread has just built it
        try: return _uop_slot(self)
        except AttributeError: pass
      else:
        self.uop = unbuilt.build()
        _take_unbuilt(self)
        return note(self).uop
    # Python comes here too when a property's getter raised AttributeError inside: run it again from here, so that
    # its own error (the attribute really missing) is raised, not "no attribute" of the property's name
    if (attr := getattr(type(self), name, None)) is not None and isinstance(attr, property):
      return attr.__get__(self, type(self))
    raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

  def _graph(self):
    """What a program's key reads of this tensor: its graph, or the record and inputs of an unbuilt result."""
    try: return _uop_slot(self)
    except AttributeError: pass
    try: return _unbuilt_slot.__get__(self)
    except AttributeError: return self.uop   # (built by another thread meanwhile)

  def _new(self, uop: UOp, shape: tuple[int, ...] | None = None) -> Tensor:
    """A tensor on this one's device (of this one's shape unless told); inside no_grad(), detached (constants carry
    no gradient and stay as they are)."""
    if not grad_enabled() and not is_constant(uop) and uop.op is not Ops.DETACH:
      uop = UOp(Ops.DETACH, uop.dtype, (uop,))
    t = _new_tensor(self.__class__)   # (_from_uop, inlined: every operation makes its result here)
    t.uop, t.shape, t.device, t._requires_grad, t.grad, t._viewing = \
      uop, self.shape if shape is None else shape if shape.__class__ is tuple else tuple(shape), self.device, False, None, None
    return note(t)

  def _const(self, value, dtype: DType | None = None, shape: tuple[int, ...] | None = None) -> Tensor:
    dtype = dtype or self.dtype
    shape = self.shape if shape is None else shape
    return self._new(const_uop(value, dtype, shape), shape)

  # ---- properties ----
  @property
  def dtype(self) -> DType:
    try: return _uop_slot(self).dtype
    except AttributeError: return self._graph().dtype   # (an unbuilt replay's dtype: no need to build it)
  @property
  def ndim(self) -> int: return len(self.shape)
  def numel(self) -> int: return math.prod(self.shape)
  def __len__(self) -> int:
    if not self.shape: raise TypeError("len() of a 0-d tensor")
    return self.shape[0]
  def __iter__(self):
    if not self.shape: raise TypeError("iteration over a 0-d tensor")
    return (self[i] for i in range(self.shape[0]))
  def __repr__(self) -> str:
    state = "realized" if self.is_realized else f"lazy, {len(self.uop.toposort)} nodes"
    return f"<Tensor shape={self.shape} dtype={self.dtype.name} device={self.device} ({state})>"
  def __bool__(self) -> bool:
    if self.numel() != 1:
      raise ValueError(f"the truth value of a tensor of shape {self.shape} is ambiguous; use .any() or .all()")
    return bool(self.item())

  # ---- in-place updates (tensor/assign.py): as if every operation ran eagerly, in program order ----
  def assign(self, value) -> Tensor:
    """Write `value` (a Tensor or numpy array of this shape and dtype, or a Python scalar) into this tensor's
    memory; returns self. Views of it see the new values; other lazy tensors built before read the old ones."""
    assign(self, value)
    return self

  def __setitem__(self, index, value):
    """`t[index] = value`: ints, slices (any step), None and ... select; value (a Tensor, numpy array or scalar of
    this dtype) is broadcast to the selection and written into this tensor's memory (and so into what it views)."""
    if any(hasattr(i, "uop") or isinstance(i, (np.ndarray, list)) for i in (index if isinstance(index, tuple) else (index,))):
      raise TypeError("t[...] = value: writing through an integer-array index (a scatter) is not supported; index with "
                      "ints, slices, None and ...")
    setitem(self, index, value)

  def _selected_view(self, index) -> View:
    # (a method of its own: the selection's graph must be gone when the write looks for who holds the old memory)
    u = self[index].uop
    if u.op is not Ops.VIEW or u.src[0] is not self.uop.src[0]:
      raise IndexError(f"t[{index!r}] = ...: this selection is not one view of the tensor's memory")
    return u.arg

  # ---- type and place ----
  def cast(self, dtype) -> Tensor:
    dtype = to_dtype(dtype) if not isinstance(dtype, DType) else dtype
    if dtype is self.dtype: return self
    # bfloat16 converts only to and from float32 in a kernel (the renderers' one conversion each way)
    if dtypes.bfloat16 in (dtype, self.dtype) and dtypes.float32 not in (dtype, self.dtype):
      return self.cast(dtypes.float32).cast(dtype)
    u = self.uop
    if is_constant(u) and (v := _cast_const(u.src[0].arg, dtype)) is not None:
      return self._new(UOp(Ops.VIEW, dtype, (UOp.const(dtype, v),), u.arg))  # a cast constant is a constant
    return self._new(UOp(Ops.CAST, dtype, (u,)))
  def float(self) -> Tensor: return self.cast(dtypes.float32)
  def half(self) -> Tensor: return self.cast(dtypes.float16)
  def bfloat16(self) -> Tensor: return self.cast(dtypes.bfloat16)
  def double(self) -> Tensor: return self.cast(dtypes.float64)
  def int(self) -> Tensor: return self.cast(dtypes.int32)
  def long(self) -> Tensor: return self.cast(dtypes.int64)
  def bool(self) -> Tensor: return self.cast(dtypes.bool)

  def contiguous(self) -> Tensor:
    """This tensor, stored in a buffer of its own in row-major order when realized."""
    if self.is_realized: return self
    return self._new(UOp(Ops.CONTIGUOUS, self.dtype, (self.uop,)))

  def _new_unless_self(self, out: Tensor) -> Tensor:
    """out, or a clone of this tensor where an operation left it as it was and returned it: numpy's and torch's
    results are new arrays, and a write into the input must not show in the result."""
    return self.clone() if out is self else out

  def clone(self) -> Tensor:
    """A copy in memory of its own (torch's clone, numpy's copy): a write into either leaves the other as it was."""
    return self._new(UOp(Ops.CONTIGUOUS, self.dtype, (self.uop,), CLONE))

  def to(self, device) -> Tensor:
    """This tensor on `device` ("CPU", "CUDA"): a COPY node, or the tensor itself when it is there already."""
    device = device_name(device)
    if device == self.device: return self
    if is_constant(self.uop): return self._from_uop(self.uop, self.shape, device)  # constants live everywhere
    return self._from_uop(UOp(Ops.COPY, self.dtype, (self.uop,), (self.device, device)), self.shape, device)

  # ---- realizing ----
  @property
  def is_realized(self) -> bool:
    try: u = _uop_slot(self)   # (not built by asking)
    except AttributeError: return False
    return u.op is Ops.VIEW and u.src[0].op is Ops.BUFFER and u.arg.is_contiguous

  def realize(self) -> Tensor:
    Tensor.realize_all(self)
    return self

  @staticmethod
  def realize_all(*tensors: Tensor) -> None:
    """Realize several tensors in one go, so that work they share runs once."""
    # a view of a lazy tensor is memory once that tensor is (assign.py): realizing that one computes both
    todo = pending(tensors)
    if not todo: return
    from runtime.realize import realize, wait
    outs = realize([(t._graph(), t.device) for t in todo], wait=False)
    for t, u in zip(todo, outs):   # (while a GPU runs the work: the graphs let go here cost no wall time)
      t.uop = u
      _take_unbuilt(t)
      realized(t)
    wait()

  def kernel_sources(self, device=None) -> list[str]:
    """The source of each kernel that realizing this tensor would compile, in call order (C for the CPU, CUDA for a
    GPU), without compiling or running anything; `device` renders them for that device instead of this one's."""
    if self.is_realized: return []
    from runtime.realize import kernel_sources
    return kernel_sources([(self.uop, self.device)], device)

  def numpy(self) -> np.ndarray:
    check_read("numpy() (or .item(), .tolist())")   # (a jit function may not: runtime/capture.py)
    src = self.contiguous() if is_view(self) else self   # a view is read through a copy
    src.realize()
    buf, view = src.uop.src[0].arg, src.uop.arg
    if view.shape != self.shape:
      raise RuntimeError(f"realize returned a view of shape {view.shape} for a tensor of shape {self.shape}")
    out = buf.numpy()[:self.numel()].reshape(self.shape)
    return bf16_to_float32(out) if self.dtype is dtypes.bfloat16 else out
  def bf16_bits(self) -> np.ndarray:
    """A bfloat16 tensor's values as their raw uint16 bits (numpy has no bfloat16)."""
    if self.dtype is not dtypes.bfloat16: raise TypeError(f"bf16_bits() of a {self.dtype.name} tensor; cast it to bfloat16 first")
    check_read("bf16_bits()")
    src = (self.contiguous() if is_view(self) else self).realize()
    return src.uop.src[0].arg.numpy()[:self.numel()].reshape(self.shape)
  @classmethod
  def from_bf16_bits(cls, bits, device=None) -> Tensor:
    """A bfloat16 tensor holding the uint16 `bits` as they are (the inverse of `bf16_bits()`)."""
    bits = np.asarray(bits)
    if bits.dtype != np.uint16: raise TypeError(f"from_bf16_bits takes a uint16 array, not {bits.dtype}")
    buf = _buffer(device_name(device), bits, dtypes.bfloat16)
    return cls._from_uop(UOp(Ops.VIEW, buf.dtype, (UOp(Ops.BUFFER, buf.dtype, (), buf),), View.contiguous(bits.shape)),
                         bits.shape, device_name(device))
  def tolist(self): return self.numpy().tolist()
  def item(self):
    if self.numel() != 1: raise ValueError(f"item() needs a tensor of one element, this one has shape {self.shape}")
    return self.numpy().reshape(()).item()
  def __array__(self, dtype=None, copy=None):
    arr = self.numpy()
    return arr if dtype is None else arr.astype(dtype)

  # ---- creation ----
  @classmethod
  def full(cls, shape, value, dtype=None, device=None) -> Tensor:
    shape = shape_arg(shape if isinstance(shape, (tuple, list)) else (shape,), "Tensor.full")
    dt = dtypes.from_py(py_scalar(value)) if dtype is None else to_dtype(dtype)
    return cls._from_uop(const_uop(check_fits(value, dt, "Tensor.full"), dt, shape), shape, device_name(device))
  @classmethod
  def zeros(cls, *shape, dtype=None, device=None) -> Tensor:
    return cls.full(shape_arg(shape, "Tensor.zeros"), 0, dtype or dtypes.default_float, device)
  @classmethod
  def ones(cls, *shape, dtype=None, device=None) -> Tensor:
    return cls.full(shape_arg(shape, "Tensor.ones"), 1, dtype or dtypes.default_float, device)
  def full_like(self, value, dtype=None) -> Tensor: return self.full(self.shape, value, dtype or self.dtype, self.device)
  def zeros_like(self, dtype=None) -> Tensor: return self.full_like(0, dtype)
  def ones_like(self, dtype=None) -> Tensor: return self.full_like(1, dtype)

  @classmethod
  def arange(cls, start, stop=None, step=1, dtype=None, device=None) -> Tensor:
    """start, start+step, ... up to stop (exclusive), like np.arange; int32 when all three are ints (int64 where the
    values do not fit in int32), else float32."""
    if stop is None: start, stop = 0, start
    start, stop, step = py_scalar(start), py_scalar(stop), py_scalar(step)
    if not all(is_scalar(v) for v in (start, stop, step)): raise TypeError(f"arange({start}, {stop}, {step}) needs numbers")
    if step == 0: raise ValueError(f"arange({start}, {stop}, {step}): step must not be 0")
    exact = all(isinstance(v, int) for v in (start, stop, step))  # int division: a float's 53 bits could round n
    n = max(0, -((start - stop) // step) if exact else math.ceil((stop - start) / step))
    countable((n,), f"arange({start}, {stop}, {step})")
    dt = dtypes.from_py([start, stop, step]) if dtype is None else to_dtype(dtype)
    if dt.is_bool: dt = dtypes.default_int
    if dtype is None and dt is dtypes.int32 and n and not _fits(dt, start, start + (n - 1) * step): dt = dtypes.int64
    # the element number itself is an int64 where it counts past 2**31 - 1 (the index_width stage picks the same)
    iota = cls._from_uop(UOp(Ops.IOTA, dtypes.int32 if n <= 2**31 else dtypes.int64, (), n), (n,), device_name(device))
    iota = iota.cast(dt)
    if step != 1: iota = iota * step
    return iota + start if start != 0 else iota

  @classmethod
  def eye(cls, n: int, m: int | None = None, dtype=None, device=None) -> Tensor:
    """The n x m identity matrix (m defaults to n)."""
    m = n if m is None else m
    rows = cls.arange(n, device=device).reshape(n, 1)
    return (rows == cls.arange(m, device=device).reshape(1, m)).cast(to_dtype(dtype) if dtype else dtypes.default_float)


_new_tensor = object.__new__
_uop_slot, _unbuilt_slot = Tensor.uop.__get__, Tensor._unbuilt   # the slots themselves: reading one never builds


def _take_unbuilt(t: Tensor) -> None:
  """Let go of t's unbuilt result once t has its graph (the record's inputs are not held after)."""
  try: _unbuilt_slot.__delete__(t)
  except AttributeError: pass   # none, or another thread let go of it first


def _fits(dtype: DType, *values: int) -> bool: return all(dtypes.min(dtype) <= v <= dtypes.max(dtype) for v in values)




def _cast_const(value, dtype: DType):
  """`value` converted like a C cast to `dtype`, or None where that is not plain (out of range, NaN to int)."""
  if dtype.is_bool: return bool(value)
  if dtype is dtypes.bfloat16: return bf16_round(value)
  if dtype.is_float: return float(value)
  if isinstance(value, float) and not math.isfinite(value): return None
  v = int(value)
  return v if dtypes.min(dtype) <= v <= dtypes.max(dtype) else None


def _as_array(data, dt: DType | None) -> np.ndarray:
  """The data as a numpy array of dtype `dt` (its own when None); bfloat16 as its uint16 bits."""
  if dt is dtypes.bfloat16: return bf16_bits(_as_array(data, dtypes.float32))
  if isinstance(data, np.ndarray) or isinstance(data, np.generic): arr = np.asarray(data)
  elif isinstance(data, (list, tuple)):
    try: py_dt = dtypes.from_py(data)
    except TypeError: py_dt = None  # lists of numpy arrays, say: numpy decides below
    try: arr = np.array(data, dtype=(dt or py_dt).np if (dt or py_dt) else None)
    except ValueError as e: raise ValueError(f"Tensor data is not a rectangular nested list: {e}") from None
  else: raise TypeError(f"Tensor data must be a numpy array, nested lists or a scalar, not {type(data).__name__}")
  if dt is None:
    dt = to_dtype(arr.dtype, "numpy dtype of the Tensor data")
  if arr.dtype != dt.np:
    if dt.is_int and arr.dtype.kind == 'f' and not np.isfinite(arr).all():
      raise ValueError(f"Tensor data holds NaN or inf, which {dt.name} cannot represent")
    arr = arr.astype(dt.np)
  return arr


def _buffer(device: str, arr: np.ndarray, dtype: DType | None = None):
  from runtime.buffer import Buffer
  buf = Buffer(device, arr.size, dtype or dtypes.from_numpy(arr.dtype))
  return buf.copyin(np.ascontiguousarray(arr).reshape(-1))
