"""Devices: the registry (`get_device`, `Device.default`), the `Device` base class and the pooled allocator base.

A device owns an allocator, a renderer and a `build(source, names)` that turns one source into callable kernels
(the contract is in docs/design.md, "Devices"). Concrete devices live in their own modules (runtime/cpu.py,
runtime/cuda.py) and are imported only when first asked for, so `DEVICE=CPU` never touches CUDA.
"""
from __future__ import annotations
import importlib, os, shlex, subprocess, threading
from collections import defaultdict
from typing import Any, Callable

# name -> (module, class): imported lazily, so a machine without CUDA can still use the CPU
DEVICES: dict[str, tuple[str, str]] = {"CPU": ("runtime.cpu", "CPUDevice"), "CUDA": ("runtime.cuda", "CUDADevice")}
_instances: dict[str, Device] = {}
_instances_lock = threading.Lock()  # one Device per name, even when threads ask for it at once


def run_compiler(cmd: list[str], what: str, src) -> str:
  """Run one compiler command on kernel source `src` and return what it printed (its warnings and notes); a compiler
  that is missing or fails raises CompileError carrying its own message, the command and the source's path."""
  try: r = subprocess.run(cmd, capture_output=True, text=True)
  except OSError as e:
    raise CompileError(f"cannot run {what} {cmd[0]!r} on kernel source {src}: {e}") from None
  if r.returncode != 0:
    raise CompileError(f"{what} failed (exit {r.returncode}) on kernel source {src}\ncommand: {shlex.join(cmd)}\n"
                       f"{(r.stderr + r.stdout).strip()}")
  return r.stderr + r.stdout


_QUALIFIERS = {"const", "volatile", "restrict", "__restrict", "__restrict__", "__grid_constant__"}


def parameter_types(params: str, name: str) -> list[str | None]:
  """The C type of each parameter of kernel `name` from the text between its parentheses; None for a pointer."""
  parts = [p.strip() for p in params.split(",")]
  if parts in ([""], ["void"]): return []
  types: list[str | None] = []
  for p in parts:
    if "*" in p or "[" in p: types.append(None); continue
    words = [w for w in p.split() if w not in _QUALIFIERS]
    if len(words) < 2: raise ValueError(f"kernel {name!r}: cannot read parameter {p!r}; write it as 'TYPE NAME'")
    types.append(" ".join(words[:-1]))
  return types


class CompileError(RuntimeError):
  """A kernel source could not be compiled, or the compiler is missing. The message carries the compiler's own
  output and the path of the kernel source it was given."""


def canonical_name(name: str) -> str:
  """`name` upper-cased, checked against the known devices (ValueError naming the choices otherwise)."""
  if not isinstance(name, str) or name.upper() not in DEVICES:
    raise ValueError(f"unknown device {name!r}: choose one of {', '.join(DEVICES)}")
  return name.upper()


def get_device(name: str) -> Device:
  """The one Device called `name` ("CPU", "CUDA"; case does not matter), created on first use."""
  name = canonical_name(name)
  if (dev := _instances.get(name)) is None:
    with _instances_lock:
      if (dev := _instances.get(name)) is None:
        module, cls = DEVICES[name]
        dev = _instances[name] = getattr(importlib.import_module(module), cls)()
  return dev


def device_arch(name: str, default: str) -> str:
  """A GPU's target (sm_XY of its compute capability), or `default` where the device has none or cannot start here
  (sources for a GPU render on a machine without one: Tensor.kernel_sources)."""
  try: return getattr(get_device(name), "arch", default)
  except RuntimeError: return default   # CUDAUnavailable: no driver here


def renderer_of(name: str) -> Any:
  """The renderer of the device called `name`, without starting the device: sources render where it is absent."""
  module, cls = DEVICES[canonical_name(name)]
  return importlib.import_module(getattr(importlib.import_module(module), cls).renderer_module).renderer


class Allocator:
  """Device memory with a free-list per size: `free` keeps the handle for the next `alloc` of the same size,
  because kernels of one program keep asking for the same few sizes and a real (de)allocation is slow
  (cudaMalloc synchronizes; large host allocations fault their pages in again).

  Subclasses implement `_alloc(nbytes) -> handle`, `_free(handle, nbytes)`, `copyin` and `copyout`."""

  def __init__(self):
    self.pool: defaultdict[int, list[Any]] = defaultdict(list)
    self.lock = threading.Lock()  # the pool is shared by the threads that realize

  def alloc(self, nbytes: int) -> Any:
    with self.lock:
      if (free := self.pool.get(nbytes)): return free.pop()
    try: return self._alloc(nbytes)
    except MemoryError:
      # memory may be held by the pool under other sizes: give it back and try once more
      self.clear_pool()
      return self._alloc(nbytes)

  def free(self, handle: Any, nbytes: int) -> None:
    with self.lock: self.pool[nbytes].append(handle)

  def clear_pool(self) -> None:
    """Really free every pooled handle."""
    with self.lock: pool, self.pool = self.pool, defaultdict(list)
    for nbytes, handles in pool.items():
      for h in handles: self._free(h, nbytes)

  def pooled_bytes(self) -> int:
    return sum(nbytes * len(hs) for nbytes, hs in self.pool.items())

  def _alloc(self, nbytes: int) -> Any: raise NotImplementedError
  def _free(self, handle: Any, nbytes: int) -> None: raise NotImplementedError
  def copyin(self, handle: Any, src: memoryview) -> None: raise NotImplementedError
  def copyout(self, dst: memoryview, handle: Any) -> None: raise NotImplementedError


def host_memory_bytes() -> int | None:
  """The machine's physical memory in bytes (None where the OS does not say)."""
  try: return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
  except (ValueError, OSError, AttributeError): return None


class Device:
  """A place kernels run. Subclasses set `name`, `allocator` and `renderer_module`, and implement `build`."""
  name: str
  allocator: Allocator
  # all the memory the device has, in bytes (None: unknown): no buffer larger than this can ever be allocated
  memory_bytes: int | None = None
  # the module of renderers/ whose module-level `renderer` renders for this device; imported on first use so that
  # the runtime can run hand-written kernels before (or without) the renderers
  renderer_module: str
  # how many compiler processes may build one realize's new kernels side by side (runtime/realize.py `_build`): one
  # source for all of them where a call's fixed cost is small (cc); a GPU's compiler spends ~0.3 s of every call on
  # its own headers and a large kernel takes it ~0.5 s more, so there the slowest group of kernels sets the wait
  compilers: int = 1

  @property
  def renderer(self) -> Any:
    return importlib.import_module(self.renderer_module).renderer

  def build(self, source: str, names: list[str]) -> dict[str, Callable[..., float | None]]:
    raise NotImplementedError

  def synchronize(self) -> None:
    pass

  @staticmethod
  def default() -> Device:
    """The device the environment variable DEVICE names (CPU when unset)."""
    name = os.environ.get("DEVICE", "CPU")
    try: return get_device(name)
    except ValueError:
      raise ValueError(f"DEVICE={name!r} is not a device: set DEVICE to one of {', '.join(DEVICES)}") from None

  def __repr__(self): return f"<Device {self.name}>"
