"""realize: tensor graphs in, buffers out. Runs the rule pipeline into a host program, builds its new kernels, runs it.

The host side is a program too (rules/host.py, runtime/program.py): allocations, copies, kernel calls, library calls
and frees, with intermediate buffers sharing storage where their lifetimes do not overlap. Kernels are cached by their
normalized form (buffers replaced by numbered slots), so a graph rebuilt every call reuses its compiled kernels; a
graph of the same structure, over the same buffers or over new ones of the same kind (dtype, size, device), reuses
its whole program: existing buffers are the program's parameters (`graph_key`). `last_program()` is the program of this
thread's latest realize.

Threads: several threads may realize at once. The caches here (`_kernels`, `_by_name`, `_plans`) are read and
published under `_lock`; the pipeline, rendering and compiling run outside it, concurrently (docs/design.md,
"Threads").

DEBUG=1 prints one line per realize, DEBUG=2 the host program and one line per step, DEBUG=3 the generated source too.
"""
from __future__ import annotations
import contextlib, hashlib, math, threading, time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable
from dataclasses import dataclass
from rewrite import UOp, Ops, stats, substitute, viz
from rewrite.env import EnvTexts

from rules.pipeline import schedule, Run, pipeline
from rules.realize import NewBuffer, buffers_written, read_before_written
from rules.host import HostContext
from rules.strided_view import View
from rules.gpu import launch_dims, MULTIPROCESSORS
from rules.opt import tensor_core
from .buffer import check_allocatable
from .device import get_device, canonical_name, renderer_of, device_arch
from .program import Program
from . import cache, capture, extern, pick
from .search import lower_planned
from .progress import Progress, debug_level


@dataclass(eq=False)
class CompiledKernel:
  name: str
  device: str
  source: str
  linear: UOp | None         # the lowered kernel (None for a template: renderers/attention_c.py, attention_cuda.py)
  args: list[int]            # slot numbers the kernel takes, in parameter order
  flops: int
  bytes: int
  stored: frozenset[int]     # the slots it writes
  program: object = None
  global_size: tuple[int, ...] | None = None   # launch geometry of a device_loops kernel (rules/gpu.py)
  local_size: tuple[int, ...] | None = None
  plan: str = ""             # the optimization plan it was lowered with, and where the plan came from (rules/opt)
  note: str = ""             # what DEBUG=2 says of it (a tiled attention kernel: used, or why not)


def kernel_cost(linear: UOp, buffers: list[UOp]) -> tuple[int, int]:
  """(arithmetic ops executed, bytes of the buffers touched once each): for DEBUG's rates."""
  flops, trips = 0, [1]  # iterations of each enclosing loop nest, innermost last (a loop may run 0 times)
  for u in linear.src:
    trip = trips[-1]
    if u.op is Ops.RANGE: trips.append(trip * u.src[0].arg)
    elif u.op is Ops.END: trips.pop()
    elif u.op in (Ops.ADD, Ops.MUL, Ops.MAX, Ops.FDIV, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIP, Ops.MULACC) and u.dtype.is_float: flops += trip * u.dtype.count
    elif u.op is Ops.ASSIGN: flops += trip * u.dtype.count
  return flops, buffer_bytes(buffers)


def buffer_bytes(buffers: list[UOp]) -> int: return sum(b.arg.size * b.dtype.itemsize for b in buffers)


# compiled kernels by (normalized kernel, device, pipeline version, the tensor-core switches) and by (name, device); a
# change to the pipeline (a user's rules) makes new keys, so no kernel compiled by the old pipeline is reused, and
# GRAFT_TF32, GRAFT_TC, GRAFT_WGMMA and GRAFT_TC_TILE (read as a product is lowered) change what a kernel compiles to
_kernels: dict[tuple[UOp, str, int], CompiledKernel] = {}
_by_name: dict[tuple[str, str, int], CompiledKernel] = {}
MAX_KERNELS = 4096


def _multiprocessors(device: str, device_loops: bool) -> int | None:
  """The SM count the grid plan sizes grids by (a CUDA device asks its driver), or None (the plan's default) where
  the device cannot start: sources for a GPU render on a machine without one (Tensor.kernel_sources)."""
  if not device_loops: return None
  try: return getattr(get_device(device), "multiprocessor_count", None)
  except RuntimeError: return None   # CUDAUnavailable: no driver here


def tiled_attention(norm: UOp, renderer, multiprocessors: int, arch: str) -> tuple[tuple | None, str]:
  """((source, launch dims or None, flops, arguments), DEBUG=2 note) of a fused attention kernel as the tiled kernel
  of its device (the CPU: renderers/attention_c.py; CUDA: renderers/attention_cuda.py), asked before the generic
  stages, which it then makes unneeded (on a GPU they unroll the head's accumulators: most of a first call's
  lowering); (None, why not) where the tiled kernel cannot address its operands, and (None, "") for any other kernel
  or renderer. Its arguments are every buffer the kernel reads or writes. A template runs no rule set: a user's rules
  on the lowering stages do not reach it (GRAFT_ATTENTION=0 keeps attention unfused), and its statistics list no
  stages."""
  from renderers.attention_c import Unsupported, attention_operands, attention_source
  from renderers.attention_cuda import attention_cuda_source
  from renderers.c import CRenderer
  from renderers.cuda import CUDARenderer
  from rules.attention import OnlineSoftmax
  if not isinstance(renderer, (CRenderer, CUDARenderer)): return None, ""   # (a user's device: its generic kernel)
  if not any(u.op is Ops.REDUCE_AXIS and isinstance(u.arg[0], OnlineSoftmax) for u in norm.toposort): return None, ""
  args = sorted({u.arg.number for u in norm.toposort if u.op is Ops.BUFFER})
  try:
    ops = attention_operands(norm)
    flops = 2 * math.prod(ops.batch) * ops.tq * ops.tk * (ops.dk + ops.d)   # its two products
    if isinstance(renderer, CRenderer):
      return (attention_source(norm, args), None, flops, args), \
          "attention tiled: query rows x keys in register tiles and vector lanes (renderers/attention_c.py)"
    src, (blocks, threads) = attention_cuda_source(norm, args, multiprocessors, arch)
    return (src, ((blocks, 1, 1), (threads, 1, 1)), flops, args), \
        "attention tiled: q, k and v tiles in shared memory, 4 rows x 8 keys a thread (renderers/attention_cuda.py)"
  except Unsupported as e: return None, f"attention not tiled: {e}; the row-at-a-time kernel instead"


def _compile(norm: UOp, buffers: list[UOp], device: str) -> CompiledKernel:
  renderer = renderer_of(device)
  device_loops = getattr(renderer, "device_loops", False)
  run = Run(device, parallel=not device_loops, device_loops=device_loops,
            multiprocessors=_multiprocessors(device, device_loops) or MULTIPROCESSORS,
            arch=device_arch(device, Run.arch) if device_loops else Run.arch)   # sm_90: the tensor cores' wgmma
  # per-kernel statistics: collect this kernel's stages (rendering included) apart, then file them under its name
  with viz.scope("kernel") as recorded, stats.collect(level=1) if stats.active else contextlib.nullcontext() as mine:
    tiled, note = tiled_attention(norm, renderer, run.multiprocessors, run.arch)
    if tiled is None:
      linear = lower_planned(norm, buffers, device, run)
      body = renderer.render("KERNEL_NAME", linear)
  if tiled is not None:   # a template: no stages, its own launch and cost
    body, dims, flops, args = tiled
    linear, kind, nbytes = None, "r", buffer_bytes(buffers)
  else:
    dims = launch_dims(linear) if device_loops else None
    kind = "r" if any(u.op in (Ops.REDUCE, Ops.BARRIER) for u in linear.src) else "E"   # BARRIER: a block's reduction
    args = sorted(u.arg for u in linear.src if u.op is Ops.DEFINE_GLOBAL)
    flops, nbytes = kernel_cost(linear, buffers)
  shape = norm.src[0].src[0].arg.shape
  name = f"{kind}_{'_'.join(map(str, shape)) or 'scalar'}_{hashlib.sha1(body.encode()).hexdigest()[:8]}"
  stored = frozenset(b.arg.number for b in buffers_written(norm))
  ck = CompiledKernel(name, device, body.replace("KERNEL_NAME", name), linear, args, flops, nbytes, stored,
                      plan=(str(run.opt.plan) if run.opt else "") + (" [tiled attention]" if tiled is not None else ""), note=note)
  if dims is not None: ck.global_size, ck.local_size = dims
  recorded.name = name
  recorded.attrs.update(source=ck.source, plan=ck.plan, flops=flops, bytes=nbytes, device=device)
  if stats.active:
    for c in stats.active: c.add_kernel(name, mine.stages, ck.plan)
  return ck


_lock = threading.Lock()     # guards _kernels, _by_name and _plans
_local = threading.local()   # this thread's last program


def last_program() -> Program | None:
  """The host program of this thread's most recent realize (None before the first)."""
  return getattr(_local, "program", None)


# A warm call rebuilds its graph, over new input data as often as not: its program is found by the graph's structure
# with each existing buffer (an input, an assignment's target) standing for its position among the program's
# parameters, its dtype, size and device (the views it is read through are nodes of the structure), not its identity.
# So a new input of the same kind runs the cached program with no rewrite at all, and the cache keeps no user buffer
# alive. The table is bounded (MAX_PLANS); nothing else grows per call.
_plans: dict[tuple, Program] = {}
MAX_PLANS = 256
Target = tuple[UOp, View]  # an assignment: the existing BUFFER an output is written into, and the View of it written


def graph_key(uops: list[UOp], targets: list[Target | None] | None = None) -> tuple[tuple, list[UOp]]:
  """(key, parameters) of the graphs `uops` written into `targets`: the key is the graphs' nodes sources first, each
  as (op, dtype, arg, the places of its sources), an existing BUFFER as ("param", dtype, size, device), a node a
  recorded composite made (UOp._made) as ("composite", dtype, its record, the places of its stand-ins), the nodes
  between not walked (a replay not built yet, tensor/recorded.py Unbuilt, is keyed so too), then the outputs' places;
  the parameters are those BUFFERs, in that order (the targets' last). Exact: two graphs share a
  key only when one is the other with its existing buffers renamed, aliasing included (a + a is not a + b): a record
  replayed over stand-ins of one structure builds one structure. One pass over the graph."""
  place: dict[UOp, int] = {}
  parts: list[tuple] = []
  params: list[UOp] = []
  # its own walk, sources first in the order of `toposort` (the same key whether or not a node's toposort is cached),
  # caching nothing on the graph: a warm call on new data walks a new graph, and costs what one on the same data does
  stack = [(u, None) for u in reversed(uops)]
  pop, push, BUFFER = stack.pop, stack.append, Ops.BUFFER
  while stack:
    n, made = pop()
    if n in place: continue
    if made is None:   # first visit: its sources (a composite's stand-ins) go first
      made = n._made or False
      push((n, made))
      for s in reversed(made[1] if made else n.src):
        if s not in place: push((s, None))
      continue
    place[n] = len(parts)
    if made: parts.append(("composite", n.dtype, made[0], tuple([place[s] for s in made[1]])))
    elif n.op is BUFFER and not isinstance(n.arg, NewBuffer):
      parts.append(("param", n.dtype, n.arg.size, n.arg.device)); params.append(n)
    else: parts.append((n.op, n.dtype, n._key[2], tuple([place[s] for s in n.src])))
  written = []
  for t in targets or ():
    if t is None: written.append(None); continue
    if t[0] not in place:
      place[t[0]] = len(parts); parts.append(("param", t[0].dtype, t[0].arg.size, t[0].arg.device)); params.append(t[0])
    written.append((place[t[0]], t[1]))
  return (tuple(parts), tuple([place[u] for u in uops]), tuple(written)), params


def build_program(outputs: list[tuple[UOp, str]], targets: list[Target | None] | None = None) -> Program:
  """The host program computing `outputs` (graph, device), from the cache or made now; output i is written into
  `targets[i]` (an existing buffer's view) where that is given."""
  return find_program(outputs, targets)[0]


# extern.mode, pick.split_mode, attention.fusion_switch, and what the tensor_core stage reads (tensor_core.SWITCHES)
SWITCHES = ("GRAFT_EXTERN", "GRAFT_SPLIT_REDUCE", "GRAFT_ATTENTION", *tensor_core.SWITCHES)
_switches = EnvTexts(*SWITCHES)


def find_program(outputs: list[tuple[UOp, str]], targets: list[Target | None] | None = None) -> tuple[Program, list]:
  """(program, the Buffers to run it on: its parameters in order): the program from the cache when one of this key
  is there (no rewrite at all), else made now and cached."""
  uops = [u for u, _ in outputs]
  devices = tuple(canonical_name(d) for _, d in outputs)
  targets = targets or [None] * len(outputs)
  structure, params = graph_key(uops, targets)
  # the switches that decide the program, as their raw text: parsed (and checked) by the pipeline on a miss
  key = (structure, devices, pipeline.version, _switches())
  with _lock: program = _plans.get(key)
  # (REWRITE_STATS wants to see the pipeline's work, so statistics always run it)
  if program is None or stats.active:
    cache.cache_dir()   # a bad GRAFT_CACHE is an error before anything compiles (a warm call reads no cache)
    uops = [u if u.__class__ is UOp else u.build() for u in uops]   # (an unbuilt replay: tensor/recorded.py)
    with viz.scope("realize") as recorded:
      program = _build(_lower(uops, list(devices), targets), params)
    program.key = key   # (jit compares the programs of two calls by it)
    _describe(recorded, program)
    with _lock:
      if len(_plans) >= MAX_PLANS: del _plans[next(iter(_plans))]   # the oldest first
      _plans[key] = program
  return program, [b.arg for b in params]


@dataclass
class _Lowered:
  host: UOp                                   # the planned host program
  kernels: dict[UOp, CompiledKernel]          # every kernel it calls, by normalized form
  new: dict[tuple, CompiledKernel]            # those not in the caches yet: to build, then publish
  returned: list[UOp]
  outputs: list[tuple]
  explanations: list[str]
  started: float = 0.0                        # when lowering began (time.perf_counter()): for the progress line


def _lower(uops: list[UOp], devices: list[str], targets: list[Target | None], to_run: bool = True) -> _Lowered:
  """The pipeline from tensor graphs to the planned host program, and the kernels it calls rendered (not built).
  A program `to_run` has its new buffers checked against the device's memory first (a plan only to read needs no
  device)."""
  run = Run(devices[0] if devices else "CPU")
  run.device_loops = bool(devices) and getattr(renderer_of(run.device), "device_loops", False)
  run.multiprocessors = grid_multiprocessors(run.device) or run.multiprocessors   # (the attention stage's threads)
  kernels, realized = schedule(uops, devices, run)
  for shape, buf in new_buffers(kernels) if to_run else (): check_allocatable(buf.arg.device, shape, buf.dtype)  # before compiling
  kernels, outputs, returned, wanted = list(kernels), [], [], {}
  # buffers a kernel of this schedule computes: its stores can go to the target instead (a COPY's cannot: the host
  # stage redirects KERNEL stores only). Only the schedule's own kernels: a copy appended below for an earlier target
  # is not one (taking it for one sent an earlier output's write to a later target)
  made_here = {b for k in kernels if k.op is Ops.KERNEL for b in buffers_written(k)}
  for u, t in zip(realized, targets):
    b = u.src[0]
    if t is None:
      outputs.append((u.dtype, u.arg, b)); returned.append(b)
      continue
    outputs.append((u.dtype, t[1], t[0]))
    if b is t[0] and u.arg == t[1]: continue  # assigned its own value
    if b in made_here: wanted[b] = t
    else:  # a value some kernel does not make here (an existing buffer, a copy from another device): copied across
      if b is t[0]:
        # the target's own memory read at other elements (x[::-1].assign(x)): one kernel would overwrite elements it
        # has still to read, so the value goes through a buffer of its own first (numpy copies an overlapping value too)
        aside = run.kernelize.new_buffer(u.dtype, math.prod(u.arg.shape), t[0].arg.device)
        whole = View.contiguous(u.arg.shape)
        kernels.append(UOp(Ops.KERNEL, src=(UOp(Ops.STORE, src=(UOp(Ops.VIEW, u.dtype, (aside,), whole), u)),), arg=t[0].arg.device))
        u = UOp(Ops.VIEW, u.dtype, (aside,), whole)
      kernels.append(UOp(Ops.KERNEL, src=(UOp(Ops.STORE, src=(UOp(Ops.VIEW, u.dtype, (t[0],), t[1]), u)),), arg=t[0].arg.device))
  # a target written in place is read by every kernel as it was before the realize (tensor/assign.py writes in place)
  kernels = read_before_written(kernels, {b: t[0] for b, t in wanted.items()},
                                lambda t: run.kernelize.new_buffer(t.dtype, t.arg.size, t.arg.device))
  run.host = HostContext(frozenset(returned), wanted, extern.routines, extern.mode(), grid_multiprocessors, pick.split_mode())
  host = pipeline.run(UOp(Ops.SINK, src=tuple(kernels), arg="steps"), "host", run)
  compiled: dict[UOp, CompiledKernel] = {}
  new: dict[tuple, CompiledKernel] = {}
  new_by_name: dict[tuple, CompiledKernel] = {}
  calls = [call for step in host.src for call in kernel_calls(step)]
  version = (pipeline.version, tensor_core.switches())
  with _lock: todo = len({norm for norm, _ in calls if (norm, norm.arg, version) not in _kernels})
  progress, started = Progress("compiling"), time.perf_counter()
  for norm, buffers in calls:
    key = (norm, norm.arg, version)
    with _lock: ck = _kernels.get(key) or new.get(key)
    if ck is None:
      progress.show(f"kernel {len(new) + 1} of {todo}")
      ck = _compile(norm, buffers, norm.arg)
      progress.line(f"kernel {len(new) + 1} of {todo}: {ck.name}, plan {ck.plan}")
      # two kernels that differ only in what the code never sees (the size of a buffer read in part, say) render
      # to one text: one compiled function serves both
      name_key = (ck.name, norm.arg, pipeline.version)
      with _lock: same = _by_name.get(name_key)
      if (same := same or new_by_name.get(name_key)) is not None: ck = same
      else: new_by_name[name_key] = ck
      new[key] = ck
    compiled[norm] = ck
  explanations = (run.attention.notes if run.attention else []) + [ck.note for ck in compiled.values() if ck.note] + run.kernelize.explanations + \
    (run.group.refused + run.group.merged if run.group else []) + (run.fuse.inlined if run.fuse else [])
  progress.done()
  return _Lowered(host, compiled, new, returned, outputs, explanations, started)


def kernel_calls(step: UOp) -> list[tuple[UOp, list[UOp]]]:
  """(normalized kernel, the buffers filling its slots) of every kernel a host step may call."""
  if step.op is Ops.CALL: return [(step.arg, list(step.src))]
  if step.op is Ops.EXTERN: return [(step.arg.kernel, list(step.src))]
  if step.op is Ops.PICK:   # a library option's generated kernel (Extern.kernel) is the one its slots read
    return [(getattr(c, "kernel", c), [step.src[i] for i in idx]) for _, calls in step.arg.options for c, idx in calls]
  return []


def grid_multiprocessors(device: str) -> int | None:
  """The SM count the host stage sizes split reductions by, on a device whose loops are a grid of threads (the
  driver's count, or the plan's default where no GPU answers); None on any other device, which splits none."""
  if not getattr(renderer_of(device), "device_loops", False): return None
  return _multiprocessors(device, True) or MULTIPROCESSORS


def _build(low: _Lowered, params: list[UOp]) -> Program:
  """Build the new kernels (one compiler call per device) and publish them, then make the program. New kernels are
  published only once all of them are built: a failure leaves no half-made entry."""
  pending: dict[str, list[CompiledKernel]] = {}
  for ck in dict.fromkeys(low.new.values()):
    if ck.program is None: pending.setdefault(ck.device, []).append(ck)
  with Progress("compiling", since=low.started) as progress:
    for device, cks in pending.items():
      dev = get_device(device)
      groups = compile_groups(cks, dev.compilers)
      calls = "one compiler call" if len(groups) == 1 else f"{len(groups)} compiler calls side by side"
      progress.line(f"building {len(cks)} kernels for {device} in {calls}")
      def build(group: list[CompiledKernel]) -> dict:
        return dev.build(dev.renderer.source([ck.source for ck in group]), [ck.name for ck in group])
      if len(groups) == 1: built = [build(groups[0])]
      else:   # (the compilers are processes: these threads only wait for them)
        with ThreadPoolExecutor(len(groups)) as pool: built = list(pool.map(build, groups))
      for group, programs in zip(groups, built):
        for ck in group: ck.program = programs[ck.name]
  with _lock:
    if len(_kernels) + len(low.new) > MAX_KERNELS: _kernels.clear(); _by_name.clear()  # a program of ever-new shapes
    _kernels.update(low.new)
    _by_name.update({(ck.name, ck.device, pipeline.version): ck for ck in low.new.values()})
  program = Program(low.host, low.kernels, low.returned, low.outputs, params)
  program.explanations = low.explanations
  return program


def compile_groups(cks: list[CompiledKernel], compilers: int) -> list[list[CompiledKernel]]:
  """`cks` split into at most `compilers` groups, one source (one compiler call) each, of about equal work: the
  longest sources first, each to the group with the least source so far (a kernel's compile time grows with its
  source's length)."""
  groups: list[list[CompiledKernel]] = [[] for _ in range(max(1, min(compilers, len(cks))))]
  load = [0] * len(groups)
  for ck in sorted(cks, key=lambda ck: -len(ck.source)):
    i = load.index(min(load))
    groups[i].append(ck); load[i] += len(ck.source)
  return groups


def new_buffers(kernels: list[UOp]) -> list[tuple[tuple[int, ...], UOp]]:
  """(shape, BUFFER) of each buffer the schedule creates: the shape a kernel stores, or the size a copy writes."""
  written = [(st.src[0].arg.shape, st.src[0].src[0]) for k in kernels if k.op is Ops.KERNEL for st in k.src]
  written += [((k.src[0].arg.size,), k.src[0]) for k in kernels if k.op is Ops.COPY]
  return [(shape, b) for shape, b in written if isinstance(b.arg, NewBuffer)]


def plan(outputs: list[tuple[UOp, str]], device: str | None = None) -> Program:
  """The host program a realize of `outputs` would run, its kernels rendered but not compiled (so it cannot run):
  for its listing, its memory figures and its sources. `device` plans for that device instead (stand-in buffers of
  that device replace the graph's)."""
  uops, devices = [u for u, _ in outputs], [canonical_name(d) for _, d in outputs]
  if device is not None:
    device = canonical_name(device)
    stand_in = {n: UOp(Ops.BUFFER, n.dtype, (), NewBuffer(n.arg.size, device, -1 - i))
                for i, n in enumerate(n for u in uops for n in u.toposort if n.op is Ops.BUFFER and n.arg.device != device)}
    uops, devices = [substitute(u, stand_in) for u in uops], [device] * len(uops)
  with viz.scope("plan") as recorded:
    low = _lower(uops, devices, [None] * len(uops), to_run=False)
  program = Program(low.host, low.kernels, low.returned, low.outputs, graph_key(uops)[1])
  program.explanations = low.explanations
  _describe(recorded, program, " (planned, not run)")
  return program


def _describe(recorded: viz.Scope, program: Program, note: str = "") -> None:
  """What the viewer's page says of a realize (or a plan) it recorded: its size, and the host program."""
  recorded.name = f"{len(program.kernels_called())} kernels, {len(program.steps)} steps{note}"
  recorded.attrs["program"] = str(program)


def kernel_sources(outputs: list[tuple[UOp, str]], device: str | None = None) -> list[str]:
  """The source of each kernel a realize of `outputs` would compile, in call order, without compiling or running
  anything (rendered for `device` where given)."""
  return [ck.source for ck in dict.fromkeys(plan(outputs, device).kernels_called())]


def realize(outputs: list[tuple[UOp, str]], targets: list[Target | None] | None = None,
            before_run: Callable[[list], list] | None = None, wait: bool = True) -> list[UOp]:
  """Each output graph computed into a buffer of its device: the list of `VIEW(BUFFER)` forms, in order. Output i is
  written into the existing buffer view `targets[i]` where that is given (an assignment), and that view is returned;
  every output reads every target as it was before the realize. `before_run(inputs) -> inputs`, once the program is
  found and before it runs, may put other Buffers in place of its inputs (tensor/assign.py: the old contents of a
  target kept for a lazy graph that still reads them); it may clear `outputs` and `targets`, which are not read after.
  With `wait=False` it returns once the work is launched, and the caller calls `wait()` when its own bookkeeping is
  done (that Python then runs while a GPU computes: Tensor.realize lets the graph go there)."""
  t0, dbg = time.perf_counter(), debug_level()   # read first: a bad DEBUG is an error before any compile
  program, inputs = find_program(outputs, targets)
  if before_run is not None: inputs = before_run(inputs)
  if dbg >= 2:
    print(program)
    for line in program.explanations: print(f"  {line}")
  results = program.run(inputs, dbg)
  capture.note_realize(program, inputs, results)
  _local.program = program
  if wait or dbg >= 1: _wait_for(program)
  if dbg >= 1 and program.steps:
    print(f"realize: {len(program.kernels_called())} kernels, {len(program.steps)} steps, "
          f"{(time.perf_counter() - t0) * 1e3:.2f} ms")
  return results



def wait() -> None:
  """Wait for the devices of this thread's latest realize (the end of a `realize(..., wait=False)`)."""
  if (program := last_program()) is not None: _wait_for(program)


def _wait_for(program: Program) -> None:
  for dev in program.devices: get_device(dev).synchronize()
