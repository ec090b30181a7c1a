"""`Program`: the host program of one realize (rules/host.py's steps, planned), ready to run again and again.

It keeps no UOp of the user's graph and no buffer of the user's: existing buffers (inputs, assignment targets) are its
parameters, numbered in the order `run` takes them, so one program serves every call over new data of the same kind
and a cached program never keeps the user's memory alive; buffers the realize returns are made anew on every run;
intermediates live in storages (rules/host.py `Storage`) taken from the device's allocator at their first ALLOC and
given back at their last FREE.

`str(program)` is the listing (one line per step, buffer names and sizes), `peak_bytes` the most intermediate bytes
alive at once under the plan, `unplanned_bytes` what every intermediate in a buffer of its own would take.
"""
from __future__ import annotations
import time
from dataclasses import dataclass
from typing import Callable
import numpy as np
from rewrite import UOp, Ops, viz
from rules.host import Extern, nbytes
from rules.realize import NewBuffer
from .buffer import Buffer, human_bytes
from .device import canonical_name, get_device
from . import extern, pick


class Program:
  def __init__(self, host: UOp, kernels: dict[UOp, object], returned: list[UOp], outputs: list[tuple], params: list[UOp]):
    """host: the planned SINK of steps; kernels: normalized kernel -> CompiledKernel; returned: the BUFFERs the realize
    returns, in output order; outputs: (dtype, View, BUFFER) of each output's realized form; params: the existing
    BUFFERs it reads or writes, in the order `run` takes their Buffers."""
    index: dict[UOp, int] = {}
    # per buffer: ("param", its number, dtype, size, device) | ("new", device, size, dtype) | ("temp", None)
    names, self.table = [], []
    counts = {"in": 0, "out": 0, "t": 0}
    param_of = {b: i for i, b in enumerate(params)}

    def number(b: UOp) -> int:
      if b in index: return index[b]
      if not isinstance(b.arg, NewBuffer):
        if b not in param_of: raise ValueError(f"host program reads {b.arg!r}, which is not one of its parameters")
        kind, entry = "in", ("param", param_of[b], b.dtype, b.arg.size, b.arg.device)
      elif b in returned: kind, entry = "out", ("new", canonical_name(b.arg.device), b.arg.size, b.dtype)
      else: kind, entry = "t", ("temp", None)
      index[b] = len(names)
      names.append(f"{kind}{counts[kind]}"); counts[kind] += 1
      self.table.append(entry)
      return index[b]

    for _, _, b in outputs: number(b)
    self.steps: list[tuple] = []
    lines: list[str] = []
    storages: dict[object, int] = {}
    held = peak = unplanned = 0
    for step in host.src:
      idx = [number(b) for b in step.src]
      if step.op is Ops.ALLOC:
        b, s = step.src[0], step.arg
        unplanned += nbytes(b)
        new = s not in storages
        if new: storages[s] = len(storages); held += s.nbytes; peak = max(peak, held)
        self.steps.append(("alloc", idx[0], storages[s], s.device, s.nbytes))
        lines.append(f"alloc  {names[idx[0]]} {b.dtype.name}[{b.arg.size}] {human_bytes(nbytes(b))} in storage s{storages[s]}"
                     + ("" if new else " (reused)"))
      elif step.op is Ops.FREE:
        s = step.arg
        if s is not None: held -= s.nbytes
        self.steps.append(("free", idx[0], storages[s] if s is not None else -1))
        lines.append(f"free   {names[idx[0]]}" + (f" (storage s{storages[s]} back to {s.device})" if s is not None else ""))
      elif step.op is Ops.COPY:
        dst, src = step.src
        self.steps.append(("copy", idx[0], idx[1], nbytes(src), dst.arg.device, src.arg.device))
        lines.append(f"copy   {src.arg.device} -> {dst.arg.device}  {names[idx[0]]} <- {names[idx[1]]}  {human_bytes(nbytes(src))}")
      elif step.op is Ops.CALL:
        ck = kernels[step.arg]
        self.steps.append(("call", ck, [idx[i] for i in ck.args]))
        lines.append(f"call   {ck.name}  {self._io(names, idx, len(step.arg.src))}")
      elif step.op is Ops.EXTERN:
        ext: Extern = step.arg
        ck = kernels[ext.kernel]
        fn = extern.routine(ck.device, ext.name)
        # [choice]: None until the first run picks (or "extern" / "generated" when the plan says so)
        choice = ["extern" if not ext.pick else None]
        # the library call made once (None without the library), not on every run
        self.steps.append(("extern", ext, LibraryCall(ext, fn, ck) if fn is not None else None, ck, idx, choice))
        lines.append(f"extern {ext}  {self._io(names, idx, 1)}" +
                     (f"  or generated {ck.name}, the faster on first use" if ext.pick else ""))
      elif step.op is Ops.PICK:
        options = [(name, [(_callable(kernels, c), [idx[i] for i in at]) for c, at in calls]) for name, calls in step.arg.options]
        # a library the host stage saw but this process cannot load: its option is not among the candidates
        options = [o for o in options if all(not isinstance(ck, LibraryCall) or ck.fn is not None for ck, _ in o[1])]
        self.steps.append(("pick", options, [None, ()]))   # [name, its calls]: None until the first run picks
        (_, first), others = options[0], options[1:]
        written = len(step.arg.options[0][1][0][0].src)
        scratch = [names[i] for i in idx[len(first[0][1]):]]
        lines.append(f"pick   {first[0][0].name}  {self._io(names, idx[:len(first[0][1])], written)}" +
                     (f" (scratch {', '.join(scratch)})" if scratch else "") +
                     "".join(f"  or {name}: {' then '.join(ck.name for ck, _ in calls)}" for name, calls in others) +
                     ", the fastest on first use")
      else: raise ValueError(f"host program step {step.op} has no runtime meaning")
    self.storages = [(s.device, s.nbytes) for s in storages]
    self.outputs = [(dt, view, index[b]) for dt, view, b in outputs]
    self.names, self.peak_bytes, self.unplanned_bytes = names, peak, unplanned
    calls = sum(s[0] in ("call", "extern", "pick") for s in self.steps)
    head = f"host program: {len(self.steps)} steps, {calls} calls; intermediates peak {human_bytes(peak)} (unplanned {human_bytes(unplanned)})"
    ios = [f"{names[i]} {e[3].name}[{e[2]}]" if e[0] == "new" else f"{names[i]} {e[2].name}[{e[3]}]"
           for i, e in enumerate(self.table) if e[0] != "temp"]
    self.listing = "\n".join([head, "  buffers: " + ", ".join(ios)] + [f"  {ln}" for ln in lines])
    self.run_steps = teams(self.steps)   # what a run without per-kernel timing runs
    self.ran: list[str] = []  # what DEBUG=2 says about the last run's choices
    self.devices = frozenset(ck.device for ck in self.kernels_called())  # to wait for after each run
    self.explanations: list[str] = []  # the pipeline's decisions (DEBUG=2)
    self.key: tuple | None = None      # the plan cache's key (runtime/realize.py find_program), once cached

  def kernels_called(self) -> list:
    """The compiled kernel of each call (for a library call, the generated kernel it may run instead)."""
    called = []
    for s in self.steps:
      if s[0] == "call": called.append(s[1])
      elif s[0] == "extern": called.append(s[3])
      elif s[0] == "pick": called += [getattr(ck, "kernel", ck) for _, calls in s[1] for ck, _ in calls]
    return called

  @staticmethod
  def _io(names: list[str], idx: list[int], written: int) -> str:
    return f"{', '.join(names[i] for i in idx[:written])} <- {', '.join(names[i] for i in idx[written:]) or '(nothing)'}"

  def __str__(self) -> str: return self.listing
  def __repr__(self) -> str: return f"<Program {len(self.steps)} steps, peak {self.peak_bytes} B, unplanned {self.unplanned_bytes} B>"

  def run(self, inputs: list, debug: int = 0, step_seconds: list[float] | None = None) -> list[UOp]:
    """Run every step on `inputs` (a Buffer per parameter, in order, of the kinds the cache key matched:
    runtime/realize.py `graph_key`); the realized `VIEW(BUFFER)` of each output. With a `step_seconds` list, each step is waited
    for on its devices and its seconds appended (a kernel's as the device measures it, other steps' by the clock): their
    sum is the device's share of a run (benchmarks tell host time from kernel time by it)."""
    buffers, handles = self.bind(inputs)
    storage: list = [None] * len(self.storages)
    # kernel by kernel where each is timed (DEBUG=2, step_seconds, the viewer's recorder), else consecutive CPU kernels
    # in one parallel region
    steps = self.steps if debug >= 2 or step_seconds is not None or viz.recorder is not None else self.run_steps
    done = 0   # steps run to their end
    try:
      if step_seconds is None:
        for step in steps: self._step(step, handles, storage, debug); done += 1
      else:
        devices = [get_device(d) for d in sorted(self.devices)]
        for step in self.steps:
          for d in devices: d.synchronize()
          if step[0] == "call":   # the device's own clock: no launch overhead of the host's in a kernel's time
            step_seconds.append(_launch(step[1], [handles[i] for i in step[2]], wait=True) or 0.0); done += 1; continue
          t0 = time.perf_counter()
          self._step(step, handles, storage, debug)
          for d in devices: d.synchronize()
          step_seconds.append(time.perf_counter() - t0); done += 1
    except BaseException as e:
      # which of the memory it was given the run had written (in place: a parameter, an optimizer's state), for the
      # caller to say which of its tensors hold new values and which old ones
      ran = {self.table[i][1] for s in steps[:done] for i in self.step_buffers(s)[0] if self.table[i][0] == "param"}
      e.written_inputs = [inputs[j] for j in sorted(ran)]
      raise
    finally:
      for s, h in enumerate(storage):  # after a failure, what is still held goes back too
        if h is not None: get_device(self.storages[s][0]).allocator.free(h, self.storages[s][1])
    return self.results(buffers)

  @staticmethod
  def step_buffers(step: tuple) -> tuple[set[int], set[int]]:
    """(table entries written, entries read) of one step (a pick's: the option it took, else its first)."""
    if step[0] in ("alloc", "free"): return set(), set()
    if step[0] == "copy": return {step[1]}, {step[2]}
    calls = [(step[1], step[2])] if step[0] == "call" else step[2] if step[0] == "team" else \
            [(step[3], [step[4][i] for i in step[3].args])] if step[0] == "extern" else (step[2][1] or step[1][0][1])
    written, read = set(), set()
    for ck, idx in calls:
      ck = getattr(ck, "kernel", ck)
      if len(idx) != len(ck.args):   # a library call: its operands, the output first
        written.add(idx[0]); read |= set(idx[1:]); continue
      for slot, i in zip(ck.args, idx): (written if slot in ck.stored else read).add(i)
    return written, read

  def bind(self, inputs: list) -> tuple[list, list]:
    """Per table entry, the Buffer of a run (the input for a parameter, a new one for a returned buffer, None for an
    intermediate) and its device handle."""
    buffers: list = [None] * len(self.table)
    handles: list = [None] * len(self.table)
    for i, e in enumerate(self.table):
      if e[0] == "param": buffers[i] = inputs[e[1]]; handles[i] = buffers[i].handle
      elif e[0] == "new": buffers[i] = b = Buffer.allocated_now(e[1], e[2], e[3]); handles[i] = b._handle
    return buffers, handles

  def results(self, buffers: list) -> list[UOp]:
    """The realized `VIEW(BUFFER)` of each output, from a run's buffers."""
    return [UOp(Ops.VIEW, dt, (UOp(Ops.BUFFER, dt, (), buffers[i]),), view) for dt, view, i in self.outputs]

  def _step(self, step: tuple, handles: list, storage: list, debug: int) -> None:
    kind = step[0]
    if kind == "call":   # (the common step first)
      _, ck, idx = step
      _run_kernel(ck, [handles[i] for i in idx], debug)
    elif kind == "team":
      _, device, calls = step
      get_device(device).run_team([(ck.program, [handles[i] for i in idx]) for ck, idx in calls])
    elif kind == "alloc":
      _, i, s, device, size = step
      if storage[s] is None: storage[s] = get_device(device).allocator.alloc(size)
      handles[i] = storage[s]
    elif kind == "free":
      if (s := step[2]) >= 0:
        h, storage[s] = storage[s], None
        get_device(self.storages[s][0]).allocator.free(h, self.storages[s][1])
    elif kind == "copy":
      _, dst, src, size, dst_dev, src_dev = step
      t0 = time.perf_counter()
      tmp = np.empty(size, np.uint8)
      get_device(src_dev).allocator.copyout(memoryview(tmp), handles[src])
      get_device(dst_dev).allocator.copyin(handles[dst], memoryview(tmp))
      if debug >= 2: print(f"  copy {src_dev} -> {dst_dev}  {size / 1e6:.1f} MB  {(time.perf_counter() - t0) * 1e3:.3f} ms")
    elif kind == "pick":
      _, options, choice = step
      if choice[0] is None:
        name, why = self._pick_option(options, handles)
        choice[:] = [name, dict(options)[name]]
        self.ran.append(f"{' or '.join(name for name, _ in options)}: {name} ({why})")
      self._say_picks(debug)
      for ck, idx in choice[1]: _run_kernel(ck, [handles[i] for i in idx], debug)
    else:
      _, ext, lib, ck, idx, choice = step
      args = [handles[i] for i in idx]
      if choice[0] is None:
        choice[0], why = self._pick(ext, lib.fn if lib else None, ck, args)
        self.ran.append(f"{ext.name} or {ck.name}: {choice[0]} ({why})")
      elif lib is None: choice[0] = "generated"
      self._say_picks(debug)
      if choice[0] == "extern" and lib is not None: _run_kernel(lib, args, debug)
      else: _run_kernel(ck, [args[i] for i in ck.args], debug)

  def _say_picks(self, debug: int) -> None:
    """DEBUG=2: which implementation each pick made on this run ran, and why."""
    if debug >= 2 and self.ran: print("\n".join(f"  {r}" for r in self.ran)); self.ran.clear()

  @staticmethod
  def _pick(ext: Extern, fn, ck, args: list) -> tuple[str, str]:
    if fn is None: return "generated", "the library is not available here"
    dev = get_device(ck.device)
    key = (ext.name, ck.name, repr(ext.params), ck.device, getattr(dev, "device_name", ck.device))
    return pick.choose(key, {"extern": _timed(dev, lambda: fn(args, ext)),
                             "generated": _timed(dev, lambda: _launch(ck, [args[i] for i in ck.args]))})

  @staticmethod
  def _pick_option(options: list, handles: list) -> tuple[str, str]:
    """Time each option (its kernels in order, waited for) on the step's buffers; the fastest, remembered on disk."""
    dev = get_device(options[0][1][0][0].device)
    def run_all(calls) -> None:
      for ck, idx in calls: _launch(ck, [handles[i] for i in idx])
    key = ("variants", *(f"{name}: {' '.join(ck.name for ck, _ in calls)}" for name, calls in options),
           getattr(dev, "device_name", dev.name))
    return pick.choose(key, {name: _timed(dev, lambda calls=calls: run_all(calls)) for name, calls in options})


def teams(steps: list[tuple]) -> list[tuple]:
  """The steps as a run without per-kernel timing takes them: each stretch of two or more calls of kernels that a team
  of threads can share (a CPU kernel with a NAME_team function, renderers/c.py), with nothing but allocs and frees
  between them, becomes one ("team", device, calls) step, its allocs moved before it and its frees after (a storage's
  memory is taken a little earlier and given back a little later; no two buffers of one storage overlap more than
  before: a buffer's storage is the same whenever it is taken)."""
  out: list[tuple] = []
  stretch: list[tuple] = []   # the steps since the stretch's first call
  def close() -> None:
    calls = [(s[1], s[2]) for s in stretch if s[0] == "call"]
    if len(calls) < 2: out.extend(stretch)
    else:
      out.extend(s for s in stretch if s[0] == "alloc")
      out.append(("team", calls[0][0].device, calls))
      out.extend(s for s in stretch if s[0] == "free")
    stretch.clear()
  for step in steps:
    if step[0] == "call" and getattr(step[1].program, "teamed", False) or stretch and step[0] in ("alloc", "free"):
      stretch.append(step)
    else:
      close(); out.append(step)
  close()
  return out


@dataclass(frozen=True)
class LibraryCall:
  """A library routine as one call of a PICK option: run like a kernel on the handles of its slots (the step's
  buffers the Extern's operands index); `kernel` is the generated kernel it stands in for (its device)."""
  ext: Extern
  fn: Callable
  kernel: object

  @property
  def name(self) -> str: return str(self.ext)


def _callable(kernels: dict, c) -> object:
  """What a PICK option's call runs: the compiled kernel, or a library call for an Extern."""
  if not isinstance(c, Extern): return kernels[c]
  ck = kernels[c.kernel]
  return LibraryCall(c, extern.routine(ck.device, c.name), ck)


def _timed(dev, run: Callable[[], None]) -> Callable[[], float]:
  """A candidate for pick.choose: seconds of one run, waited for on the device."""
  def timed() -> float:
    t0 = time.perf_counter(); run(); dev.synchronize()
    return time.perf_counter() - t0
  return timed


def _launch(ck, handles: list, wait: bool = False) -> float | None:
  if isinstance(ck, LibraryCall):
    ck.fn(handles, ck.ext)
    if wait: get_device(ck.kernel.device).synchronize()
    return None
  return ck.program(*handles, global_size=ck.global_size, local_size=ck.local_size, wait=wait)


def _run_kernel(ck, handles: list, debug: int) -> None:
  if isinstance(ck, LibraryCall):
    t0 = time.perf_counter()
    _launch(ck, handles, wait=debug >= 2)
    if debug >= 2:
      dt = time.perf_counter() - t0
      print(f"  extern {ck.ext.name} via {ck.fn.library:<27s} {dt * 1e3:9.3f} ms  {ck.ext.flops / dt / 1e9:8.2f} GFLOP/s")
    return
  dt = _launch(ck, handles, wait=debug >= 2 or viz.recorder is not None) or 0.0
  if viz.recorder is not None: viz.kernel_time(ck.name, dt)   # for the viewer's page
  if debug >= 2:
    rate = f"{ck.flops / dt / 1e9:8.2f} GFLOP/s" if ck.flops > 4 * ck.bytes else f"{ck.bytes / dt / 1e9:8.2f} GB/s"
    print(f"  {ck.name:<40s} {dt * 1e3:9.3f} ms  {rate if dt > 0 else ''}  plan {ck.plan}")
  if debug >= 3: print(ck.source)
