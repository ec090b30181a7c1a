"""`Buffer`: flat device memory of `size` elements of one dtype, allocated on first use, pooled when garbage.

A Buffer is hashed and compared by identity (it is the `arg` of a BUFFER UOp: two buffers of equal contents are
still two buffers). Its memory comes from `get_device(device).allocator` the first time `handle` is read, so graphs
can name buffers that a plan later decides never to fill.
"""
from __future__ import annotations
import math
import numpy as np

from rewrite.dtypes import DType
from runtime.device import canonical_name, get_device
from runtime.capture import note_split


def _np_dtype(dtype: DType) -> np.dtype:
  # numpy has no bfloat16: such buffers show their raw bits as unsigned integers of the same width
  return dtype.np if dtype.np is not None else np.dtype(f"uint{8 * dtype.itemsize}")


MAX_BYTES = 2**63 - 1  # sizes and byte offsets are signed 64-bit integers (C's ptrdiff_t, the kernels' int64)


def human_bytes(nbytes: int) -> str:
  """1536 -> '1.5 KiB'."""
  i = min(max(nbytes.bit_length() - 1, 0) // 10, 6)
  return f"{nbytes} B" if i == 0 else f"{nbytes / (1 << 10 * i):.1f} {('KiB', 'MiB', 'GiB', 'TiB', 'PiB', 'EiB')[i - 1]}"


def check_allocatable(device: str, shape: tuple[int, ...], dtype: DType) -> int:
  """The bytes of a buffer of `shape` and `dtype` on `device`, checked before anything is compiled for it:
  ValueError when they do not fit in 64 bits, MemoryError when the device does not have that much memory at all."""
  nbytes = math.prod(shape) * dtype.itemsize
  what = f"a buffer of shape {tuple(shape)} and dtype {dtype.name} ({human_bytes(nbytes)}, {nbytes} bytes)"
  if nbytes > MAX_BYTES: raise ValueError(f"{what}: its size does not fit in 64 bits")
  total = get_device(device).memory_bytes
  if total is not None and nbytes > total:
    raise MemoryError(f"cannot allocate {what} on {device}: the device has {human_bytes(total)} of memory in all")
  return nbytes


class Buffer:
  __slots__ = ("device", "size", "dtype", "_handle", "_allocator", "successor", "__weakref__")

  def __init__(self, device: str, size: int, dtype: DType):
    if not isinstance(dtype, DType) or dtype.itemsize == 0:
      raise TypeError(f"Buffer dtype must be a scalar rewrite.dtypes.DType (dtypes.float32, ...), got {dtype!r}")
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 0:
      raise ValueError(f"Buffer size must be a non-negative int of elements, got {size!r}")
    if size * dtype.itemsize > MAX_BYTES:
      raise ValueError(f"Buffer of {size} {dtype.name} elements: {size * dtype.itemsize} bytes do not fit in 64 bits")
    self.device, self.size, self.dtype = canonical_name(device), int(size), dtype
    self._handle = None
    self._allocator = None
    self.successor: Buffer | None = None   # set by split_version: the Buffer that owns this one's memory since

  @classmethod
  def allocated_now(cls, device: str, size: int, dtype: DType) -> Buffer:
    """A Buffer whose memory is allocated now, of a kind checked before (a program's output, made on every run:
    runtime/program.py), without checking its arguments again."""
    b = object.__new__(cls)
    b.device, b.size, b.dtype, b.successor = device, size, dtype, None
    b._allocator = get_device(device).allocator
    b._handle = b._allocator.alloc(size * dtype.itemsize)
    return b

  @property
  def nbytes(self) -> int: return self.size * self.dtype.itemsize

  @property
  def allocated(self) -> bool: return self._handle is not None

  @property
  def handle(self):
    """What a Program takes for this buffer (an address on the CPU); allocates on first use."""
    if self._handle is None:
      # keep the allocator itself, so __del__ needs no module globals (they may be gone at interpreter exit)
      self._allocator = get_device(self.device).allocator
      self._handle = self._allocator.alloc(self.nbytes)
    return self._handle

  def copyin(self, arr: np.ndarray) -> Buffer:
    """Copy `arr` (any shape, exactly `size` elements of this dtype) into the buffer."""
    arr = np.asarray(arr)
    want = _np_dtype(self.dtype)
    if arr.dtype != want:
      raise ValueError(f"copyin of a {arr.dtype} array into {self!r}: convert it first, e.g. arr.astype(np.{want})")
    if arr.size != self.size:
      raise ValueError(f"copyin of {arr.size} elements (shape {arr.shape}) into {self!r}, which holds {self.size}")
    if self.size: self._allocator_for_copy().copyin(self.handle, memoryview(np.ascontiguousarray(arr)).cast("B"))
    return self

  def numpy(self) -> np.ndarray:
    """A flat copy of the contents."""
    out = np.empty(self.size, _np_dtype(self.dtype))
    if self.size: self._allocator_for_copy().copyout(memoryview(out).cast("B"), self.handle)
    return out

  def split_version(self) -> Buffer:
    """A new Buffer that takes over this one's memory, this one keeping a copy of the contents in new memory: an
    in-place update writes the original memory while lazy graphs still read the old contents here (tensor/assign.py).
    This one's `successor` is the new one (what `current()` follows)."""
    new = Buffer(self.device, self.size, self.dtype)
    self.successor = new
    note_split(self, new)
    if self._handle is None or not self.size: return new
    new._handle, new._allocator = self._handle, self._allocator
    self._handle = self._allocator.alloc(self.nbytes)
    self._copy_from(new)
    return new

  def current(self) -> Buffer:
    """The Buffer that owns this one's original memory now: itself, or the last of its successors."""
    b = self
    while b.successor is not None: b = b.successor
    return b

  def copy(self) -> Buffer:
    """A new Buffer holding a copy of the contents (a jit replay's split version: runtime/capture.py)."""
    new = Buffer(self.device, self.size, self.dtype)
    if self._handle is not None and self.size: new.handle; new._copy_from(self)   # noqa: B018 -- allocates
    return new

  def _copy_from(self, src: Buffer) -> None:
    if hasattr(self._allocator, "copy"): self._allocator.copy(self._handle, src._handle, self.nbytes)  # on the device
    else: self._allocator.copyin(self._handle, memoryview(src.numpy()).cast("B"))

  def _allocator_for_copy(self):
    self.handle  # noqa: B018 -- allocates, which also sets _allocator
    return self._allocator

  def __del__(self):
    # at interpreter shutdown the allocator may be half torn down; the process is ending, so losing memory is fine
    try:
      if self._handle is not None: self._allocator.free(self._handle, self.nbytes)
    except Exception:
      pass

  def __repr__(self):
    where = f"at {self._handle:#x}" if isinstance(self._handle, int) else \
      "unallocated" if self._handle is None else f"at {self._handle!r}"
    return f"<Buffer {self.device} {self.dtype.name}[{self.size}] {where}>"


class LostBuffer(Buffer):
  """The memory of a tensor whose value a failed realize was computing and whose graph it had let go (an optimizer's
  step realizes the gradients and the loss with the updates: tensor/assign.py `write_many`): no value, and every use
  (reading it, a program reading it) says so, instead of failing somewhere inside."""
  __slots__ = ("why",)

  def __init__(self, device: str, size: int, dtype: DType, why: str):
    super().__init__(device, size, dtype)
    self.why = why

  @property
  def handle(self):
    raise RuntimeError(f"this {self.dtype.name}[{self.size}] tensor has no value: the realize computing it failed "
                       f"({self.why}); compute it again (call backward() again for a gradient)")
