"""The CPU device: C kernels built with gcc (OpenMP for threads) into a shared library, loaded with cffi.

Cold cost of one small OpenMP kernel, source to callable (`python3 bench/compile_cost.py`, 2-core machine, gcc 12.2,
cffi 2.0; first build in a fresh process / a second kernel in the same process):
  (a) one `gcc -O3 -march=native -fopenmp -shared -fPIC` call, then cffi ABI mode (`ffi.cdef` + `ffi.dlopen`):
      125 ms / 92 ms
  (b) cffi API mode (`ffi.set_source` + `ffi.compile` + import of the extension module):
      533 ms / 342 ms (it imports setuptools, compiles a Python extension wrapper and links it)
We use (a). A cache hit (runtime/cache.py) costs only the checksum and the dlopen.

Kernel prototypes. cffi's ABI mode needs each kernel's prototype. We read it from the source, by a convention the C
renderer follows: each kernel named in `build(source, names)` is defined by a line that starts (after indentation)
with `void NAME(`, and its parameter list, up to the first `)`, holds only pointers and integer (or floating) scalars,
e.g. `void add(float* restrict out, const float* a, int n) {`. Pointer parameters are declared to cffi as
`uintptr_t`: pointers and 64-bit integers travel in the same registers on every 64-bit ABI we target (x86-64 SysV,
AArch64), so a buffer handle is a plain Python int and a call converts nothing (a cffi pointer cast costs ~0.6 us
per argument here).

Loaded libraries are capped (`MAX_LIBRARIES`, or $GRAFT_MAX_LIBRARIES): a long-running program that meets ever new
shapes would otherwise keep every library it ever built mapped (about 30 KB of memory and 5 memory maps each).
Loading one more than the cap unloads (dlclose) the least recently built or loaded one. A program of an unloaded
library stays valid: its function becomes None, and its next call, failing on that, loads the library again from the
cache (rebuilding it if the cache lost it), so a call that finds its library loaded pays nothing for the cap.

Threads follow OMP_NUM_THREADS, which libgomp reads when the first kernel library loads.
"""
from __future__ import annotations
import collections
import functools
import os
import platform
import re
import shlex
import shutil
import subprocess
import time
import weakref
from pathlib import Path
from typing import Any

import cffi

from rewrite.env import env_number, env_flag
from runtime import cache
from runtime.device import Allocator, CompileError, Device, host_memory_bytes, parameter_types, run_compiler

# no -ffast-math: results must match numpy bit for bit where C allows; errno is never read, so it can go; and no
# kernel enables floating-point traps, so a compare may be evaluated where its branch is not taken: without
# -fno-trapping-math gcc 12 leaves the clamps of g_exp2f as branches and does not vectorize exp loops (softmax's
# exp kernels ran 4-6x slower on an AVX2 EPYC). Values are unchanged: no reassociation, NaN and inf as before.
# -fno-tree-slp-vectorize: gcc 12.2's straight-line vectorizer turned `(unsigned char)(bool)x` inside an unrolled max
# into the lanes' -1 masks (`t.any().cast("int8")` gave -1; found by bench/fuzz.py, issue 22); loops still vectorize
# (softmax/layernorm: the same machine code), and our own vector code is written with vector types.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math",
          "-fno-tree-slp-vectorize")
# Added where the compiler takes them (a probe, once per compiler): gcc 12 with -march=native on a CPU with AVX512-FP16
# emits masked `vmovsh` for _Float16 selects, which binutils 2.40 cannot assemble (a compile failure the fuzzer found,
# issue 22); half math then goes through float conversions (F16C), as on every other CPU.
OPTIONAL_CFLAGS = ("-mno-avx512fp16",)
# GRAFT_SANITIZE=1: kernels built with AddressSanitizer and UndefinedBehaviorSanitizer, no -O3 vectorization, stopping
# at the first report; an out-of-bounds read or a signed overflow in generated code is caught where it happens. The
# ASan runtime must be loaded first in the process: run with LD_PRELOAD=$(gcc -print-file-name=libasan.so)
# ASAN_OPTIONS=detect_leaks=0 (python itself leaks by ASan's count); `python3 bench/fuzz.py --sanitize` does it.
SANITIZE_CFLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                   "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno")
# threads that finish a parallel loop sleep until the next one instead of spinning (libgomp reads this when the first
# kernel library loads; a user's setting wins): on a machine whose cores other processes also use, a spinning
# thread takes the core from the thread that still has work, and every parallel loop waits for the slowest
# (attention, 5 parallel kernels, ran 3x slower on 2 threads than on 1 beside other jobs on a 2-core EPYC)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # from <sys/mman.h> on Linux
ALIGN = 64          # a cache line, and the widest vector load (AVX-512)

_ffi = cffi.FFI()
_ffi.cdef("""
int posix_memalign(void **memptr, size_t alignment, size_t size);
void free(void *ptr);
int madvise(void *addr, size_t length, int advice);
""")
_libc = _ffi.dlopen(None)


OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so")  # gcc's, clang's, Intel's


_openmp_pinned = False


def pin_openmp_runtime() -> None:
  """Keep the OpenMP runtime that the kernel libraries loaded mapped until the process ends. Its worker threads live
  in its code and spin there for a while after each parallel loop; if unloading the last kernel library (the cap's
  dlclose, or interpreter exit) unloaded the runtime too, a spinning thread would run unmapped code (a SIGSEGV seen at
  exit on a 16-core machine). RTLD_NOLOAD touches only a runtime already loaded; RTLD_NODELETE pins it. Tried after
  each library load until it succeeds: a library without a parallel loop does not load the runtime (the linker drops
  an unused -lgomp), so the first one loaded may have nothing to pin."""
  global _openmp_pinned
  if _openmp_pinned: return
  import ctypes
  for name in OPENMP_RUNTIMES:
    try: ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_NODELETE)
    except OSError: continue  # not the runtime this compiler links, or not loaded yet
    _openmp_pinned = True


class CPUAllocator(Allocator):
  """Host memory from posix_memalign, 64-byte aligned; handles are addresses (ints)."""

  def _alloc(self, nbytes: int) -> int:
    # large buffers are aligned to a huge page so madvise can back them with 2 MiB pages (fewer TLB misses)
    align = HUGE_PAGE if nbytes >= HUGE_PAGE else ALIGN
    out = _ffi.new("void **")
    if _libc.posix_memalign(out, align, max(nbytes, 1)) != 0:
      raise MemoryError(f"cannot allocate {nbytes} bytes of CPU memory")
    if nbytes >= HUGE_PAGE: _libc.madvise(out[0], nbytes, MADV_HUGEPAGE)  # a hint: failure (no THP) is fine
    return int(_ffi.cast("uintptr_t", out[0]))

  def _free(self, handle: int, nbytes: int) -> None:
    _libc.free(_ffi.cast("void *", handle))

  def copyin(self, handle: int, src: memoryview) -> None:
    _ffi.memmove(_ffi.cast("void *", handle), src, src.nbytes)

  def copyout(self, dst: memoryview, handle: int) -> None:
    _ffi.memmove(dst, _ffi.cast("void *", handle), dst.nbytes)

  def copy(self, dst: int, src: int, nbytes: int) -> None:
    """Memory to memory (Buffer.split_version: an optimizer's step keeps each old parameter this way), one memmove."""
    _ffi.memmove(_ffi.cast("void *", dst), _ffi.cast("void *", src), nbytes)


MAX_LIBRARIES = 256  # loaded kernel libraries kept mapped at once, unless GRAFT_MAX_LIBRARIES says otherwise


def max_libraries() -> int:
  """The cap on loaded kernel libraries: $GRAFT_MAX_LIBRARIES, else MAX_LIBRARIES."""
  return env_number("GRAFT_MAX_LIBRARIES", MAX_LIBRARIES, "the number of kernel libraries to keep loaded", minimum=1)


class Library:
  """One loaded kernel library: its cffi handle, and the programs taken from it, so that unloading it can unhook
  them (a function of a closed library must never be called: its code is unmapped)."""
  __slots__ = ("path", "cdef", "source", "ffi", "handle", "programs")

  def __init__(self, path: Path, cdef: str, source: str):
    self.path, self.cdef, self.source = path, cdef, source
    self.ffi = cffi.FFI()
    try: self.ffi.cdef(cdef)
    except (cffi.CDefError, cffi.FFIError) as e:
      raise ValueError(f"cffi cannot declare these kernels ({e}); CPU kernels take pointers and integer or "
                       f"float scalars:\n{cdef}") from None
    self.handle = self.ffi.dlopen(str(path))  # OSError for a file that is no library: the cache rebuilds it
    pin_openmp_runtime()
    self.programs: weakref.WeakSet[CPUProgram] = weakref.WeakSet()

  def function(self, name: str) -> Any:
    try: return getattr(self.handle, name)
    except AttributeError:
      raise CompileError(f"kernel {name!r} is not exported by {self.path} (source {self.path.with_suffix('.c')}); "
                         f"is it declared static?") from None

  def unload(self) -> None:
    for program in list(self.programs): program.fn = program.team = None  # its next call loads the library again
    self.ffi.dlclose(self.handle)
    self.ffi = self.handle = None  # what stays, while its programs live, is the source and declarations to reload


class CPUProgram:
  """One kernel of a loaded library. Call it with buffer handles and ints, in the order of its C parameters. `team`:
  the address of its NAME_team function (renderers/c.py CRenderer), for `run_team`, where the source has one."""
  __slots__ = ("name", "fn", "team", "teamed", "prototype", "library", "device", "__weakref__")

  def __init__(self, name: str, library: Library, prototype: str, device: CPUDevice, teamed: bool = False):
    self.name, self.prototype, self.device, self.teamed = name, prototype, device, teamed
    self._attach(library)

  def _attach(self, library: Library) -> None:
    self.library, self.fn = library, library.function(self.name)
    self.team = int(library.ffi.cast("uintptr_t", library.function(f"{self.name}_team"))) if self.teamed else None
    library.programs.add(self)

  def loaded(self) -> CPUProgram:
    """Itself, its library loaded again first if the cap unloaded it."""
    if self.fn is None: self._attach(self.device.library(self.library.source, self.library.cdef))
    return self

  @property
  def path(self) -> Path: return self.library.path

  def __call__(self, *args: int, global_size=None, local_size=None, wait: bool = False) -> float | None:
    # global_size/local_size belong to GPU launches; OpenMP splits the loops here
    try:
      if not wait:
        self.fn(*args)
        return None
      t0 = time.perf_counter()
      self.fn(*args)
      return time.perf_counter() - t0
    except TypeError as e:
      if self.fn is None:  # its library was unloaded to keep within the cap: load it again (no cost until then)
        return self.loaded()(*args, wait=wait)
      raise TypeError(f"kernel {self.prototype} (from {self.path}) called with {len(args)} arguments "
                      f"{args!r}: {e}; pass buffer handles as ints") from None

  def __repr__(self): return f"<CPUProgram {self.prototype} in {self.path}>"


def cpu_threads() -> int:
  """The threads a parallel loop runs on, as libgomp counts them when it loads: OMP_NUM_THREADS (its first level),
  else the CPUs this process may run on."""
  first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
  if first.isdigit() and int(first) > 0: return int(first)
  try: return len(os.sched_getaffinity(0))
  except (AttributeError, OSError): return os.cpu_count() or 1


class CPUDevice(Device):
  name = "CPU"
  renderer_module = "renderers.c"

  @property
  def device_name(self) -> str:
    """The CPU as a measured pick (runtime/pick.py) names it: with the threads the generated code and the library
    run on, so a pick measured at one thread (bench/cpu_steps.py) is not reused at two, where either side may scale
    better (OPENBLAS_NUM_THREADS, when set, is the library's own count)."""
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "").strip()
    n = cpu_threads()
    return f"CPU ({n} thread{'s' if n != 1 else ''}{f', OpenBLAS {blas}' if blas else ''})"

  def __init__(self):
    self.allocator = CPUAllocator()
    self.memory_bytes = host_memory_bytes()
    # loaded libraries by (path, cdef), least recently built or loaded first; at most max_libraries() of them
    self._libs: collections.OrderedDict[tuple[str, str], Library] = collections.OrderedDict()
    self._runner: Library | None = None   # run_team's library (TEAM_RUNNER), built and loaded on first use

  def build(self, source: str, names: list[str]) -> dict[str, CPUProgram]:
    """Compile `source` (one gcc call, cached on disk) and return a program for each kernel in `names` (with the
    address of its NAME_team function where the source defines one)."""
    names = list(names)
    teamed = {n for n in names if _defines(source, f"{n}_team")}
    library = self.library(source, "\n".join(kernel_prototype(source, n) for n in [*names, *(f"{n}_team" for n in teamed)]))
    return {n: CPUProgram(n, library, _find_kernel(source, n).group(0).strip(), self, n in teamed) for n in names}

  def run_team(self, calls: list[tuple[CPUProgram, list[int]]]) -> None:
    """Kernels one after another in one parallel region: its threads wake once, not once per kernel (each kernel's
    NAME_team runs its share of its loop on every thread; the team waits for all of it before the next kernel).
    `calls`: (a program with a `team` address, the buffer handles of its parameters)."""
    if self._runner is None:   # loaded once, outside the cap: never unloaded while the device lives
      key_extra, build = _gcc_build()
      cdef = "void g_run_team(int, uintptr_t*, int*, uintptr_t*);"
      self._runner = cache.load_cached(TEAM_RUNNER, key_extra, ".so", build, lambda path: Library(path, cdef, TEAM_RUNNER))[1]
    for program, _ in calls: program.loaded()
    # all loaded, then the addresses: loading a later program may have unloaded an earlier one (the cap), and loading
    # that one again (a kernel twice in the team) mapped it anew
    if any(program.team is None for program, _ in calls):   # more libraries than the cap holds: one by one
      for program, handles in calls: program(*handles)
      return
    teams, offsets, args = [], [], []
    for program, handles in calls:
      teams.append(program.team); offsets.append(len(args)); args += handles
    self._runner.handle.g_run_team(len(calls), teams, offsets, args)   # (cffi passes each list as a C array)

  def library(self, source: str, cdef: str) -> Library:
    """The loaded library of `source` declared by `cdef`: built (or found in the cache) and loaded when it is not
    loaded already. Loading one more than the cap unloads the least recently used one."""
    key_extra, build = _gcc_build()
    cap = max_libraries()
    return cache.load_cached(source, key_extra, ".so", build, lambda path: self._load(path, cdef, source, cap))[1]

  def _load(self, path: Path, cdef: str, source: str, cap: int) -> Library:
    key = (str(path), cdef)
    if (library := self._libs.get(key)) is not None:
      self._libs.move_to_end(key)
      return library
    library = self._libs[key] = Library(path, cdef, source)
    while len(self._libs) > cap: self._libs.popitem(last=False)[1].unload()
    return library


# The parallel region of `CPUDevice.run_team`: each thread runs its share of each kernel (NAME_team), then waits at a
# barrier of its own for the others before the next kernel (and after the last one, so that none sleeps at libgomp's
# barrier that ends the region). The wait spins for up to 50 us (the end of a kernel's last chunks is usually a few
# microseconds away, and waking a halted virtual CPU costs more than that), then sleeps on a futex until the last
# thread arrives. Spinning longer, or yielding instead of sleeping, was ruinous on a loaded machine: the thread it
# waits for may be waiting for that very core (a 12-layer GPT of width 64, 2 cores at load 1.4-1.8: 46.6 ms a call
# with ~1 ms of spinning and sched_yield against 16.0 with a region per kernel; bench/call_time.py --device CPU).
# The sleepers count lets the last thread skip the wake-up call when nobody sleeps (all sequentially consistent:
# either the last thread sees a sleeper, or the sleeper's futex wait sees the new generation and returns).
TEAM_RUNNER = """#include <stdint.h>
#include <limits.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>
#include <time.h>
#include <omp.h>
typedef void (*g_team_fn)(void* const*);
#define SPIN_NS 50000   /* the spin's length, by the clock: a pause instruction takes 10 to 140 cycles by the chip */
static long g_now_ns(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1000000000L + t.tv_nsec; }
static void g_team_barrier(int* arrived, int* generation, int* sleepers, int threads) {
  int gen = __atomic_load_n(generation, __ATOMIC_SEQ_CST);
  if (__atomic_add_fetch(arrived, 1, __ATOMIC_SEQ_CST) == threads) {
    __atomic_store_n(arrived, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(generation, gen + 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers, __ATOMIC_SEQ_CST)) syscall(SYS_futex, generation, FUTEX_WAKE_PRIVATE, INT_MAX, 0, 0, 0);
    return;
  }
  for (long spins = 0, until = g_now_ns() + SPIN_NS; (spins & 63) || g_now_ns() < until; spins++) {
    if (__atomic_load_n(generation, __ATOMIC_SEQ_CST) != gen) return;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  __atomic_add_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
  while (__atomic_load_n(generation, __ATOMIC_SEQ_CST) == gen)
    syscall(SYS_futex, generation, FUTEX_WAIT_PRIVATE, gen, 0, 0, 0);   /* returns at once if the generation moved */
  __atomic_sub_fetch(sleepers, 1, __ATOMIC_SEQ_CST);
}
void g_run_team(int n, const uintptr_t* fns, const int* offsets, const uintptr_t* args) {
  int arrived = 0, generation = 0, sleepers = 0;
  #pragma omp parallel
  {
    int threads = omp_get_num_threads();
    for (int i = 0; i < n; i++) {   /* (after the last kernel too: the threads then reach the region's end together) */
      ((g_team_fn)fns[i])((void* const*)(args + offsets[i]));
      g_team_barrier(&arrived, &generation, &sleepers, threads);
    }
  }
}
"""


# ---------------------------------------------------------------- compiler

def compiler() -> list[str]:
  """The C compiler command: $CC (which may carry arguments, e.g. "ccache gcc") or gcc."""
  return shlex.split(os.environ.get("CC", "")) or ["gcc"]


@functools.cache
def _identity(cmd: tuple[str, ...], exe: str) -> str:
  try: out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60).stdout
  except (OSError, subprocess.SubprocessError) as e: out = f"unknown ({e})"
  return f"{exe}: {out.splitlines()[0] if out else ''}"


def compiler_identity(cc: list[str]) -> str:
  """Resolved path and version line of the compiler, for the cache key: an upgrade must not reuse old builds."""
  if (exe := shutil.which(cc[0])) is None:
    raise CompileError(f"C compiler {cc[0]!r} not found (from CC={os.environ.get('CC', '')!r} or the default gcc): "
                       f"install gcc, or set CC to the path of a C compiler")
  return _identity(tuple(cc), exe)


@functools.cache
def machine_identity() -> str:
  """-march=native code only runs on the CPU it was built for; a cache dir shared over NFS must not mix them."""
  try:
    with open("/proc/cpuinfo") as f:
      lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "Features"))]
  except OSError:
    lines = []
  return "\n".join([platform.machine(), *dict.fromkeys(lines)])


def sanitizing() -> bool:
  return env_flag("GRAFT_SANITIZE", False, "kernels built with -fsanitize=address,undefined")


@functools.cache
def _accepted(cc: tuple[str, ...], flag: str) -> bool:
  try: return subprocess.run([*cc, flag, "-x", "c", "-c", "-o", os.devnull, "-"], input="int x;", capture_output=True,
                             text=True, timeout=60).returncode == 0
  except (OSError, subprocess.SubprocessError): return False


def cflags(cc: list[str]) -> tuple[str, ...]:
  """The flags of a kernel build with compiler `cc`: CFLAGS and the optional ones it takes, or the sanitizer's."""
  if sanitizing():
    _check_asan_loaded()
    return SANITIZE_CFLAGS
  return CFLAGS + tuple(f for f in OPTIONAL_CFLAGS if _accepted(tuple(cc), f))


def _check_asan_loaded() -> None:
  try:
    with open("/proc/self/maps") as f: loaded = "libasan" in f.read()
  except OSError: return   # no /proc: let the loader say it
  if not loaded:
    raise CompileError("GRAFT_SANITIZE=1 builds kernels with AddressSanitizer, whose runtime must be the first library "
                       "of the process: run python with LD_PRELOAD=$(gcc -print-file-name=libasan.so) and "
                       "ASAN_OPTIONS=detect_leaks=0 (or run `python3 bench/fuzz.py --sanitize`)")


def compile_c(cc: list[str], src: Path, out: Path) -> None:
  """The one compiler call: `src` (C with OpenMP) into the shared library `out`. Raises CompileError."""
  run_compiler([*cc, *cflags(cc), "-o", str(out), str(src), "-lm"], "the C compiler", src)


def _gcc_build() -> tuple[tuple[str, ...], Any]:
  """The cache key's compiler part and the build function of shared libraries."""
  cc = compiler()
  return (compiler_identity(cc), *cflags(cc), machine_identity()), functools.partial(compile_c, cc)


def library_path(source: str) -> Path:
  """The cached shared library of `source`, compiled now when it is not cached yet; nothing is loaded."""
  key_extra, build = _gcc_build()
  return cache.build_cached(source, key_extra, ".so", build)


# ---------------------------------------------------------------- prototypes

def _defines(source: str, name: str) -> bool:
  return re.search(rf"^[ \t]*void[ \t]+{re.escape(name)}[ \t]*\(", source, re.M) is not None


def _find_kernel(source: str, name: str) -> re.Match:
  m = re.search(rf"^[ \t]*void[ \t]+{re.escape(name)}[ \t]*\(([^)]*)\)", source, re.M)
  if m is None:
    raise ValueError(f"kernel {name!r} not found in the source: the CPU device expects its definition on a line "
                     f"starting with 'void {name}('")
  return m


def kernel_prototype(source: str, name: str) -> str:
  """The cffi declaration of kernel `name`, read from its `void name(...)` line (see the module docstring)."""
  types = ["uintptr_t" if t is None else t for t in parameter_types(_find_kernel(source, name).group(1), name)]
  return f"void {name}({', '.join(types)});"
