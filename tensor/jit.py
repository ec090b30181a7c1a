"""`jit`: a function of tensors whose work is recorded once and replayed, without building its graph.

  from tensor import jit
  @jit
  def forward(x): return model(x)
  forward(x1)   # call 1: runs as usual (the graph is built, compiled, run), and what it runs is recorded
  forward(x2)   # call 2: the same; it ran the same work as call 1, so that work is captured
  forward(x3)   # call 3 on: the captured programs run on x3's memory; fn is not called at all

A training step is such a function: its updates are written in place (`assign`, an optimizer's `step()`), and a
replay writes them again, into the same memory, on each call:

  @jit
  def train_step(ids, targets):
    loss = model.loss(ids, targets)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
  for ids, targets in batches: loss = train_step(ids, targets)   # Tensors: new token ids each call

What a call runs is a sequence of realizes (host programs, runtime/realize.py) and of old versions kept for lazy
readers (runtime/capture.py); each Buffer they read or write is an argument's, one made earlier in the call, or one
that exists outside the call: the function's state (weights, an optimizer's moments and step counters, the learning
rate), bound by identity and updated in place by the replay. Each call is recorded until two calls in a row ran the
same work (the same programs on buffers of the same roles); the second of them is captured. What a replay does:
  - runs the recorded programs on the new arguments' memory and the state's memory (which the programs update);
  - returns the function's results as new tensors (new memory), realized;
  - sets the `.grad` of each tensor whose gradient the function changed to a new tensor of this call's gradient (a
    gradient the function leaves lazy is realized by the call, so that it is there to read).

What may not change between calls (the captured work is that of the capturing call, fixed):
  - Tensor arguments are matched by position, shape, dtype and device: other shapes or dtypes capture another program
    (a signature of its own, up to `MAX_CAPTURES`; past that an error says so) rather than replaying a wrong one.
    Which arguments are the same tensor is part of the signature too (f(a, a) is not f(a, b)).
  - Other arguments (ints, floats, strings, tuples of them) are part of the signature: another value is another
    capture. Python values the function reads from elsewhere (globals, closures, attributes) are constants of its
    programs: one that changes between calls (a learning rate as a Python float, a step count) makes two calls run
    different programs, and after `MAX_TRIES` such pairs the call is a JitError naming the difference. Keep such
    values in tensors updated in place (`opt.lr = x` does; Adam's bias corrections are tensors). A float that changes
    after the capture is seen where the function's own code names it (a global, a closure's variable, an attribute
    of one of those or of `self`: `sched.lr`): the call records again (`python_numbers`); one reached through other
    calls is not.
  - Tensors the function reads that are not its arguments are bound to their memory: to change one between calls,
    update it in place (`assign`), or pass it as an argument, or call `.reset()`. A tensor the function replaces
    rather than updates (`state = state + 1`, a `.grad` accumulated across calls without `zero_grad()`, a tensor made
    from numpy inside the function) is a different buffer on each call: also a JitError.
  - Python work is not replayed: side effects of the function (appending to a list, counting calls) happen on
    the recorded calls only, and reading values into Python inside it (`.numpy()`, `.item()`) is a JitError, since
    a replay could not act on them. A realized tensor the function keeps (in an attribute, a list) is re-pointed
    to each replay's values; a lazy one it keeps is that of the capturing call.
  - The result is a Tensor, or a tuple or list of Tensors.
On a GPU the replay launches the programs' kernels as CUDA graphs (runtime/replay.py): one driver call per run of
kernels instead of one per kernel; the captured programs then keep their intermediates' memory between calls.
A jit function is called from one thread at a time (its table of captures is its own). Tensor arguments that are lazy
are realized first; an argument that is not a Tensor, a Python scalar, string, None or a tuple of those is an error
(it could not be compared between calls). A jit function called while another one records runs as a plain function.
"""
from __future__ import annotations
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable
from runtime import capture

MAX_CAPTURES = 16   # signatures captured per function; a function called with ever new shapes is an error past this
MAX_TRIES = 3       # pairs of consecutive calls that may differ before a capture (work set up on a first call)


class JitError(TypeError):
  """A jit function called in a way its captured program cannot serve (or cannot be compared)."""


# Where a replay finds a Buffer of the recorded call: ("arg", i) the i-th tensor argument's; ("value", i) the i-th
# made during the call (each realize's results and each kept old version, in order); ("grad", weakref to a tensor)
# that tensor's .grad as the call finds it (a gradient accumulated across calls); ("held", Buffer) state.
Binding = tuple


@dataclass
class _Realize:
  program: Any
  inputs: list[Binding]
  runner: Any = None   # the program, or on a GPU its replay through CUDA graphs (made when captured)


@dataclass
class _Trace:
  """What one call ran, every Buffer described by where a replay finds it."""
  steps: list                # ("realize", _Realize); ("split", Binding, value number): a copy of that buffer's
                             # contents (("unread",) where nothing reads it); ("guard", flag Binding, subject
                             # Binding, error): runtime/capture.py's check, again
  results: list[tuple]                          # (Binding, View, shape, device) per result
  shape: str                                    # "one", "tuple" or "list": how the results are returned
  grads: list[tuple]                            # (weakref to a tensor, its new .grad as a result tuple, or None)
  kept: list[tuple]                             # (Binding, [(weakref to a tensor, the View it reads)]) re-pointed
  released: list                                # weakrefs to the tensors whose old .grad a replay lets go of first
  made: weakref.WeakSet = field(default_factory=weakref.WeakSet)   # the Buffers the call made (for messages)
  watched: list = field(default_factory=list)   # (reader, value at the call): Python floats it reads (python_numbers)


class Jit:
  def __init__(self, fn: Callable):
    self.fn = fn
    self.__name__ = getattr(fn, "__name__", "jit")
    self.__doc__ = getattr(fn, "__doc__", None)
    self.seen: dict[tuple, tuple[int, _Trace]] = {}   # signature -> (calls that differed, the latest call's trace)
    self.captures: dict[tuple, _Trace] = {}

  def reset(self) -> None:
    """Forget every capture: the next calls run as usual until two in a row run the same work."""
    self.seen.clear(); self.captures.clear()

  def __call__(self, *args, **kwargs):
    from .tensor import Tensor
    from .assign import is_view
    if capture.active() is not None: return self.fn(*args, **kwargs)   # inside another's recording: its work
    def own(v):   # a view of another tensor's memory is passed as a copy of its own: what a capture binds is its buffer
      if isinstance(v, Tensor): return v.contiguous().realize() if is_view(v) else v
      return tuple(own(x) for x in v) if isinstance(v, tuple) else v
    args, kwargs = own(args), {k: own(v) for k, v in kwargs.items()}
    tensors: list[Tensor] = []
    def signature_of(v):
      if isinstance(v, Tensor):
        tensors.append(v.realize())
        return ("tensor", v.shape, v.dtype, v.device)
      if v is None or isinstance(v, (bool, int, float, str)): return (type(v), v)
      if isinstance(v, tuple): return ("tuple", tuple(signature_of(x) for x in v))
      raise JitError(f"jit {self.__name__}: an argument of type {type(v).__name__} cannot be compared between calls; "
                     f"pass Tensors, Python scalars, strings or tuples of them")
    sig = (tuple(signature_of(a) for a in args), tuple((k, signature_of(v)) for k, v in sorted(kwargs.items())))
    buffers = [t.uop.src[0].arg for t in tensors]
    sig += (tuple(next(j for j, b in enumerate(buffers) if b is buf) for buf in buffers),)  # which are the same
    if (trace := self.captures.get(sig)) is not None:
      if all(read() == value for read, value in trace.watched): return _replay(trace, buffers)
      del self.captures[sig]   # a Python number its programs were built with changed: recorded again (two calls)
    if sig not in self.seen and (known := len(self.seen) + len(self.captures)) >= MAX_CAPTURES:
      raise JitError(f"jit {self.__name__}: called with {known + 1} different signatures (shapes, dtypes, "
                     f"devices or Python values of its arguments); at most {MAX_CAPTURES} are captured. Call it with "
                     f"fewer kinds of arguments, or call .reset()")
    result, trace = self._record(args, kwargs, buffers)
    tries, last = self.seen.get(sig, (0, None))
    if last is not None:
      if (difference := _difference(last, trace)) is None:
        del self.seen[sig]
        self.captures[sig] = trace
        for step in trace.steps:
          if step[0] == "realize": step[1].runner = _runner(step[1].program)
        return result
      if tries + 1 >= MAX_TRIES:
        raise JitError(f"jit {self.__name__}: {MAX_TRIES + 1} calls in a row, each ran other work than the call before "
                       f"(the last two: {difference}), so there is nothing fixed to capture. {_ADVICE}")
      tries += 1
    self.seen[sig] = (tries, trace)
    return result

  def _record(self, args, kwargs, buffers: list) -> tuple[Any, _Trace]:
    """Call the function, recording what it runs; its results and the gradients it changed are realized."""
    from .tensor import Tensor
    from .autograd import requiring
    def refuse(what: str):
      raise JitError(f"jit {self.__name__}: the function reads tensor values into Python ({what}): a replay runs "
                     f"only the recorded programs and could not act on them. Return the tensor and read it outside")
    # each .grad before the call, held weakly (a zero_grad() inside lets the old gradients go, as without jit), and
    # its memory, which the call reads when it adds to the gradient (the recording then holds that Buffer)
    grads_before = {id(p): (p, None if p.grad is None else weakref.ref(p.grad),
                            weakref.ref(p.grad.uop.src[0].arg) if p.grad is not None and p.grad.is_realized else None)
                    for p in requiring()}
    def changed_grad(p) -> bool:
      _, old, _ = grads_before.get(id(p), (p, None, None))
      return p.grad is not None if old is None else (g := old()) is None or p.grad is not g
    watched = [(read, read()) for read in python_numbers(self.fn)]
    with capture.recording(on_read=refuse) as rec:
      result = self.fn(*args, **kwargs)
      shape = "one" if isinstance(result, Tensor) else "tuple" if isinstance(result, tuple) else "list" if isinstance(result, list) else None
      outs = [result] if shape == "one" else list(result) if shape else []
      if shape is None or not all(isinstance(t, Tensor) for t in outs):
        raise JitError(f"jit {self.__name__}: the function must return a Tensor or a tuple or list of Tensors, not {type(result).__name__}")
      changed = [(p, p.grad) for p in requiring() if changed_grad(p)]
      Tensor.realize_all(*outs, *(g for _, g in changed if g is not None))
    trace = _describe(rec, buffers, outs, shape, changed, grads_before)
    trace.watched = watched
    return result, trace


def python_numbers(fn: Callable) -> list[Callable[[], Any]]:
  """A reader of each Python float that `fn`'s own code names: a global, a variable of its closure, or an attribute
  it reads of one of those objects or of a bound method's `self` (`sched.lr`, `self.lr`). A replay compares them with
  the values the capturing call saw: a learning-rate schedule kept as a plain float attribute is a constant of the
  captured programs, and its change must not be replayed as the old value. (Floats the function reaches through
  other calls, or in containers, are not seen: keep those in tensors.)"""
  import types
  func, owner = (fn.__func__, fn.__self__) if isinstance(fn, types.MethodType) else (fn, None)
  code = getattr(func, "__code__", None)
  if code is None: return []
  names, stack = set(), [code]
  while stack:   # the names of its code and of the code nested in it (comprehensions, inner functions)
    c = stack.pop()
    names |= set(c.co_names)
    stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
  def attributes(obj) -> list[Callable[[], Any]]:
    if isinstance(obj, (types.ModuleType, types.FunctionType, types.MethodType, type)): return []
    own = getattr(obj, "__dict__", None)
    return [(lambda o=own, n=n: o.get(n)) for n in names if isinstance(own, dict) and isinstance(own.get(n), float)]
  readers = attributes(owner) if owner is not None else []
  scope = getattr(func, "__globals__", {})
  for n in names & scope.keys():
    value = scope[n]
    readers += [lambda n=n: scope.get(n)] if isinstance(value, float) else attributes(value)
  for name, cell in zip(code.co_freevars, getattr(func, "__closure__", None) or ()):
    try: value = cell.cell_contents
    except ValueError: continue   # (not assigned yet)
    readers += [lambda cell=cell: cell.cell_contents] if isinstance(value, float) else attributes(value)
  return readers


_ADVICE = ("A Python value the function reads that changes between calls (a number, a step count) is a constant of "
           "its programs: keep it in a tensor updated in place (t.assign(...)), or pass it as an argument; a tensor it "
           "replaces rather than updates in place is another buffer on each call: use assign, or zero_grad() before "
           "backward() inside the function")


def _describe(rec: capture.Recording, buffers: list, outs: list, shape: str, changed: list, grads_before: dict) -> _Trace:
  from .assign import _viewers
  where: dict[int, Binding] = {}   # id(Buffer) -> its binding (the recording keeps every Buffer of it alive)
  for j, b in enumerate(buffers): where.setdefault(id(b), ("arg", j))
  for p, _, memory in grads_before.values():
    if memory is not None and (b := memory()) is not None: where.setdefault(id(b), ("grad", weakref.ref(p)))
  def bind(b) -> Binding: return where.get(id(b)) or ("held", b.current())
  steps, made, n = [], weakref.WeakSet(), 0
  for event in rec.events:
    if event[0] == "guard":
      steps.append(("guard", bind(event[1]), bind(event[2]), event[3]))
      continue
    if event[0] == "split":   # old keeps a copy (a value of the call), new goes on as the memory old was
      _, old, new = event
      was = bind(old)
      steps.append(("split", was, n))
      where[id(old)] = ("value", n); n += 1
      if was[0] != "held": where[id(new)] = was
      continue
    _, program, inputs, results = event
    steps.append(("realize", _Realize(program, [bind(b) for b in inputs])))
    given = {id(b) for b in inputs}   # (an output written into a target returns that target: not made here)
    for i, b in enumerate(results):
      if id(b) not in where and id(b) not in given: where[id(b)] = ("value", n + i); made.add(b)
    n += len(results)
  def result(t) -> tuple: return (bind(t.uop.src[0].arg), t.uop.arg, t.shape, t.device)
  results = [result(t) for t in outs]
  grads = [(weakref.ref(p), None if g is None else result(g)) for p, g in changed]
  # an old version that nothing of the call reads afterwards (the program was given the memory itself: the copy was
  # for a lazy graph outside) is not copied by a replay
  read = lambda step: step[1].inputs if step[0] == "realize" else step[1:2] if step[0] == "split" else step[1:3]
  used = {b[1] for step in steps for b in read(step) if b[0] == "value"}
  used |= {r[0][1] for r in results + [g for _, g in grads if g is not None] if r[0][0] == "value"}
  steps = [("unread",) if step[0] == "split" and step[2] not in used else step for step in steps]
  # tensors the function keeps (in an attribute, a list) that view memory the call made: each replay re-points them
  # to its own, as a plain call would have made them anew
  own = {id(t) for t in outs} | {id(g) for _, g in changed if g is not None}
  kept = [(where[id(b)], views) for b in made
          if (views := [(weakref.ref(t), e.view) for t, e in _viewers(b) if id(t) not in own])]
  # the old gradients that the call replaces without reading them go before a replay runs its programs (as zero_grad()
  # in the function lets them go; once its index checks passed), not after: they are not held beside the new ones
  read_grads = {id(b[1]()) for step in steps if step[0] == "realize" for b in step[1].inputs if b[0] == "grad"}
  released = [ref for ref, _ in grads if id(ref()) not in read_grads]
  return _Trace(steps, results, shape, grads, kept, released, made)


def _difference(a: _Trace, b: _Trace) -> str | None:
  """What differs between the work of two calls (a the earlier), or None when a replay of b serves both."""
  if [s[0] for s in a.steps] != [s[0] for s in b.steps]:
    count = lambda t: ", ".join(f"{sum(s[0] == kind for s in t.steps)} {kind}s" for kind in ("realize", "split", "unread", "guard"))
    return f"{count(a)} against {count(b)} (a split: an old version kept for lazy readers)"
  for sa, sb in zip(a.steps, b.steps):
    if sa[0] == "realize":
      ra, rb = sa[1], sb[1]
      if ra.program.key != rb.program.key: return _program_difference(ra.program.key, rb.program.key)
      pairs = zip(ra.inputs, rb.inputs)
    elif sa[0] == "split": pairs = [(sa[1], sb[1])]
    else: pairs = zip(sa[1:3], sb[1:3])
    for x, y in pairs:
      if (d := _binding_difference(x, y, a)) is not None: return d
  for (x, vx, *kx), (y, vy, *ky) in zip(a.results, b.results):
    if (d := _binding_difference(x, y, a)) is not None or (d := None if (vx, kx) == (vy, ky) else "a result's view") is not None: return d
  if [(r(), g) for r, g in a.grads if r() is not None] != [(r(), g) for r, g in b.grads if r() is not None]:
    return "the gradients it changes"
  return None


def _binding_difference(x: Binding, y: Binding, earlier: _Trace) -> str | None:
  if x[0] == y[0] == "held" and x[1].current() is y[1].current(): return None
  if x[0] != "held" and x == y: return None
  if x[0] == y[0] == "held" and y[1] not in earlier.made:
    return (f"where the earlier call read a {x[1].dtype.name}[{x[1].size}] tensor from outside the call, the later read "
            f"another (a tensor made anew on each call: from numpy data inside the function, say)")
  def what(b: Binding) -> str:
    if b[0] == "arg": return f"its tensor argument {b[1]}"
    if b[0] == "value": return f"tensor {b[1]} made in the call"
    if b[0] == "grad": return "a .grad as it was before the call"
    buf = b[1]
    return (f"the {buf.dtype.name}[{buf.size}] tensor that the earlier call computed" if buf in earlier.made else
            f"a {buf.dtype.name}[{buf.size}] tensor from outside the call")
  return f"where the earlier call read {what(x)}, the later read {what(y)}"


def _program_difference(ka: tuple, kb: tuple) -> str:
  """The first node where two programs' keys (runtime/realize.py graph_key) differ, as words."""
  pa, pb = ka[0][0], kb[0][0]
  for x, y in zip(pa, pb):
    if x != y:
      show = lambda p: f"{p[0]} {_shown(p[2])}" if p[0] != "param" else f"a {p[1].name}[{p[2]}] buffer"
      return f"a program with {show(x)} against one with {show(y)}".replace("Ops.", "")
  if len(pa) != len(pb): return f"programs of {len(pa)} and {len(pb)} nodes"
  return "programs with other outputs or targets" if ka[0] != kb[0] else "programs that differ in their settings"


def _grad_of(ref: weakref.ref):
  """The memory of the .grad a captured call added to (it accumulates across calls); zeros where it is None now
  (zero_grad() between calls: adding to zeros is what the function's first call after it computes)."""
  if (p := ref()) is None:
    raise JitError("jit: the captured call added to the .grad of a tensor that is gone: call .reset() on the function")
  return (p.zeros_like().contiguous() if p.grad is None else p.grad).realize().uop.src[0].arg


def _shown(arg) -> str:
  """A node's argument as its key holds it, readable (a float constant is keyed by its exact hex form)."""
  if isinstance(arg, tuple) and len(arg) == 2 and arg[0] is float and isinstance(arg[1], str): return repr(float.fromhex(arg[1]))
  return repr(arg)


def _runner(program):
  from runtime.replay import replayer
  return replayer(program)


def _replay(trace: _Trace, buffers: list):
  from .tensor import Tensor
  from .assign import _register
  from rewrite import UOp, Ops
  values: list = []
  def get(b: Binding):
    kind, x = b
    return buffers[x] if kind == "arg" else values[x] if kind == "value" else x.current() if kind == "held" else _grad_of(x)
  # the old gradients go once the checks of the arguments' values passed (an index out of range changes nothing)
  checked = max((i + 1 for i, step in enumerate(trace.steps) if step[0] == "guard"), default=0)
  for i, step in enumerate(trace.steps + [("checked",)]):
    if i == checked:
      for ref in trace.released:
        if (p := ref()) is not None: p.grad = None
    if step[0] == "realize":
      values.extend(u.src[0].arg for u in step[1].runner.run([get(b) for b in step[1].inputs]))
    elif step[0] == "split": values.append(get(step[1]).copy())
    elif step[0] == "unread": values.append(None)
    elif step[0] == "guard": capture.guard(get(step[1]), get(step[2]), step[3])
  def tensor(r: tuple):
    buf = get(r[0])
    return Tensor._from_uop(UOp(Ops.VIEW, buf.dtype, (UOp(Ops.BUFFER, buf.dtype, (), buf),), r[1]), r[2], r[3])
  for ref, g in trace.grads:
    if (p := ref()) is not None: p.grad = None if g is None else tensor(g)
  for binding, views in trace.kept:
    buf = get(binding)
    node = UOp(Ops.BUFFER, buf.dtype, (), buf)
    for ref, view in views:
      if (t := ref()) is not None: t.uop = UOp(Ops.VIEW, buf.dtype, (node,), view); _register(t, buf, view)
  out = [tensor(r) for r in trace.results]
  return out[0] if trace.shape == "one" else tuple(out) if trace.shape == "tuple" else out


def jit(fn: Callable) -> Jit:
  """`fn` (a function of tensors returning a Tensor or a tuple or list of them) recorded until two calls in a row run
  the same work, then replayed without building its graph; see this module's docstring for what may not change."""
  return Jit(fn)
