"""`Buffer`: flat device memory of `size` elements of one dtype, allocated on first use, pooled when garbage.

A Buffer is hashed and compared by identity (it is the `arg` of a BUFFER UOp: two buffers of equal contents are
still two buffers). Its memory comes from `get_device(device).allocator` the first time `handle` is read, so graphs
can name buffers that a plan later decides never to fill.
"""
from __future__ import annotations
import numpy as np

from rewrite.dtypes import DType
from runtime.device import canonical_name, get_device


def _np_dtype(dtype: DType) -> np.dtype:
  # numpy has no bfloat16: such buffers show their raw bits as unsigned integers of the same width
  return dtype.np if dtype.np is not None else np.dtype(f"uint{8 * dtype.itemsize}")


class Buffer:
  __slots__ = ("device", "size", "dtype", "_handle", "_allocator", "__weakref__")

  def __init__(self, device: str, size: int, dtype: DType):
    if not isinstance(dtype, DType) or dtype.itemsize == 0:
      raise TypeError(f"Buffer dtype must be a scalar rewrite.dtypes.DType (dtypes.float32, ...), got {dtype!r}")
    if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 0:
      raise ValueError(f"Buffer size must be a non-negative int of elements, got {size!r}")
    self.device, self.size, self.dtype = canonical_name(device), int(size), dtype
    self._handle = None
    self._allocator = None

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
    in-place update writes the original memory while lazy graphs still read the old contents here (tensor/assign.py)."""
    new = Buffer(self.device, self.size, self.dtype)
    if self._handle is None or not self.size: return new
    new._handle, new._allocator = self._handle, self._allocator
    self._handle = self._allocator.alloc(self.nbytes)
    if hasattr(self._allocator, "copy"): self._allocator.copy(self._handle, new._handle, self.nbytes)  # on the device
    else: self._allocator.copyin(self._handle, memoryview(new.numpy()).cast("B"))
    return new

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
