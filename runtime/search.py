"""Choosing a kernel's optimization plan at run time: the disk cache, the search, or the heuristic.

`lower_planned(norm, buffers, device, run)` lowers a normalized kernel through the pipeline with the plan that:
1. the plan cache holds for it: `$GRAFT_CACHE_DIR/plans/<key>.json`, keyed by the kernel (its normalized graph),
   the device, the pipeline version, this module's version and the machine (CPU model and flags): origin "cache";
2. else, with `GRAFT_SEARCH=N`, a beam search finds: it starts from the heuristic's plan, and each round changes one
   record of each of the N best plans so far (an unroll amount, one record fewer, a loop moved outward, a packed
   operand, a tile, a tile of rows padded to fit) and compiles and times every new candidate on fresh buffers of
   the kernel's sizes holding random values, until a round finds nothing
   faster or `GRAFT_SEARCH_SECONDS` (default 20) are spent on the kernel; the winner is written to the cache:
   origin "search";
3. else the heuristic (rules/opt/heuristic.py) picks: origin "heuristic".
A plan that fails to apply or to compile is skipped by the search; a cached plan that no longer fits is ignored.
The search says how it goes on stderr (runtime/progress.py): a live line on a terminal, a line per round at DEBUG=1.
"""
from __future__ import annotations
import hashlib, json, time
import numpy as np
from rewrite import UOp, Ops, viz
from rewrite.env import env_number
from rules.pipeline import lower_kernel, Run, pipeline
from rules.gpu import MULTIPROCESSORS
from rules.opt import Opt, OptKind, Plan, OptContext, InvalidPlan, check_plan
from .buffer import Buffer, _np_dtype
from .device import get_device, device_arch, CompileError
from . import cache
from .progress import Progress

VERSION = 1   # bump when a plan's meaning changes: cached plans of another version are not read


def search_width() -> int:
  return env_number("GRAFT_SEARCH", 0, "a beam width (0: no search)")


def plan_key(norm: UOp, device: str, device_loops: bool = False) -> str:
  from .cpu import machine_identity
  h = hashlib.sha256()
  gpu = _gpu_identity(device) if device_loops else ""
  for part in (str(VERSION), device, gpu, str(pipeline.version), machine_identity(), norm.pretty()): h.update(part.encode() + b"\0")
  return h.hexdigest()


def _gpu_identity(device: str) -> str:
  """The GPU a plan was timed on (its architecture and SM count): another GPU searches again."""
  try: dev = get_device(device)
  except RuntimeError: return "no device"
  return f"{getattr(dev, 'arch', '')} {getattr(dev, 'multiprocessor_count', '')}"


def _plan_path(key: str):
  d = cache.cache_dir()
  return None if d is None else d / "plans" / f"{key}.json"


def load_plan(key: str) -> tuple[Opt, ...] | None:
  path = _plan_path(key)
  try: return tuple(Opt(OptKind(k), a, n) for k, a, n in json.loads(path.read_text())["opts"]) if path else None
  except (OSError, ValueError, KeyError, TypeError): return None


def save_plan(key: str, opts: tuple[Opt, ...]) -> None:
  if (path := _plan_path(key)) is None: return
  # like every cache entry: private 0700 folders, written whole or not at all (runtime/cache.py)
  if cache._dir_problem(path.parent) is None:
    cache._write_atomic(path, json.dumps({"opts": [(o.kind.value, o.axis, o.amount) for o in opts]}).encode())


def given(plan: Plan):
  def choose(sink: UOp, axes: list[UOp]) -> Plan: return plan
  return choose


def lower_with(norm: UOp, device: str, device_loops: bool, plan: Plan | None, multiprocessors: int | None = None) -> tuple[UOp, OptContext]:
  run = Run(device, parallel=not device_loops, device_loops=device_loops, multiprocessors=multiprocessors or MULTIPROCESSORS,
            arch=device_arch(device, Run.arch) if device_loops else Run.arch)
  run.opt = OptContext(device_loops=device_loops, choose=given(plan) if plan is not None else None, multiprocessors=run.multiprocessors)
  return lower_kernel(norm, run), run.opt


def lower_planned(norm: UOp, buffers: list[UOp], device: str, run: Run) -> UOp:
  """The kernel's linear form, lowered with the plan from the cache, the search or the heuristic (see above), on a
  CPU or a GPU (of run.multiprocessors SMs)."""
  def context(plan: Plan | None = None) -> OptContext:
    return OptContext(device_loops=run.device_loops, heuristic=run.device_loops or run.parallel,
                      choose=given(plan) if plan else None, multiprocessors=run.multiprocessors)
  key = plan_key(norm, device, run.device_loops)
  if (opts := load_plan(key)) is not None:
    run.opt = context(Plan(opts, "cache"))
    try: return lower_kernel(norm, run)
    except Exception as e:
      if not isinstance(getattr(e, "__cause__", None), InvalidPlan) and not isinstance(e, InvalidPlan): raise
  run.opt = context()
  if (width := search_width()) == 0: return lower_kernel(norm, run)
  with viz.paused():   # the heuristic's lowering and every candidate's: a viewer shows the winner's only
    lower_kernel(norm, run)
    best = search(norm, buffers, device, run.opt, width, run.device_loops)
  save_plan(key, best.opts)
  run.opt = context(Plan(best.opts, "search"))
  return lower_kernel(norm, run)


# ---------------------------------------------------------------- the search

def time_plan(norm: UOp, buffers: list[UOp], device: str, plan: Plan, repeats: int = 3, device_loops: bool = False,
              multiprocessors: int | None = None) -> float:
  """Seconds one call of the kernel takes with `plan` (the best of `repeats`), on fresh buffers of its sizes."""
  return time_source(*plan_source(norm, device, plan, device_loops, multiprocessors), buffers, device, repeats, device_loops)


def plan_source(norm: UOp, device: str, plan: Plan, device_loops: bool = False, multiprocessors: int | None = None) -> tuple[str, str, UOp]:
  """(name, source, linear kernel) of the kernel lowered with `plan`: what `time_source` builds and times."""
  linear, _ = lower_with(norm, device, device_loops, plan, multiprocessors)
  dev = get_device(device)
  name = f"search_{hashlib.sha1(repr(plan.opts).encode()).hexdigest()[:8]}"
  return name, dev.renderer.source([dev.renderer.render(name, linear)]), linear


def time_source(name: str, source: str, linear: UOp, buffers: list[UOp], device: str, repeats: int = 3, device_loops: bool = False) -> float:
  """Seconds one call of a `plan_source` kernel takes (the best of `repeats`), on fresh buffers of its sizes."""
  from rules.gpu import launch_dims
  dev = get_device(device)
  prog = dev.build(source, [name])[name]
  args = sorted(u.arg for u in linear.src if u.op is Ops.DEFINE_GLOBAL)
  bufs = [test_buffer(device, buffers[i].arg.size, buffers[i].dtype) for i in args]
  handles = [b.handle for b in bufs]
  dims = launch_dims(linear) if device_loops else None
  launch = {"global_size": dims[0], "local_size": dims[1]} if dims else {}
  prog(*handles, **launch, wait=True)   # first touch of the memory
  return min(prog(*handles, **launch, wait=True) for _ in range(repeats))


def test_buffer(device: str, size: int, dtype) -> Buffer:
  """A buffer of the kernel's size holding normal random values: memory left as it came may hold denormal floats,
  whose arithmetic is many times slower, and the search would time those."""
  np_dtype = _np_dtype(dtype)
  values = np.random.default_rng(0).standard_normal(size).astype(np_dtype) if dtype.is_float else np.zeros(size, np_dtype)
  return Buffer(device, size, dtype).copyin(values)


def neighbours(plan: Plan, sizes: list[int], kinds: list[str]) -> list[Plan]:
  """Plans one change away from `plan`."""
  out = []
  opts = plan.opts
  for i, o in enumerate(opts):
    out.append(opts[:i] + opts[i + 1:])                                  # one record fewer
    if o.kind is OptKind.UPCAST:   # another unroll amount (a pad of its loop follows it: the tile still fits)
      for n in (2, 3, 4, 6, 8):
        if n != o.amount:
          out.append(tuple(Opt(p.kind, p.axis, n) if p is o or (p.kind is OptKind.PAD and p.axis == o.axis) else p for p in opts))
  outs = [a for a, k in enumerate(kinds) if k == "out"]
  for a in outs:
    for kind in (OptKind.INTERCHANGE, OptKind.PACK):
      if not any(o.kind is kind and o.axis == a for o in opts): out.append(opts + (Opt(kind, a),))
    for n in (2, 3, 4, 6, 8):   # a tile of rows, the loop padded to a multiple of it when it does not divide it
      if not any(o.axis == a and o.kind is OptKind.UPCAST for o in opts):
        out.append(opts + ((Opt(OptKind.PAD, a, n),) if sizes[a] % n else ()) + (Opt(OptKind.UPCAST, a, n),))
    for n in (16, 32, 64, 128):
      out.append(opts + (Opt(OptKind.SPLIT, a, n),))
  seen, plans = set(), []
  for p in out:
    if p not in seen: seen.add(p); plans.append(Plan(p, "search"))
  return plans


def search(norm: UOp, buffers: list[UOp], device: str, heuristic: OptContext, width: int, device_loops: bool = False) -> Plan:
  axes = sorted(heuristic.axis_of, key=heuristic.axis_of.get)
  sizes, kinds = [r.src[0].arg for r in axes], [r.arg[0] for r in axes]
  seconds = env_number("GRAFT_SEARCH_SECONDS", 20.0, "the seconds a search may spend on a kernel", kind=float)
  start = time.perf_counter()
  budget = start + seconds
  timed: dict[tuple, float] = {}
  def measure(p: Plan) -> float:
    if p.opts not in timed:
      try:
        check_plan(p, axes, device_loops)
        timed[p.opts] = time_plan(norm, buffers, device, p, device_loops=device_loops, multiprocessors=heuristic.multiprocessors)
      except (InvalidPlan, CompileError, ValueError, TypeError, NotImplementedError): timed[p.opts] = float("inf")
      except Exception as e:
        if not isinstance(e.__cause__, (InvalidPlan, ValueError, TypeError, NotImplementedError)): raise
        timed[p.opts] = float("inf")
    return timed[p.opts]
  beam = [heuristic.plan]
  best = min(beam, key=measure)
  with Progress(f"plan search {'x'.join(map(str, sizes))}") as progress:
    def news(rounds: int) -> str:
      return (f"round {rounds}, best {min(timed.values()) * 1e3:.3f} ms (heuristic {timed[heuristic.plan.opts] * 1e3:.3f} "
              f"ms), {len(timed)} plans timed, {time.perf_counter() - start:.1f} of {seconds:g} s")
    rounds = 0
    while time.perf_counter() < budget:
      rounds += 1
      near = gpu_neighbours if device_loops else neighbours
      candidates = [c for p in beam for c in near(p, sizes, kinds) if c.opts not in timed]
      for c in candidates:
        if time.perf_counter() > budget: break
        measure(c)
        progress.show(news(rounds))
      beam = [Plan(o, "search") for o in sorted(timed, key=timed.get)[:width]]
      improved = timed[beam[0].opts] < timed[best.opts]
      if improved: best = beam[0]
      progress.line(news(rounds) + ("" if improved else ": no better plan, done"))
      if not improved: break
    if rounds == 0: progress.line(f"the budget ({seconds:g} s) went on timing the heuristic's plan: {timed[best.opts] * 1e3:.3f} ms")
  return Plan(best.opts, "search")


def gpu_neighbours(plan: Plan, sizes: list[int], kinds: list[str]) -> list[Plan]:
  """A GPU plan's neighbours: another amount for one of its records (lanes, rows per thread, a tile's registers or
  lanes, the slice of a reduction staged at once, the blocks grouped for L2), or one record fewer. Invalid ones are
  refused by the check and skipped."""
  out = []
  opts = plan.opts
  for i, o in enumerate(opts):
    if o.kind is not OptKind.GLOBAL or o.axis < 0: out.append(opts[:i] + opts[i + 1:])
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256):
      if n != o.amount and (o.kind in (OptKind.LOCAL, OptKind.GROUP, OptKind.UPCAST, OptKind.SPLIT) or (o.kind is OptKind.GLOBAL and o.amount)):
        out.append(tuple(Opt(p.kind, p.axis, n) if p is o else p for p in opts))
  # every lane record of a rows plan carries the same lanes: change them together
  lanes = [o for o in opts if o.kind in (OptKind.LOCAL, OptKind.GROUP) and o.axis >= 0]
  if lanes and not any(o.kind in (OptKind.SPLIT, OptKind.PACK) for o in opts):
    for n in (32, 64, 128, 256, 512, 1024):
      out.append(tuple(Opt(p.kind, p.axis, n) if p in lanes else p for p in opts))
  # a rows plan's runs of 4 floats (rules/gpu.py vector(-1, 4)) are one record fewer above; where it has none, one more
  if lanes and not any(o.kind in (OptKind.SPLIT, OptKind.PACK, OptKind.VECTOR) for o in opts): out.append(opts + (Opt(OptKind.VECTOR, -1, 4),))
  seen, plans = set(), []
  for p in out:
    if p not in seen: seen.add(p); plans.append(Plan(p, "search"))
  return plans
