"""A host program replayed through CUDA graphs: what `jit` runs on a GPU once its program has run (its picks made).

`replayer(program)` returns an object with the program's `run(inputs) -> outputs`: a `GraphReplay` when every kernel
of the program is a CUDA kernel (and the environment allows it), else the program itself. A GraphReplay

- takes the program's intermediate storages once and keeps them (a graph's launches name fixed addresses): a replayed
  program holds its intermediates' peak memory (`program.peak_bytes`) between calls, as a captured function should;
  they go back to the allocator's pool when the replay is garbage (`jit`'s `reset()`, or the jit itself dropped);
- records each run of consecutive kernel calls as one `CUDAGraph` (a library call, a pick that chose one, a copy between
  devices, is a host step between two graphs, run as the program runs it);
- on each run, binds the new inputs and outputs and changes the arguments of only the launches that read or write
  them, where their addresses moved.
`GRAFT_CUDA_GRAPH=0` replays launch by launch instead (for measuring what graphs save).
"""
from __future__ import annotations
from rewrite.env import env_flag
from .device import get_device
from .program import Program, LibraryCall


def replayer(program: Program):
  """`program`, or a GraphReplay of it on a GPU (see the module docstring). Call after the program has run once."""
  if program.devices != frozenset({"CUDA"}) or not env_flag("GRAFT_CUDA_GRAPH", True, "replay jit programs through CUDA graphs"):
    return program
  if any(s[0] == "pick" and s[2][0] is None or s[0] == "extern" and s[5][0] is None for s in program.steps):
    return program   # a choice the first run makes is not made yet
  return GraphReplay(program)


class GraphReplay:
  def __init__(self, program: Program):
    self.program = program
    self.allocator = get_device("CUDA").allocator
    self.storage = [self.allocator.alloc(n) for _, n in program.storages]
    # the intermediates' addresses, fixed now; inputs and outputs are bound per run
    self.fixed = {s[1]: self.storage[s[2]] for s in program.steps if s[0] == "alloc"}
    self.varying = frozenset(i for i, e in enumerate(program.table) if e[0] in ("param", "new"))
    self.parts: list | None = None   # recorded at the first run, on its addresses

  def run(self, inputs: list) -> list:
    buffers, handles = self.program.bind(inputs)
    for i, h in self.fixed.items(): handles[i] = h
    if self.parts is None: self.parts = self._record(handles)
    for part in self.parts: part.run(handles)
    return self.program.results(buffers)

  def _record(self, handles: list) -> list:
    """The program's steps as graphs of consecutive kernel calls and host steps between them."""
    parts: list = []
    calls: list[tuple] = []   # (compiled kernel, table indices of its arguments) since the last host step
    def close_graph() -> None:
      if calls: parts.append(_Graph(calls[:], handles, self.varying)); calls.clear()
    for step in self.program.steps:
      kind = step[0]
      if kind in ("alloc", "free"): continue   # the storages stay, for the next run
      if kind == "call": calls.append((step[1], step[2]))
      elif kind == "pick" and not any(isinstance(ck, LibraryCall) for ck, _ in step[2][1]): calls.extend(step[2][1])
      elif kind == "extern" and step[5][0] == "generated": calls.append((step[3], [step[4][i] for i in step[3].args]))
      else: close_graph(); parts.append(_HostStep(self.program, step))
    close_graph()
    return parts

  def __del__(self):
    for (_, n), h in zip(self.program.storages, getattr(self, "storage", [])): self.allocator.free(h, n)


class _HostStep:
  """A step the host runs between graphs (a library call, a copy between devices)."""
  def __init__(self, program: Program, step: tuple): self.program, self.step = program, step
  def run(self, handles: list) -> None: self.program._step(self.step, handles, [], 0)


class _Graph:
  """Consecutive kernel calls as one CUDA graph; the launches that read or write an input or output are watched, and
  their arguments changed before a launch of the graph where those addresses moved."""
  def __init__(self, calls: list[tuple], handles: list, varying: frozenset):
    from .cuda import CUDAGraph
    self.graph = CUDAGraph(get_device("CUDA"), [(ck.program, [handles[i] for i in idx], ck.global_size, ck.local_size)
                                                for ck, idx in calls])
    self.watched = [(n, idx) for n, (_, idx) in enumerate(calls) if varying.intersection(idx)]
    self.last = {n: [handles[i] for i in idx] for n, idx in self.watched}

  def run(self, handles: list) -> None:
    for n, idx in self.watched:
      if (args := [handles[i] for i in idx]) != self.last[n]: self.graph.set_args(n, args); self.last[n] = args
    self.graph.launch()
