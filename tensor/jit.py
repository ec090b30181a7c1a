"""`jit`: a function of tensors whose host program is captured once and replayed, without building its graph.

  from tensor import jit
  @jit
  def forward(x): return model(x)
  forward(x1)   # call 1: runs as usual (the graph is built, compiled, run)
  forward(x2)   # call 2: builds the graph once more and captures its host program
  forward(x3)   # call 3 on: the program runs on x3's memory; fn is not called at all

What may not change between calls (the captured program is the graph of call 2, fixed):
  - Tensor arguments are matched by position, shape, dtype and device: other shapes or dtypes capture another program
    (a signature of its own, up to `MAX_CAPTURES`; past that an error says so) rather than replaying a wrong one.
    Which arguments are the same tensor is part of the signature too (f(a, a) is not f(a, b)).
  - Other arguments (ints, floats, strings, tuples of them) are part of the signature: another value is another
    capture. Python values the function reads from elsewhere (globals, closures, attributes) are those of call 2.
  - Tensors the function reads that are not its arguments (weights) are bound to the memory they had at call 2. To
    change one between calls, pass it as an argument, or call `.reset()` after the change (the next two calls
    capture again).
  - The function must only build its result: work it runs itself (an assign, `t[...] = v`, `.numpy()`, `.item()`,
    `.realize()`) would be skipped by a replay, so capturing such a function is a JitError.
  - The result is a Tensor, or a tuple or list of Tensors; each replay returns new tensors (new memory).
On a GPU the replay launches the program's kernels as CUDA graphs (runtime/replay.py): one driver call per run of
kernels instead of one per kernel; the captured program then keeps its intermediates' memory between calls.
A jit function is called from one thread at a time (its table of captures is its own). Tensor arguments that are lazy
are realized first; an argument that is not a Tensor, a Python scalar, string,
None or a tuple of those is an error (it could not be compared between calls).
"""
from __future__ import annotations
from dataclasses import dataclass
from typing import Any, Callable
from runtime.program import Program

MAX_CAPTURES = 16   # signatures captured per function; a function called with ever new shapes is an error past this


class JitError(TypeError):
  """A jit function called in a way its captured program cannot serve (or cannot be compared)."""


@dataclass
class _Capture:
  program: Program
  bind: list[tuple[str, Any]]       # per program parameter: ("arg", the tensor argument's number) or ("held", Buffer)
  shape: str                        # "one", "tuple" or "list": how the result is returned
  outputs: list[tuple[tuple[int, ...], str]]   # each output's shape and device
  runner: Any = None                # after its first run: the program, or on a GPU its replay through CUDA graphs


class Jit:
  def __init__(self, fn: Callable):
    self.fn = fn
    self.__name__ = getattr(fn, "__name__", "jit")
    self.__doc__ = getattr(fn, "__doc__", None)
    self.seen: dict[tuple, int] = {}          # signature -> calls seen before its capture
    self.captures: dict[tuple, _Capture] = {}

  def reset(self) -> None:
    """Forget every capture: the next two calls run as usual, the second capturing anew."""
    self.seen.clear(); self.captures.clear()

  def __call__(self, *args, **kwargs):
    from .tensor import Tensor
    from .assign import is_view
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
    if (cap := self.captures.get(sig)) is not None: return self._replay(cap, buffers)
    if self.seen.get(sig, 0) == 0:
      if len(self.seen) >= MAX_CAPTURES:
        raise JitError(f"jit {self.__name__}: called with {len(self.seen) + 1} different signatures (shapes, dtypes, "
                       f"devices or Python values of its arguments); at most {MAX_CAPTURES} are captured. Call it with "
                       f"fewer kinds of arguments, or call .reset()")
      self.seen[sig] = 1
      return self.fn(*args, **kwargs)   # call 1: as usual
    from runtime.realize import realize_count
    before = realize_count()
    result = self.fn(*args, **kwargs)
    if realize_count() != before:
      raise JitError(f"jit {self.__name__}: the function ran work of its own while it was captured (an assign, "
                     f"t[...] = v, .numpy(), .item() or .realize() inside it): a replay runs only the graph of its "
                     f"result and would skip that work; return what it computes instead")
    return self._capture(sig, result, buffers)

  def _capture(self, sig: tuple, result, buffers: list) -> Any:
    from .tensor import Tensor
    from runtime.realize import find_program
    shape = "one" if isinstance(result, Tensor) else "tuple" if isinstance(result, tuple) else "list" if isinstance(result, list) else None
    outs = [result] if shape == "one" else list(result) if shape else []
    if shape is None or not all(isinstance(t, Tensor) for t in outs):
      raise JitError(f"jit {self.__name__}: the function must return a Tensor or a tuple or list of Tensors, not {type(result).__name__}")
    program, params = find_program([(t.uop, t.device) for t in outs])
    bind = [next((("arg", j) for j, b in enumerate(buffers) if b is p), ("held", p)) for p in params]
    cap = self.captures[sig] = _Capture(program, bind, shape, [(t.shape, t.device) for t in outs])
    return self._replay(cap, buffers)

  @staticmethod
  def _replay(cap: _Capture, buffers: list):
    from .tensor import Tensor
    from runtime.replay import replayer
    realized = (cap.runner or cap.program).run([buffers[x] if kind == "arg" else x for kind, x in cap.bind])
    if cap.runner is None: cap.runner = replayer(cap.program)   # its picks are made now
    out = [Tensor._from_uop(u, shape, device) for u, (shape, device) in zip(realized, cap.outputs)]
    return out[0] if cap.shape == "one" else tuple(out) if cap.shape == "tuple" else out


def jit(fn: Callable) -> Jit:
  """`fn` (a function of tensors returning a Tensor or a tuple or list of them) captured on its second call and
  replayed from its third without building its graph; see this module's docstring for what may not change."""
  return Jit(fn)
