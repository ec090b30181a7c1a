"""realize: tensor graphs in, buffers out. Runs the rule pipeline, renders and builds new kernels, runs the schedule.

The host side is a program too: `Schedule` is the list of steps (a kernel call over buffers, or a copy between
devices) in execution order. Kernels are cached by their normalized form (buffers replaced by numbered slots), so a
graph rebuilt every call reuses its compiled kernels.

DEBUG=1 prints one line per realize, DEBUG=2 one line per kernel, DEBUG=3 the generated source too.
"""
from __future__ import annotations
import contextlib, hashlib, os, time, weakref
from dataclasses import dataclass, field
from rewrite import UOp, Ops, stats
from rules.pipeline import schedule, lower_kernel, Run, pipeline
from rules.realize import NewBuffer, normalize
from rules.gpu import launch_dims
from .buffer import Buffer
from .device import get_device, canonical_name


def debug_level() -> int:
  try: return int(os.environ.get("DEBUG", "0") or 0)
  except ValueError: return 0


@dataclass(eq=False)
class CompiledKernel:
  name: str
  device: str
  source: str
  linear: UOp
  args: list[int]            # slot numbers the kernel takes, in parameter order
  flops: int
  bytes: int
  program: object = None
  global_size: tuple[int, ...] | None = None   # launch geometry of a device_loops kernel (rules/gpu.py)
  local_size: tuple[int, ...] | None = None


def kernel_cost(linear: UOp, buffers: list[UOp]) -> tuple[int, int]:
  """(arithmetic ops executed, bytes of the buffers touched once each): for DEBUG's rates."""
  flops, trips = 0, [1]  # iterations of each enclosing loop nest, innermost last (a loop may run 0 times)
  for u in linear.src:
    trip = trips[-1]
    if u.op is Ops.RANGE: trips.append(trip * u.src[0].arg)
    elif u.op is Ops.END: trips.pop()
    elif u.op in (Ops.ADD, Ops.MUL, Ops.MAX, Ops.FDIV, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIP, Ops.MULACC) and u.dtype.is_float: flops += trip
    elif u.op is Ops.ASSIGN: flops += trip
  return flops, sum(b.arg.size * b.dtype.itemsize for b in buffers)


# compiled kernels by (normalized kernel, device, pipeline version) and by (name, device); a change to the pipeline
# (a user's rules) makes new keys, so no kernel compiled by the old pipeline is reused
_kernels: dict[tuple[UOp, str, int], CompiledKernel] = {}
_by_name: dict[tuple[str, str, int], CompiledKernel] = {}
MAX_KERNELS = 4096


def _compile(norm: UOp, buffers: list[UOp], device: str) -> CompiledKernel:
  renderer = get_device(device).renderer
  device_loops = getattr(renderer, "device_loops", False)
  run = Run(device, parallel=not device_loops, device_loops=device_loops)
  # per-kernel statistics: collect this kernel's stages (rendering included) apart, then file them under its name
  with stats.collect(level=1) if stats.active else contextlib.nullcontext() as mine:
    linear = lower_kernel(norm, run)
    body = renderer.render("KERNEL_NAME", linear)
  shape = norm.src[0].src[0].arg.shape
  kind = "r" if any(u.op in (Ops.REDUCE, Ops.BARRIER) for u in linear.src) else "E"   # BARRIER: a block's reduction
  name = f"{kind}_{'_'.join(map(str, shape)) or 'scalar'}_{hashlib.sha1(body.encode()).hexdigest()[:8]}"
  args = sorted(u.arg for u in linear.src if u.op is Ops.DEFINE_GLOBAL)
  flops, nbytes = kernel_cost(linear, buffers)
  ck = CompiledKernel(name, device, body.replace("KERNEL_NAME", name), linear, args, flops, nbytes)
  if device_loops and (dims := launch_dims(linear)) is not None: ck.global_size, ck.local_size = dims
  if stats.active:
    for c in stats.active: c.add_kernel(name, mine.stages)
  return ck


@dataclass
class Step:
  kernel: CompiledKernel | None   # None: a copy between devices
  buffers: list[Buffer]


@dataclass
class Schedule:
  steps: list[Step] = field(default_factory=list)
  outputs: list[UOp] = field(default_factory=list)
  explanations: list[str] = field(default_factory=list)


@dataclass
class _Plan:
  """A schedule with its buffers left open: a buffer to create is its BUFFER UOp (arg NewBuffer), an existing one a
  weak reference (a cached plan must not keep the user's memory alive)."""
  steps: list[tuple[CompiledKernel | None, list]]
  outputs: list[tuple]   # (dtype, View, buffer) of each output's VIEW(BUFFER)
  explanations: list[str]


# A warm call rebuilds its graph from the same tensors: the same structure over the same buffers, so its plan is
# reused and only its new buffers are made (the whole pipeline is skipped). Keyed by structure, with each input
# buffer by identity; an entry holds its buffers through weak references and is void once one of them is gone.
_plans: dict[tuple, tuple[list, _Plan]] = {}
MAX_PLANS = 256


def graph_key(uops: list[UOp]) -> tuple[int, ...]:
  """The structure of the graphs `uops`, buffers by identity: numbers the UOps keep (UOp.structure), so a warm call
  pays only for the nodes it built anew, and nothing walks a graph already numbered."""
  return tuple(u.structure for u in uops)


def input_buffers(uops: list[UOp]) -> list:
  """The existing buffers the graphs read (a cached plan holds them weakly: it is void once one is gone)."""
  return list(dict.fromkeys(n.arg for root in uops for n in root.toposort if n.op is Ops.BUFFER))


def build_schedule(outputs: list[tuple[UOp, str]]) -> Schedule:
  uops = [u for u, _ in outputs]
  devices = [canonical_name(d) for _, d in outputs]
  key = (graph_key(uops), tuple(devices), pipeline.version)
  hit = _plans.get(key)
  # (REWRITE_STATS wants to see the pipeline's work, so statistics always run it)
  if hit is not None and not stats.active and all(r() is not None for r in hit[0]): return _instantiate(hit[1])
  plan = _plan(uops, devices)
  if len(_plans) >= MAX_PLANS:
    for k in [k for k, (refs, _) in _plans.items() if any(r() is None for r in refs)] or list(_plans)[:MAX_PLANS // 2]:
      del _plans[k]
  _plans[key] = ([weakref.ref(b) for b in input_buffers(uops)], plan)
  return _instantiate(plan)


def _instantiate(plan: _Plan) -> Schedule:
  real: dict[UOp, Buffer] = {}
  def buffer_of(b) -> Buffer:
    if not isinstance(b, UOp): return b()
    if b not in real: real[b] = Buffer(b.arg.device, b.arg.size, b.dtype)
    return real[b]
  return Schedule([Step(ck, [buffer_of(b) for b in bufs]) for ck, bufs in plan.steps],
                  [UOp(Ops.VIEW, dt, (UOp(Ops.BUFFER, dt, (), buffer_of(b)),), view) for dt, view, b in plan.outputs],
                  list(plan.explanations))


def _plan(uops: list[UOp], devices: list[str]) -> _Plan:
  run = Run(devices[0] if devices else "CPU")
  run.device_loops = bool(devices) and getattr(get_device(run.device).renderer, "device_loops", False)
  kernels, realized = schedule(uops, devices, run)
  def ref(b: UOp): return b if isinstance(b.arg, NewBuffer) else weakref.ref(b.arg)
  plan = _Plan([], [(u.dtype, u.arg, ref(u.src[0])) for u in realized],
               run.kernelize.explanations + (run.group.refused + run.group.merged if run.group else []) +
               (run.fuse.inlined if run.fuse else []))
  # new kernels are published to the caches only once all of them are built: a failure leaves no half-made entry
  new: dict[tuple, CompiledKernel] = {}
  new_by_name: dict[tuple, CompiledKernel] = {}
  pending: dict[str, list[CompiledKernel]] = {}
  for k in kernels:
    if k.op is Ops.COPY:
      plan.steps.append((None, [ref(k.src[0]), ref(k.src[1])]))
      continue
    norm, bufs = normalize(k)
    key = (norm, k.arg, pipeline.version)
    ck = _kernels.get(key) or new.get(key)
    if ck is None:
      ck = _compile(norm, bufs, k.arg)
      # two kernels that differ only in what the code never sees (the size of a buffer read in part, say) render
      # to one text: one compiled function serves both
      name_key = (ck.name, k.arg, pipeline.version)
      if (same := _by_name.get(name_key) or new_by_name.get(name_key)) is not None: ck = same
      else:
        new_by_name[name_key] = ck
        pending.setdefault(k.arg, []).append(ck)
      new[key] = ck
    plan.steps.append((ck, [ref(bufs[i]) for i in ck.args]))
  for device, cks in pending.items():
    dev = get_device(device)
    programs = dev.build(dev.renderer.source([ck.source for ck in cks]), [ck.name for ck in cks])
    for ck in cks: ck.program = programs[ck.name]
  if len(_kernels) + len(new) > MAX_KERNELS: _kernels.clear(); _by_name.clear()  # a program of ever-new shapes
  _kernels.update(new)
  _by_name.update(new_by_name)
  return plan


def run_schedule(sched: Schedule) -> float:
  dbg = debug_level()
  total = 0.0
  for step in sched.steps:
    if step.kernel is None:
      dst, src = step.buffers
      t0 = time.perf_counter()
      dst.copyin(src.numpy())
      dt = time.perf_counter() - t0
      if dbg >= 2: print(f"  copy {src.device} -> {dst.device}  {src.nbytes / 1e6:.1f} MB  {dt * 1e3:.3f} ms")
    else:
      ck = step.kernel
      dt = ck.program(*[b.handle for b in step.buffers], global_size=ck.global_size, local_size=ck.local_size,
                      wait=dbg >= 2) or 0.0
      if dbg >= 2:
        rate = f"{ck.flops / dt / 1e9:8.2f} GFLOP/s" if ck.flops > 4 * ck.bytes else f"{ck.bytes / dt / 1e9:8.2f} GB/s"
        print(f"  {ck.name:<40s} {dt * 1e3:9.3f} ms  {rate if dt > 0 else ''}")
      if dbg >= 3: print(ck.source)
    total += dt
  return total


def realize(outputs: list[tuple[UOp, str]]) -> list[UOp]:
  """Each output graph computed into a buffer of its device: the list of `VIEW(BUFFER)` forms, in order."""
  t0 = time.perf_counter()
  sched = build_schedule(outputs)
  if debug_level() >= 2:
    for line in sched.explanations: print(f"  {line}")
  run_schedule(sched)
  for dev in {ck.kernel.device for ck in sched.steps if ck.kernel is not None}: get_device(dev).synchronize()
  if debug_level() >= 1 and sched.steps:
    print(f"realize: {sum(s.kernel is not None for s in sched.steps)} kernels, {len(sched.steps)} steps, "
          f"{(time.perf_counter() - t0) * 1e3:.2f} ms")
  return sched.outputs
