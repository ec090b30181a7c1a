"""Random small programs of the Tensor API, run by Graft and by numpy and compared: a differential fuzzer (issue 22).

A program is a graph of `Node`s, each one Tensor-API call: `Node("pad", (((0, 1), (2, 0)), -1.5), (x,))` is
`x.pad(((0, 1), (2, 0)), value=-1.5)`. Each op has a line of Tensor code (`code`, also what a reproduction prints) and
the numpy function that computes the same thing. The generator picks ops whose numpy result is well defined and
computes it as it goes, keeping for every node its shape, dtype and an interval that holds its values:

- Exact nodes hold small integers (or halves) that every dtype on the way represents exactly, so any order of
  arithmetic gives the same bits: they are compared with numpy for equality. Integer ops never overflow (the interval
  says when one could, and the op is not picked), so C's undefined signed overflow never decides a result.
- Inexact nodes (after exp, division, ...) are compared within a tolerance, and only continuous ops follow them: no
  comparison, floor, cast to an integer or argmax of a value that may round differently, since one ulp there would
  become a different answer, not a bug.

`run_program` realizes the outputs of one program (one realize) and compares them; `shrink` reduces a failing program
to a smallest one that still fails; `reproduction` prints it as a script. Used by tests/test_fuzz.py (fixed seeds)
and bench/fuzz.py (long runs, a tally).
"""
from __future__ import annotations
import math
import random
from dataclasses import dataclass, field
import numpy as np

FLOATS = ("float32", "float16", "float64")
INTS = ("int8", "uint8", "int16", "int32", "int64")
DTYPES = FLOATS + INTS + ("bool",)
# exact integers: how far each dtype holds them all (a float's mantissa), and the range of the integer dtypes
EXACT_LIMIT = {"float32": 2 ** 22, "float16": 2 ** 10, "float64": 2 ** 40, "bool": 1,
               **{d: min(int(np.iinfo(d).max), 2 ** 40) for d in INTS}}
EXACT_FLOOR = {d: (0 if d in ("uint8", "bool") else -EXACT_LIMIT[d] if d in FLOATS else max(int(np.iinfo(d).min), -2 ** 40)) for d in DTYPES}
TOLERANCE = {"float16": 2e-2, "float32": 2e-4, "float64": 1e-9}


@dataclass(frozen=True, eq=False)
class Node:
  op: str
  args: tuple
  srcs: tuple = ()
  # what the generator knows of its values (not part of the program's meaning; shrink recomputes none of it)
  shape: tuple = field(default=(), compare=False)
  dtype: str = field(default="float32", compare=False)
  exact: bool = field(default=True, compare=False)
  lo: float = field(default=0.0, compare=False)
  hi: float = field(default=0.0, compare=False)


# ---- what each op means: Tensor code (a format of its sources' names and its args) and numpy ----

def _np_input(shape, dtype, seed, exact):
  rng = np.random.default_rng(seed)
  if dtype == "bool": return rng.integers(0, 2, shape).astype(bool)
  if exact: return rng.integers(0 if dtype == "uint8" else -5, 6, shape).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


def _input_code(args, names):
  shape, dtype, seed, exact = args
  if dtype == "bool": return f"Tensor(np.random.default_rng({seed}).integers(0, 2, {shape}).astype(bool))"
  if exact: return f"Tensor(np.random.default_rng({seed}).integers({0 if dtype == 'uint8' else -5}, 6, {shape}).astype(np.{dtype}))"
  return f"Tensor(np.random.default_rng({seed}).standard_normal({shape}).astype(np.{dtype}))"


def _copy_code(name: str, dtype: str) -> str:
  """A tensor of its own with the values of `name` (the target of a setitem or assign: its source stays unchanged)."""
  return f"({name} | False)" if dtype == "bool" else f"({name} + 0)"


def _np_written(a, index, value):
  out = a.copy()
  out[index] = value
  return out


def _np_inplace(a, index, value):
  a[index if index is not None else ...] = value   # (numpy refuses a read-only view: a broadcast; the op is not drawn)
  return a


def _np_sigmoid(a): return (1 / (1 + np.exp(-a.astype(np.float64)))).astype(a.dtype)


def _np_gelu(a):
  x = a.astype(np.float64)
  return (0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))).astype(a.dtype)


def _np_silu(a): return (a.astype(np.float64) * _np_sigmoid(a.astype(np.float64))).astype(a.dtype)


def _np_unary(fn):
  # numpy computes float16 math in float16 steps; Graft computes it in float32 and rounds once, as torch does
  return lambda a: fn(a.astype(np.float32)).astype(a.dtype) if a.dtype == np.float16 else fn(a)


UNARY = {  # name: (Tensor code, numpy), for floats unless said
  "neg": ("(-{0})", np.negative), "abs": ("{0}.abs()", np.abs), "exp": ("{0}.exp()", _np_unary(np.exp)),
  "log": ("{0}.log()", _np_unary(np.log)), "sqrt": ("{0}.sqrt()", _np_unary(np.sqrt)),
  "sin": ("{0}.sin()", _np_unary(np.sin)), "cos": ("{0}.cos()", _np_unary(np.cos)),
  "sigmoid": ("{0}.sigmoid()", _np_sigmoid), "tanh": ("{0}.tanh()", _np_unary(np.tanh)),
  "relu": ("{0}.relu()", lambda a: np.maximum(a, a.dtype.type(0))), "reciprocal": ("{0}.reciprocal()", _np_unary(np.reciprocal)),
  "square": ("{0}.square()", np.square), "floor": ("{0}.floor()", np.floor), "ceil": ("{0}.ceil()", np.ceil),
  "trunc": ("{0}.trunc()", np.trunc), "sign": ("{0}.sign()", np.sign), "exp2": ("{0}.exp2()", _np_unary(np.exp2)),
  "log2": ("{0}.log2()", _np_unary(np.log2)), "isnan": ("{0}.isnan()", np.isnan),
  "logical_not": ("{0}.logical_not()", np.logical_not), "invert": ("(~{0})", np.invert),
  "gelu": ("{0}.gelu()", _np_gelu), "silu": ("{0}.silu()", _np_silu),
}
BINARY = {
  "add": ("({0} + {1})", np.add), "sub": ("({0} - {1})", np.subtract), "mul": ("({0} * {1})", np.multiply),
  "div": ("({0} / {1})", np.divide), "floordiv": ("({0} // {1})", np.floor_divide), "mod": ("({0} % {1})", np.mod),
  "maximum": ("{0}.maximum({1})", np.maximum), "minimum": ("{0}.minimum({1})", np.minimum),
  "lt": ("({0} < {1})", np.less), "le": ("({0} <= {1})", np.less_equal), "gt": ("({0} > {1})", np.greater),
  "ge": ("({0} >= {1})", np.greater_equal), "eq": ("({0} == {1})", np.equal), "ne": ("({0} != {1})", np.not_equal),
  "and": ("({0} & {1})", np.bitwise_and), "or": ("({0} | {1})", np.bitwise_or), "xor": ("({0} ^ {1})", np.bitwise_xor),
}
COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")


def _np_reduce(fn):
  def run(a, axis, keepdim):
    return fn(a, axis=axis, keepdims=keepdim)
  return run


def _np_sum(a, axis, keepdim):
  # Graft sums bools and small ints in int32 (torch's int64 would need int64 accumulators everywhere)
  return np.sum(a, axis=axis, keepdims=keepdim, dtype=_sum_dtype(a.dtype))


def _np_mean(a, axis, keepdim):
  return np.mean(a, axis=axis, keepdims=keepdim, dtype=np.float32 if a.dtype == np.float16 else None).astype(a.dtype)


def _np_arg(fn):
  def run(a, axis, keepdim):
    out = fn(a, axis=axis, keepdims=keepdim).astype(np.int32)
    return out
  return run


REDUCE = {"sum": _np_sum, "max": _np_reduce(np.max), "min": _np_reduce(np.min), "mean": _np_mean,
          "any": _np_reduce(np.any), "all": _np_reduce(np.all), "argmax": _np_arg(np.argmax), "argmin": _np_arg(np.argmin)}


def _np_pad(a, pads, value): return np.pad(a, pads, constant_values=value)


def _np_where(c, a, b): return np.where(c, a, b)


def _np_matmul(a, b):
  if a.dtype == np.float16: return np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(np.float16)
  return np.matmul(a, b)



def _np_nn(name, axis, a):
  """softmax, log_softmax, logsumexp and layernorm of a float tensor along one axis, in float64, rounded once."""
  x = a.astype(np.float64)
  shifted = x - x.max(axis, keepdims=True)
  lse = np.log(np.exp(shifted).sum(axis, keepdims=True))
  if name == "softmax": out = np.exp(shifted - lse)
  elif name == "log_softmax": out = shifted - lse
  elif name == "logsumexp": out = (lse + x.max(axis, keepdims=True)).squeeze(axis)
  else:
    c = x - x.mean(axis, keepdims=True)
    out = c / np.sqrt((c * c).mean(axis, keepdims=True) + 1e-5)
  return out.astype(a.dtype)


def _np_attention(args, q, k, v, mask=None):
  """softmax(q @ kᵀ * scale, masked) @ v in float64, rounded once. A mask is added (`add`), filled in where true
  (`fill`, args[2] the value), or causal: a position sees keys up to `args[2]` past its own (`causal`)."""
  scale, kind, arg = args
  s = np.matmul(q.astype(np.float64), np.swapaxes(k.astype(np.float64), -1, -2)) * scale
  if kind == "add": s = s + mask
  elif kind == "fill": s = np.where(mask, arg, s)
  elif kind == "causal": s = np.where(np.tri(*s.shape[-2:], arg, dtype=bool), s, -np.inf)
  e = np.exp(s - s.max(-1, keepdims=True))
  return np.matmul(e / e.sum(-1, keepdims=True), v.astype(np.float64)).astype(q.dtype)


def _attention_code(args, n):
  scale, kind, arg = args
  s = f"({n[0]} @ {n[1]}.transpose(-1, -2) * {scale!r})"
  if kind == "add": s = f"({s} + {n[3]})"
  elif kind == "fill": s = f"{s}.masked_fill({n[3]}, {arg!r})"
  elif kind == "causal": s = f"{s}.masked_fill(Tensor.full({s}.shape[-2:], True).tril({arg}).logical_not(), float('-inf'))"
  return f"({s}.softmax(-1) @ {n[2]})"


def _np_linear(args, x, w, b, res=None):
  """(x @ w + b), an activation, and a residual added: in float64, rounded once."""
  y = np.matmul(x.astype(np.float64), w.astype(np.float64)) + b
  y = {"none": y, "relu": np.maximum(y, 0), "gelu": _np_gelu(y), "silu": _np_silu(y)}[args[0]]
  return (y if res is None else y + res).astype(x.dtype)


def _linear_code(args, n):
  y = f"({n[0]} @ {n[1]} + {n[2]})" + ("" if args[0] == "none" else f".{args[0]}()")
  return f"({y} + {n[3]})" if len(n) > 3 else y


def _np_norm_linear(args, x, w, g=None, b=None):
  """layernorm(x) over the last axis (scaled and shifted when g, b), then @ w: float64, rounded once."""
  y = _np_nn("layernorm", -1, x.astype(np.float64))
  if g is not None: y = y * g + b
  return np.matmul(y, w.astype(np.float64)).astype(x.dtype)


def _sum_dtype(dt: np.dtype) -> np.dtype: return dt if dt.kind == "f" or dt == np.int64 else np.dtype(np.int32)


def _np_triangle(lower: bool, k: int, a):
  keep = (np.tri(*a.shape[-2:], k, dtype=bool) if lower else ~np.tri(*a.shape[-2:], k - 1, dtype=bool))
  return np.where(keep, a, np.zeros((), a.dtype))

# op -> (Tensor code: a format of (args, source names), numpy function of (args, *source values))
OPS = {
  "input": (_input_code, lambda args: _np_input(*args)),
  "full": (lambda args, n: f"Tensor.full({args[0]}, {args[1]!r}, dtype='{args[2]}')", lambda args: np.full(args[0], args[1], args[2])),
  "unary": (lambda args, n: UNARY[args[0]][0].format(*n), lambda args, a: UNARY[args[0]][1](a)),
  "binary": (lambda args, n: BINARY[args[0]][0].format(*n), lambda args, a, b: _np_binary(args[0], a, b)),
  "scalar": (lambda args, n: BINARY[args[0]][0].format(*((repr(args[1]), n[0]) if args[2] else (n[0], repr(args[1])))),
             lambda args, a: _np_binary(args[0], *((_scalar_array(args[1], a), a) if args[2] else (a, _scalar_array(args[1], a))))),
  "where": (lambda args, n: f"{n[0]}.where({n[1]}, {n[2]})", lambda args, c, a, b: _np_where(c, *_np_promoted(a, b))),
  "cast": (lambda args, n: f"{n[0]}.cast('{args[0]}')", lambda args, a: a.astype(args[0])),
  "reshape": (lambda args, n: f"{n[0]}.reshape({args[0]})", lambda args, a: a.reshape(args[0])),
  "permute": (lambda args, n: f"{n[0]}.permute({args[0]})", lambda args, a: a.transpose(args[0])),
  "expand": (lambda args, n: f"{n[0]}.expand({args[0]})", lambda args, a: np.broadcast_to(a, args[0])),
  "pad": (lambda args, n: f"{n[0]}.pad({args[0]}, value={args[1]!r})", lambda args, a: _np_pad(a, *args)),
  "shrink": (lambda args, n: f"{n[0]}.shrink({args[0]})", lambda args, a: a[tuple(slice(b, e) for b, e in args[0])]),
  "flip": (lambda args, n: f"{n[0]}.flip({args[0]})", lambda args, a: np.flip(a, args[0])),
  "getitem": (lambda args, n: f"{n[0]}[{_index_code(args[0])}]", lambda args, a: a[args[0]]),
  "reduce": (lambda args, n: f"{n[0]}.{args[0]}(axis={args[1]}, keepdim={args[2]})", lambda args, a: REDUCE[args[0]](a, args[1], args[2])),
  "matmul": (lambda args, n: f"({n[0]} @ {n[1]})", lambda args, a, b: _np_matmul(a, b)),
  "cat": (lambda args, n: f"{n[0]}.cat({n[1]}, axis={args[0]})", lambda args, a, b: np.concatenate(_np_promoted(a, b), axis=args[0])),
  # setitem: args (index, target dtype[, scalar value]); assign: args (target dtype,)
  "setitem": (lambda args, n, out: [f"{out} = {_copy_code(n[0], args[1])}",
                                     f"{out}[{_index_code(args[0])}] = {n[1] if len(n) > 1 else repr(args[2])}"],
              lambda args, a, *v: _np_written(a, args[0], v[0] if v else args[2])),
  "assign": (lambda args, n, out: [f"{out} = {_copy_code(n[0], args[0])}", f"{out}.assign({n[1]})"],
             lambda args, a, v: np.broadcast_to(v, a.shape).copy()),
  # the operations a model needs (issue 21): row functions, running sums, triangles, masks, gathers
  "nn": (lambda args, n: f"{n[0]}.{args[0]}({args[1]})", lambda args, a: _np_nn(*args, a)),
  "cumsum": (lambda args, n: f"{n[0]}.cumsum({args[0]})",
             lambda args, a: np.cumsum(a, axis=args[0], dtype=_sum_dtype(a.dtype))),
  "triangle": (lambda args, n: f"{n[0]}.{args[0]}({args[1]})", lambda args, a: _np_triangle(args[0] == "tril", args[1], a)),
  "masked_fill": (lambda args, n: f"{n[0]}.masked_fill({n[1]}, {args[0]!r})", lambda args, a, m: np.where(m, np.asarray(args[0], a.dtype), a)),
  "gather": (lambda args, n: f"{n[0]}.gather({args[0]}, {n[1]})", lambda args, a, i: np.take_along_axis(a, i, args[0])),
  "take": (lambda args, n: f"{n[0]}[{n[1]}]", lambda args, a, i: a[i]),
  # the patterns whole models are made of, which the compiler recognizes and fuses (attention, a linear layer with
  # its epilogue, a layer norm read by a product): at sizes past the tiles of the kernels they become
  "attention": (_attention_code, lambda args, q, k, v, *m: _np_attention(args, q, k, v, *m)),
  "linear": (_linear_code, lambda args, x, w, b, *res: _np_linear(args, x, w, b, *res)),
  "norm_linear": (lambda args, n: f"({n[0]}.layernorm(-1){f' * {n[2]} + {n[3]}' if len(n) > 2 else ''} @ {n[1]})",
                  lambda args, x, w, *gb: _np_norm_linear(args, x, w, *gb)),
}
# inplace: args (index or None for assign, target dtype[, scalar value]); its value is the target itself, written
OPS["inplace"] = (lambda args, n, out: [f"{n[0]}[{_index_code(args[0])}] = {n[1] if len(n) > 1 else repr(args[2])}"
                                         if args[0] is not None else f"{n[0]}.assign({n[1]})", f"{out} = {n[0]}"],
                  lambda args, a, *v: _np_inplace(a, args[0], v[0] if v else args[2]))
STATEMENTS = ("setitem", "assign", "inplace")   # their code is lines that make the value `out`, not an expression


def code_lines(n: Node, names: dict) -> list[str]:
  """The Tensor code that computes node n into the variable names[n]."""
  srcs = [names[s] for s in n.srcs]
  if n.op in STATEMENTS: return OPS[n.op][0](n.args, srcs, names[n])
  return [f"{names[n]} = {OPS[n.op][0](n.args, srcs)}"]


def _index_code(index) -> str:
  def one(i):
    if isinstance(i, slice): return ":".join("" if x is None else str(x) for x in (i.start, i.stop, i.step))
    return repr(i)
  return (", ".join(one(i) for i in index) + ("," if len(index) == 1 and not isinstance(index[0], slice) else "")) if index else "..."


def _graft_dtype(a: np.dtype, b: np.dtype) -> np.dtype:
  from tensor.promotion import promote
  from rewrite import dtypes
  return np.dtype(promote(dtypes.from_numpy(np.dtype(a)), dtypes.from_numpy(np.dtype(b))).np)


def _np_promoted(a, b):
  dt = _graft_dtype(a.dtype, b.dtype)
  return a.astype(dt), b.astype(dt)


def _scalar_array(v, like):
  """A Python scalar as numpy sees it beside a tensor in Graft: weak, of the tensor's dtype when its kind fits."""
  from tensor.promotion import with_scalar
  from rewrite import dtypes
  return np.asarray(v, dtype=with_scalar(dtypes.from_numpy(like.dtype), v).np)


def _np_binary(op, a, b):
  a, b = _np_promoted(a, b)
  if op == "div" and a.dtype.kind != "f": a, b = a.astype(np.float32), b.astype(np.float32)
  with np.errstate(all="ignore"):
    if op in ("add", "mul") and a.dtype == bool: return (a | b) if op == "add" else (a & b)
    if op in ("floordiv", "mod") and a.dtype.kind in "iu":   # numpy gives 0 for a zero divisor, as Graft does
      return BINARY[op][1](a, np.where(b == 0, 1, b)) * (b != 0)
    out = BINARY[op][1](a, b)
  return out


def op_name(n: Node) -> str:
  """The op with its operation where it has one: "unary:exp", "reduce:sum", "pad"."""
  return f"{n.op}:{n.args[0]}" if n.op in ("unary", "binary", "scalar", "reduce", "nn", "triangle") else n.op


# ---- evaluation ----

def names_of(outputs) -> dict[Node, str]:
  order: dict[Node, str] = {}
  def visit(n):
    if n in order: return
    for s in n.srcs: visit(s)
    order[n] = f"v{len(order)}"
  for o in outputs: visit(o)
  return order


def numpy_values(outputs) -> dict[Node, np.ndarray]:
  values: dict[Node, np.ndarray] = {}
  with np.errstate(all="ignore"):
    for n in names_of(outputs):
      values[n] = np.asarray(OPS[n.op][1](n.args, *(values[s] for s in n.srcs)))
  return values


def tensor_values(outputs) -> dict[Node, object]:
  """Build each node's tensor (lazily: nothing is realized here, but setitem and assign realize their target)."""
  from tensor import Tensor
  env = {"Tensor": Tensor, "np": np}
  names = names_of(outputs)
  for n in names: exec("\n".join(code_lines(n, names)), env)
  return {n: env[name] for n, name in names.items()}


def reproduction(outputs) -> str:
  """The program as a script that prints Graft's answers (numpy's are in the report beside it)."""
  names = names_of(outputs)
  lines = ["import numpy as np", "from tensor import Tensor"] + [line for n in names for line in code_lines(n, names)]
  return "\n".join(lines + [f"print({names[o]}.numpy())" for o in outputs])


@dataclass
class Outcome:
  kind: str            # "ok", "mismatch" (Graft's numbers differ), "error" (Graft raised where numpy did not)
  detail: str = ""


def tolerance(node: Node) -> float | None:
  """How far a node may be from numpy's value, relative to its largest: None (exactly) where every node it is computed
  from is exact, else the tolerance of the least precise dtype that an inexact value passed through."""
  inexact = [n.dtype for n in names_of([node]) if not n.exact and n.dtype in TOLERANCE]
  return max(TOLERANCE[d] for d in inexact) if inexact and not node.exact else None


def compare(got: np.ndarray, want: np.ndarray, node: Node) -> str | None:
  """Why `got` is not numpy's `want` for this node, or None."""
  if got.shape != want.shape: return f"shape {got.shape} != numpy's {want.shape}"
  if got.dtype != want.dtype: return f"dtype {got.dtype} != numpy's {want.dtype}"
  rtol = tolerance(node) if got.dtype.kind == "f" else None
  if rtol is None: bad = ~((got == want) | (np.isnan(got) & np.isnan(want)) if got.dtype.kind == "f" else got == want)
  else:
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.abs(w[np.isfinite(w)])
    atol = rtol * (1 + (finite.max() if finite.size else 0))
    bad = ~np.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
  if not bad.any(): return None
  where = tuple(int(i) for i in np.argwhere(bad)[0])
  return f"{int(bad.sum())} of {want.size} elements differ, e.g. at {where}: {got[where]!r} (numpy {want[where]!r})"


def run_program(outputs) -> Outcome:
  """Realize a program's outputs in one realize and compare each with numpy."""
  from tensor import Tensor
  want = numpy_values(outputs)
  try:
    values = tensor_values(outputs)
    Tensor.realize_all(*(values[o] for o in outputs))
    got = [values[o].numpy() for o in outputs]
  except Exception as e:  # noqa: BLE001 -- any failure of Graft on a program numpy runs is a finding
    return Outcome("error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300])
  for o, g in zip(outputs, got):
    if (why := compare(g, want[o], o)) is not None: return Outcome("mismatch", why)
  return Outcome("ok")


def reseeded(outputs, delta: int = 1):
  """The same program on other data: every input drawn from another seed, its shape, dtype and kind of values kept
  (so what the generator knew of each node still holds)."""
  memo: dict[Node, Node] = {}
  def go(n):
    if n not in memo:
      args = (*n.args[:2], n.args[2] + delta, n.args[3]) if n.op == "input" else n.args
      memo[n] = Node(n.op, args, tuple(go(s) for s in n.srcs), n.shape, n.dtype, n.exact, n.lo, n.hi)
    return memo[n]
  return [go(o) for o in outputs]


def run_program_twice(outputs) -> Outcome:
  """The program, then the same program on new data (a warm call: it may reuse what the first call compiled or
  recorded), each compared with numpy on its own data."""
  first = run_program(outputs)
  return first if first.kind != "ok" else run_program(reseeded(outputs))


# ---- shrinking ----

def _rebuild(outputs, old: Node, new: Node):
  memo: dict[Node, Node] = {}
  def go(n):
    if n is old: return new
    if n not in memo:
      srcs = tuple(go(s) for s in n.srcs)
      memo[n] = n if all(a is b for a, b in zip(srcs, n.srcs)) else Node(n.op, n.args, srcs, n.shape, n.dtype, n.exact, n.lo, n.hi)
    return memo[n]
  return [go(o) for o in outputs]


def _candidates(outputs):
  nodes = list(names_of(outputs))
  if len(outputs) > 1:
    for o in outputs: yield [o]
  for n in nodes:            # a part of the program alone
    if all(n is not o for o in outputs): yield [n]
  for n in nodes:            # a node bypassed: its source in its place
    for s in n.srcs: yield _rebuild(outputs, n, s)


def _valid(outputs) -> bool:
  try:
    numpy_values(outputs)
    tensor_values(outputs)
    return True
  except Exception:  # noqa: BLE001 -- a candidate that numpy or the Tensor API refuses is not a program
    return False


def shrink(outputs, still_fails, budget: int = 200):
  """A smaller program that still fails: greedily, the first candidate that still fails, until none does."""
  tried = 0
  improved = True
  while improved and tried < budget:
    improved = False
    for cand in sorted(_candidates(outputs), key=lambda c: len(names_of(c))):
      if len(names_of(cand)) >= len(names_of(outputs)) or not _valid(cand): continue
      tried += 1
      if still_fails(cand):
        outputs, improved = cand, True
        break
      if tried >= budget: break
  return outputs


# ---- generation ----

class Generator:
  """Random programs from one seed. Each op is offered only where its result is well defined (see the module doc)."""

  def __init__(self, seed: int, dtypes=DTYPES):
    self.rng = random.Random(seed)
    self.dtypes = dtypes
    self.seed = seed

  # -- leaves
  def shape(self):
    r = self.rng
    return tuple(r.choice([1, 2, 3, 4, 5, 7, 8]) for _ in range(r.choice([0, 1, 1, 2, 2, 2, 3, 3, 4])))

  def leaf(self, shape=None, dtype=None):
    r = self.rng
    shape = self.shape() if shape is None else shape
    dtype = dtype or r.choice(self.dtypes + ("float32",) * 3 + ("int32",) if self.dtypes == DTYPES else self.dtypes)
    if r.random() < 0.2:
      v = r.choice([-3, -2, -1, -0.5, 0, 0.5, 1, 2, 3, -0.0]) if dtype in FLOATS else r.choice([0, 1, 2, 3] + ([] if dtype == "uint8" else [-1, -3]))
      v = bool(v) if dtype == "bool" else v
      return Node("full", (shape, v, dtype), (), shape, dtype, True, float(v), float(v))
    exact = dtype not in FLOATS or r.random() < 0.6
    lo, hi = (0, 1) if dtype == "bool" else (0 if dtype == "uint8" else -5, 5) if exact else (-6, 6)
    return Node("input", (shape, dtype, r.randrange(1 << 20), exact), (), shape, dtype, exact, lo, hi)

  def program(self, steps: int | None = None, pool: list | None = None):
    r = self.rng
    pool = pool or [self.leaf() for _ in range(r.choice([1, 2, 2, 3]))]
    for _ in range(steps if steps is not None else r.randint(3, 10)):
      for _attempt in range(20):
        node = self.step(pool)
        if node is not None:
          pool.append(node)
          break
    outs = [pool[-1]] + ([r.choice(pool[:-1])] if len(pool) > 1 and r.random() < 0.3 else [])
    return [o for i, o in enumerate(outs) if o not in outs[:i]]

  def pattern_program(self):
    """A program around one pattern a model is made of (attention, a linear layer's epilogue, a norm's prologue),
    with a few random steps after it: what the fusing rules see most."""
    r = self.rng
    pool = [self.leaf()]
    for _attempt in range(50):
      try:
        pool.append(getattr(self, "_" + r.choice(["attention", "attention", "linear", "norm_linear"]))(pool[0], pool))
        break
      except _Skip: continue
    return self.program(r.randint(0, 3), pool)

  def step(self, pool):
    r = self.rng
    # (setitem and assign realize as they go: two compiles each, so they are drawn less often)
    kind = r.choice(["unary", "unary", "unary", "binary", "binary", "binary", "scalar", "scalar", "where", "where", "cast",
                     "cast", "movement", "movement", "movement", "movement", "movement", "reduce", "reduce", "matmul",
                     "cat", "setitem", "assign", "inplace", "inplace", "model", "model", "model"])
    x = pool[-1] if r.random() < 0.6 else r.choice(pool)   # mostly a chain: what is not an output's source is not run
    try: return getattr(self, kind)(x, pool)
    except _Skip: return None

  def _node(self, op, args, srcs, exact, lo, hi, dtype=None):
    """The node, with its shape and dtype from numpy (raising _Skip where numpy refuses or the values leave the
    ranges that keep them exact and free of overflow)."""
    node = Node(op, args, tuple(srcs))
    try:
      with np.errstate(all="ignore"): val = numpy_values([node])[node]
    except Exception: raise _Skip() from None  # noqa: BLE001
    dt = str(val.dtype)
    if dt not in DTYPES: raise _Skip()
    if val.size and dt != "bool":
      if exact:
        if not (EXACT_FLOOR[dt] <= lo and hi <= EXACT_LIMIT[dt]): raise _Skip()
        if val.dtype.kind == "f" and not np.all(np.isfinite(val)): raise _Skip()
      elif dt in INTS: raise _Skip()
      elif abs(lo) > 1e4 or abs(hi) > 1e4: raise _Skip()   # keep inexact floats far from overflow
    return Node(op, args, tuple(srcs), val.shape, dt, exact, lo, hi)

  def unary(self, x, pool):
    r = self.rng
    if x.dtype == "bool": name = r.choice(["logical_not", "invert"])
    elif x.dtype in INTS: name = r.choice(["neg", "abs", "invert", "square", "sign"] if x.dtype != "uint8" else ["invert", "square"])
    else:
      names = ["neg", "abs", "relu", "square", "sin", "cos", "sigmoid", "tanh", "exp", "exp2", "log", "log2", "sqrt", "reciprocal",
               "gelu", "silu"]
      if x.exact: names += ["floor", "ceil", "trunc", "sign", "isnan"]
      name = r.choice(names)
    m = max(abs(x.lo), abs(x.hi))
    lo, hi, exact = {"neg": (-x.hi, -x.lo, x.exact), "abs": (0, m, x.exact), "relu": (max(x.lo, 0), max(x.hi, 0), x.exact),
                     "square": (0, m * m, x.exact), "sign": (-1, 1, True), "floor": (x.lo, x.hi, True), "ceil": (x.lo, x.hi, True),
                     "trunc": (x.lo, x.hi, True), "isnan": (0, 1, True), "logical_not": (0, 1, True),
                     "sin": (-1, 1, False), "cos": (-1, 1, False), "sigmoid": (0, 1, False), "tanh": (-1, 1, False),
                     "gelu": (-0.2, max(x.hi, 0), False), "silu": (-0.3, max(x.hi, 0), False)}.get(name, (None, None, False))
    if name == "invert":
      if x.dtype == "bool": lo, hi, exact = 0, 1, True
      else: lo, hi, exact = (-x.hi - 1, -x.lo - 1, True) if x.dtype != "uint8" else (255 - x.hi, 255 - x.lo, True)
    if name in ("exp", "exp2"):
      if x.hi > 20: raise _Skip()
      lo, hi = 0, math.exp(x.hi) if name == "exp" else 2 ** x.hi
    if name in ("log", "log2", "sqrt", "reciprocal"):
      if not x.exact and x.lo <= 0.01:  # away from the pole and the domain's edge, where rounding would decide
        x = self._node("scalar", ("add", 1, False), (self._node("unary", ("abs",), (x,), False, 0, m),), False, 1, m + 1)
      lo, hi = (-200, math.log(max(x.hi, 1)) * 2 + 1) if name != "sqrt" else (0, math.sqrt(max(x.hi, 0)) + 1)
      if name == "reciprocal":
        if x.lo <= 0 <= x.hi and not x.exact: raise _Skip()
        lo, hi = -1e3, 1e3
      exact = False
    if name in ("sin", "cos") and m > 1e3: raise _Skip()
    return self._node("unary", (name,), (x,), exact and x.exact if name not in ("isnan", "sign", "logical_not") else exact, lo, hi)

  def _partner(self, x, pool, dtype=None):
    """Another operand that broadcasts with x: from the pool when one does, else a new leaf of a broadcastable shape."""
    r = self.rng
    ok = [p for p in pool if _broadcasts(p.shape, x.shape) and (dtype is None or p.dtype == dtype)]
    if ok and r.random() < 0.7: return r.choice(ok)
    shape = tuple(d if r.random() < 0.7 else 1 for d in x.shape)[r.randint(0, len(x.shape)):] if x.shape and r.random() < 0.5 else x.shape
    return self.leaf(shape, dtype or (x.dtype if r.random() < 0.6 else r.choice(self.dtypes)))

  def binary(self, x, pool):
    r = self.rng
    y = self._partner(x, pool)
    if r.random() < 0.5: x, y = y, x
    dt = str(_graft_dtype(np.dtype(x.dtype), np.dtype(y.dtype)))
    op = r.choice(list(BINARY))
    return self._binary_node(op, x, y, dt, (x,  y))

  def _binary_node(self, op, x, y, dt, srcs, args_extra=()):
    exact, kind = x.exact and y.exact, "scalar" if args_extra else "binary"
    if op in COMPARISONS:
      if not exact: raise _Skip()
      return self._node(kind, (op, *args_extra), srcs, True, 0, 1)
    if op in ("and", "or", "xor") and dt not in INTS + ("bool",): raise _Skip()
    if dt == "bool" and op not in ("add", "mul", "and", "or", "xor", "maximum", "minimum"): raise _Skip()
    if op in ("floordiv", "mod") and not exact: raise _Skip()
    if op in ("floordiv", "mod") and dt in FLOATS and y.lo <= 0 <= y.hi: raise _Skip()   # x // 0.0: inf or nan
    if op == "div" and y.lo <= 0 <= y.hi: raise _Skip()
    bounds = [a * b for a in (x.lo, x.hi) for b in (y.lo, y.hi)]
    lo, hi = {"add": (x.lo + y.lo, x.hi + y.hi), "sub": (x.lo - y.hi, x.hi - y.lo), "mul": (min(bounds), max(bounds)),
              "maximum": (max(x.lo, y.lo), max(x.hi, y.hi)), "minimum": (min(x.lo, y.lo), min(x.hi, y.hi)),
              "floordiv": (-max(abs(x.lo), abs(x.hi)), max(abs(x.lo), abs(x.hi))),
              "mod": (-max(abs(y.lo), abs(y.hi)), max(abs(y.lo), abs(y.hi))),
              "div": (-max(abs(x.lo), abs(x.hi)) / 0.5 - 1, max(abs(x.lo), abs(x.hi)) / 0.5 + 1)}.get(op, (-2 ** 31, 2 ** 31))
    if op in ("and", "or", "xor"):
      if dt == "bool": lo, hi = 0, 1
      elif min(x.lo, y.lo) >= 0: lo, hi = 0, 2 ** math.ceil(math.log2(max(x.hi, y.hi) + 1))
      else: lo, hi = -2 ** math.ceil(math.log2(max(abs(x.lo), abs(y.lo), x.hi, y.hi) + 1)), 2 ** math.ceil(math.log2(max(abs(x.lo), abs(y.lo), x.hi, y.hi) + 1))
    if dt == "bool": lo, hi = 0, 1
    if op == "div": exact = False
    if op in ("div",) and abs(y.lo) < 0.5 and abs(y.hi) < 0.5: raise _Skip()
    if op == "div": lo, hi = -1e4, 1e4
    if dt == "uint8" and (lo < 0 or hi > 255): raise _Skip()
    return self._node(kind, (op, *args_extra), srcs, exact or dt == "bool", lo, hi)

  def scalar(self, x, pool):
    r = self.rng
    op = r.choice([o for o in BINARY if o not in ("and", "or", "xor")])
    if x.dtype == "bool": raise _Skip()
    v = r.choice([-3, -2, -1, 2, 3, 0.5, -0.5, -1.5, 2.5] if x.dtype in FLOATS else [-3, -2, -1, 1, 2, 3])
    if x.dtype == "uint8" and v < 0: raise _Skip()
    reverse = r.random() < 0.4 and op not in ("maximum", "minimum")   # (a method of the tensor)
    c = Node("full", ((), v, x.dtype), (), (), x.dtype, True, v, v)
    a, b = (c, x) if reverse else (x, c)
    dt = x.dtype if x.dtype in FLOATS or isinstance(v, int) else "float32"
    return self._binary_node(op, a, b, dt, (x,), (v, reverse))

  def where(self, x, pool):
    r = self.rng
    conds = [p for p in pool if p.dtype == "bool" and _broadcasts(p.shape, x.shape)]
    if not conds:
      if not x.exact or x.dtype == "bool": raise _Skip()
      cond = self._node("scalar", ("gt", 0, False), (x,), True, 0, 1)
    else: cond = r.choice(conds)
    a, b = self._partner(cond, pool), self._partner(cond, pool)
    exact = a.exact and b.exact
    return self._node("where", (), (cond, a, b), exact, min(a.lo, b.lo), max(a.hi, b.hi))

  def cast(self, x, pool):
    r = self.rng
    dt = r.choice(self.dtypes)
    if dt == x.dtype: raise _Skip()
    if dt in INTS + ("bool",) and not x.exact: raise _Skip()
    if dt in INTS and not (np.iinfo(dt).min <= x.lo and x.hi <= np.iinfo(dt).max): raise _Skip()
    exact = x.exact and (dt not in FLOATS or max(abs(x.lo), abs(x.hi)) <= EXACT_LIMIT[dt])
    lo, hi = (0, 1) if dt == "bool" else (x.lo, x.hi)
    if dt == "float16" and max(abs(x.lo), abs(x.hi)) > 6e4: raise _Skip()
    return self._node("cast", (dt,), (x,), exact, lo, hi)

  def movement(self, x, pool):
    r = self.rng
    kind = r.choice(["reshape", "permute", "expand", "pad", "pad", "shrink", "flip", "flip", "getitem", "getitem"])
    s = x.shape
    if kind == "reshape":
      n = math.prod(s)
      shape = _factor(n, r)
      return self._node("reshape", (shape,), (x,), x.exact, x.lo, x.hi)
    if not s: raise _Skip()
    if kind == "permute":
      order = list(range(len(s))); r.shuffle(order)
      return self._node("permute", (tuple(order),), (x,), x.exact, x.lo, x.hi)
    if kind == "expand":
      if 1 not in s: x = self._node("reshape", ((1,) + s,), (x,), x.exact, x.lo, x.hi); s = x.shape
      shape = tuple(r.choice([2, 3, 4]) if d == 1 else d for d in s)
      return self._node("expand", (shape,), (x,), x.exact, x.lo, x.hi)
    if kind == "pad":
      pads = tuple((r.choice([0, 0, 1, 2, 3]), r.choice([0, 0, 1, 2])) for _ in s)
      if x.dtype == "bool": v = r.choice([False, True])
      elif x.dtype in INTS: v = r.choice([0, 1, 2] + ([] if x.dtype == "uint8" else [-1, -7]))
      else: v = r.choice([0.0, -0.0, 1.5, -2.0, -1.0, 3.0])
      return self._node("pad", (pads, v), (x,), x.exact, min(x.lo, float(v)), max(x.hi, float(v)))
    if kind == "shrink":
      bounds = tuple(tuple(sorted((r.randint(0, d), r.randint(0, d)))) for d in s)
      return self._node("shrink", (bounds,), (x,), x.exact, x.lo, x.hi)
    if kind == "flip":
      axes = tuple(sorted(r.sample(range(len(s)), r.randint(1, len(s)))))
      return self._node("flip", (axes,), (x,), x.exact, x.lo, x.hi)
    index = []
    for d in s:
      c = r.random()
      if c < 0.2 and d: index.append(r.randrange(-d, d))
      elif c < 0.3: index.append(None)
      else:
        step = r.choice([1, 1, 2, 3, -1, -2])
        start, stop = r.choice([None, r.randint(-d, d)]), r.choice([None, r.randint(-d, d)])
        index.append(slice(start, stop, None if step == 1 else step))
    index = tuple(index[:r.randint(1, len(index))])
    return self._node("getitem", (index,), (x,), x.exact, x.lo, x.hi)

  def reduce(self, x, pool):
    r = self.rng
    if not x.shape or 0 in x.shape: raise _Skip()
    op = r.choice(["sum", "sum", "max", "min", "mean", "argmax", "argmin"] if x.dtype != "bool" else ["any", "all", "sum"])
    if op in ("argmax", "argmin") and not x.exact: raise _Skip()
    if op == "mean" and x.dtype not in FLOATS: raise _Skip()
    axis = r.choice([None, r.randrange(len(x.shape))] + ([tuple(sorted(r.sample(range(len(x.shape)), 2)))] if len(x.shape) > 1 and op not in ("argmax", "argmin") else []))
    n = math.prod(x.shape) if axis is None else math.prod(x.shape[a] for a in ((axis,) if isinstance(axis, int) else axis))
    keep = r.random() < 0.3
    if op == "sum": lo, hi, exact = min(x.lo * n, x.lo), max(x.hi * n, x.hi), x.exact
    elif op == "mean": lo, hi, exact = x.lo, x.hi, False
    elif op in ("argmax", "argmin"): lo, hi, exact = 0, n, True
    elif op in ("any", "all"): lo, hi, exact = 0, 1, True
    else: lo, hi, exact = x.lo, x.hi, x.exact
    if op == "sum" and x.dtype in ("int8", "int16", "uint8", "bool", "int32") and not (-2 ** 31 < lo and hi < 2 ** 31): raise _Skip()
    return self._node("reduce", (op, axis, keep), (x,), exact, lo, hi)

  def matmul(self, x, pool):
    r = self.rng
    if x.dtype not in FLOATS + ("int32", "int64") or not x.shape: raise _Skip()
    k = x.shape[-1]
    w = self.leaf(tuple(r.choice([1, 3, 4, 5]) for _ in range(r.choice([0, 0, 1]))) + (k, r.choice([1, 2, 3, 5, 8])) if r.random() < 0.8 else (k,), x.dtype)
    m = max(abs(x.lo), abs(x.hi)) * max(abs(w.lo), abs(w.hi)) * k
    a, b = (x, w)
    return self._node("matmul", (), (a, b), x.exact and w.exact, -m, m)

  def cat(self, x, pool):
    r = self.rng
    if not x.shape: raise _Skip()
    ax = r.randrange(len(x.shape))
    shape = tuple(r.choice([1, 2, 3]) if d == ax else s for d, s in enumerate(x.shape))
    y = self.leaf(shape, x.dtype if r.random() < 0.7 else r.choice(self.dtypes))
    return self._node("cat", (ax,), (x, y), x.exact and y.exact, min(x.lo, y.lo), max(x.hi, y.hi))

  def setitem(self, x, pool):
    r = self.rng
    if not x.shape: raise _Skip()
    index = self._index(x.shape)
    with np.errstate(all="ignore"): sel = np.empty(x.shape)[index].shape
    if r.random() < 0.4:
      v = r.choice([0, 1, -1, 2]) if x.dtype in INTS else r.choice([False, True]) if x.dtype == "bool" else r.choice([-0.5, 2.0, -3.0])
      if x.dtype == "uint8" and v < 0: raise _Skip()
      return self._node("setitem", (index, x.dtype, v), (x,), x.exact, min(x.lo, float(v)), max(x.hi, float(v)))
    shape = sel[r.randint(0, len(sel)):] if r.random() < 0.3 else sel
    y = self.leaf(shape, x.dtype)
    return self._node("setitem", (index, x.dtype), (x, y), x.exact and y.exact, min(x.lo, y.lo), max(x.hi, y.hi))

  def assign(self, x, pool):
    ok = [p for p in pool if p is not x and p.dtype == x.dtype and _broadcasts(p.shape, x.shape) and
          p.shape == x.shape]  # (Graft refuses to broadcast an assign, with a clear error)
    if not ok: raise _Skip()
    y = self.rng.choice(ok)
    return self._node("assign", (x.dtype,), (x, y), y.exact, y.lo, y.hi)


  def inplace(self, x, pool):
    """x itself written (t[index] = value or t.assign(value)): every view of it, in numpy and in Graft, sees it. The
    values written lie within x's interval and are exact where x is, so what is known of x and its views stays true."""
    r = self.rng
    if not x.shape or 0 in x.shape: raise _Skip()
    fits = lambda n: n.dtype == x.dtype and x.lo <= n.lo and n.hi <= x.hi and (n.exact or not x.exact)
    if r.random() < 0.3:
      ok = [p for p in pool if p is not x and p.shape == x.shape and fits(p)]
      if not ok: raise _Skip()
      return self._node("inplace", (None, x.dtype), (x, r.choice(ok)), x.exact, x.lo, x.hi)
    index = self._index(x.shape)
    with np.errstate(all="ignore"): sel = np.empty(x.shape)[index].shape
    if r.random() < 0.5:
      v = r.choice([x.lo, x.hi, math.floor((x.lo + x.hi) / 2)])
      v = bool(v) if x.dtype == "bool" else int(v) if x.dtype in INTS else float(v)
      return self._node("inplace", (index, x.dtype, v), (x,), x.exact, x.lo, x.hi)
    ok = [p for p in pool if p is not x and fits(p) and _broadcasts(p.shape, sel) and np.broadcast_shapes(p.shape, sel) == sel]
    if not ok: raise _Skip()
    return self._node("inplace", (index, x.dtype), (x, r.choice(ok)), x.exact, x.lo, x.hi)

  # -- the operations a model script needs (issue 21)
  def model(self, x, pool):
    kind = self.rng.choice(["nn", "nn", "nn", "cumsum", "triangle", "masked_fill", "gather", "take", "attention", "linear",
                            "norm_linear"])
    if not x.shape or 0 in x.shape: raise _Skip()
    return getattr(self, "_" + kind)(x, pool)

  def _nn(self, x, pool):
    """softmax, log_softmax, logsumexp or layernorm along one axis, of values small enough that their rounding stays
    within the tolerance (layernorm divides by a spread: of exact values or an input's only)."""
    r = self.rng
    if x.dtype not in FLOATS or max(abs(x.lo), abs(x.hi)) > 20: raise _Skip()
    name = r.choice(["softmax", "log_softmax", "logsumexp", "layernorm"] if x.exact or x.op == "input" else
                    ["softmax", "log_softmax", "logsumexp"])
    axis = r.randrange(-len(x.shape), len(x.shape))
    n, spread = x.shape[axis], x.hi - x.lo
    lo, hi = {"softmax": (0, 1), "log_softmax": (-spread - math.log(n) - 1, 0),
              "logsumexp": (x.lo, x.hi + math.log(n) + 1), "layernorm": (-math.sqrt(n) - 1, math.sqrt(n) + 1)}[name]
    return self._node("nn", (name, axis), (x,), False, lo, hi)

  def _cumsum(self, x, pool):
    axis = self.rng.randrange(-len(x.shape), len(x.shape))
    n = x.shape[axis]
    lo, hi = min(x.lo * n, x.lo), max(x.hi * n, x.hi)
    if str(_sum_dtype(np.dtype(x.dtype))) == "int32" and not (-2 ** 31 < lo and hi < 2 ** 31): raise _Skip()
    return self._node("cumsum", (axis,), (x,), x.exact, lo, hi)

  def _triangle(self, x, pool):
    if len(x.shape) < 2: raise _Skip()
    args = (self.rng.choice(["tril", "triu"]), self.rng.randint(-2, 2))
    return self._node("triangle", args, (x,), x.exact, min(x.lo, 0), max(x.hi, 0))

  def _masked_fill(self, x, pool):
    r = self.rng
    masks = [p for p in pool if p.dtype == "bool" and _broadcasts(p.shape, x.shape) and np.broadcast_shapes(p.shape, x.shape) == x.shape]
    mask = r.choice(masks) if masks and r.random() < 0.7 else self.leaf(x.shape[r.randint(0, len(x.shape)):], "bool")
    v = (r.choice([False, True]) if x.dtype == "bool" else r.choice([0, 1, 3] + ([] if x.dtype == "uint8" else [-1, -4]))
         if x.dtype in INTS else r.choice([-1e4, -3.5, 0.0, 2.0]))
    return self._node("masked_fill", (v,), (x, mask), x.exact, min(x.lo, float(v)), max(x.hi, float(v)))

  def _index_tensor(self, shape, n: int, negative: bool = False):
    """An integer tensor of `shape` whose values index an axis of n: in 0..n-1, or -n..-1 (numpy counts from the end)."""
    idx = self._node("scalar", ("mod", n, False), (self.leaf(shape, self.rng.choice(["int8", "int32", "int64"])),), True, 0, n - 1)
    return self._node("scalar", ("sub", n, False), (idx,), True, -n, -1) if negative else idx

  def _gather(self, x, pool):
    r = self.rng
    axis = r.randrange(len(x.shape))
    shape = tuple(r.choice([1, 2, 3, 4]) if d == axis else s if r.random() < 0.8 else 1 for d, s in enumerate(x.shape))
    return self._node("gather", (axis,), (x, self._index_tensor(shape, x.shape[axis])), x.exact, x.lo, x.hi)

  def _take(self, x, pool):
    r = self.rng
    shape = tuple(r.choice([1, 2, 3, 5]) for _ in range(r.choice([0, 1, 1, 2])))
    return self._node("take", (), (x, self._index_tensor(shape, x.shape[0], r.random() < 0.3)), x.exact, x.lo, x.hi)

  def _float_leaf(self, shape, dtype, bound=6.0):
    """An input of floats of `dtype` whose values lie within +-bound (exact small integers or not)."""
    leaf = self.leaf(shape, dtype)
    if leaf.op == "full" or max(abs(leaf.lo), abs(leaf.hi)) > bound: raise _Skip()
    return leaf

  def _model_dtype(self, x):
    return x.dtype if x.dtype in FLOATS else self.rng.choice(("float32", "float32", "float16", "float64"))

  def _attention(self, x, pool):
    """softmax(q @ kᵀ * scale + mask) @ v over heads, lengths and head sizes past a kernel's tiles, q often x. The
    scale keeps every score within +-20 (+-6 in float16), where the tolerance holds; a causal mask always leaves a
    row a key (a fully masked row is NaN in numpy and torch alike, and is no model's)."""
    r = self.rng
    dt = self._model_dtype(x)
    if x.dtype == dt and len(x.shape) >= 2 and r.random() < 0.4: q = x
    else: q = self._float_leaf(tuple(r.choice([1, 2, 3]) for _ in range(r.choice([0, 1, 2]))) +
                               (r.choice([1, 2, 5, 8, 17, 33, 64]), r.choice([1, 3, 8, 16, 17, 32, 64])), dt)
    *batch, tq, d = q.shape
    tk = r.choice([1, 3, 8, 17, 31, 64, 65, 130])
    k = self._float_leaf((*batch[r.randint(0, len(batch)):], tk, d), dt)
    v = self._float_leaf((*k.shape[:-1], r.choice([1, 4, 16, 17, 64])), dt)
    worst = max(abs(q.lo), abs(q.hi), 1e-3) * max(abs(k.lo), abs(k.hi), 1e-3) * d
    scale = min(r.choice([1 / math.sqrt(d), 0.125, 0.5]), (6 if dt == "float16" else 20) / worst)
    kind = r.choice(["none", "add", "fill", "causal", "causal"])
    srcs = [q, k, v]
    arg = None
    if kind == "add": srcs.append(self._float_leaf((tq, tk)[r.randint(0, 1):] if r.random() < 0.8 else (tq, 1), dt, 5))
    elif kind == "fill":
      srcs.append(self.leaf((tq, tk)[r.randint(0, 1):], "bool"))
      arg = r.choice([-1e4, -30.0, 0.0])
    elif kind == "causal": arg = r.choice([0, 0, 2]) + max(tk - tq, 0) * (r.random() < 0.5)
    lo, hi = min(v.lo, 0), max(v.hi, 0)
    return self._node("attention", (scale, kind, arg), srcs, False, lo, hi)

  def _linear(self, x, pool):
    """(x @ W + b).act() (+ a residual): a product with its epilogue, at sizes past the register tiles and panels."""
    r = self.rng
    dt = self._model_dtype(x)
    if x.dtype == dt and x.shape and x.shape[-1] <= 96 and r.random() < 0.4 and max(abs(x.lo), abs(x.hi)) <= 6: a = x
    else: a = self._float_leaf((r.choice([1, 3, 8, 17, 33, 64, 65]), r.choice([1, 5, 16, 31, 64, 96])), dt)
    n = r.choice([1, 4, 16, 24, 33, 64, 100])
    w, b = self._float_leaf((a.shape[-1], n), dt), self._float_leaf((n,) if r.random() < 0.8 else (1,), dt)
    act = r.choice(["none", "relu", "gelu", "silu"])
    srcs = [a, w, b]
    out = np.broadcast_shapes(a.shape[:-1] + (n,))
    if r.random() < 0.4: srcs.append(self._float_leaf(out[r.randint(0, len(out) - 1):], dt))
    m = max(abs(a.lo), abs(a.hi)) * max(abs(w.lo), abs(w.hi)) * a.shape[-1] + max(abs(b.lo), abs(b.hi)) + \
      (max(abs(srcs[3].lo), abs(srcs[3].hi)) if len(srcs) > 3 else 0)
    exact = act in ("none", "relu") and all(s.exact for s in srcs) and dt != "float16"
    return self._node("linear", (act,), srcs, exact, -m, m)

  def _norm_linear(self, x, pool):
    """layernorm(x) (scaled and shifted or not) read by a product: the norm as the product's prologue."""
    r = self.rng
    dt = self._model_dtype(x)
    if x.dtype == dt and x.shape and 2 <= x.shape[-1] <= 96 and r.random() < 0.4 and (x.exact or x.op == "input"): a = x
    else: a = self._float_leaf((r.choice([1, 3, 8, 17, 64]), r.choice([2, 5, 16, 33, 64, 96])), dt)
    if max(abs(a.lo), abs(a.hi)) > 20: raise _Skip()
    kk, n = a.shape[-1], r.choice([1, 4, 16, 33, 64])
    srcs = [a, self._float_leaf((kk, n), dt)]
    if r.random() < 0.5: srcs += [self._float_leaf((kk,), dt, 2), self._float_leaf((kk,), dt, 2)]
    m = (math.sqrt(kk) + 1) * (3 if len(srcs) > 2 else 1) * max(abs(srcs[1].lo), abs(srcs[1].hi)) * kk
    return self._node("norm_linear", (), srcs, False, -m, m)

  def _index(self, shape):
    r = self.rng
    index = []
    for d in shape:
      if r.random() < 0.25 and d: index.append(r.randrange(-d, d))
      else:
        step = r.choice([1, 1, 2, -1])
        index.append(slice(r.choice([None, r.randint(0, d)]), r.choice([None, r.randint(-d, d)]), None if step == 1 else step))
    return tuple(index[:r.randint(1, len(index))])


class _Skip(Exception):
  """This op does not apply here: the generator tries another."""


def _broadcasts(a, b) -> bool:
  try: np.broadcast_shapes(a, b); return True
  except ValueError: return False


def _factor(n: int, r: random.Random) -> tuple[int, ...]:
  """A random shape of n elements."""
  dims = []
  while n > 1 and len(dims) < 3:
    divs = [d for d in range(2, n + 1) if n % d == 0]
    d = r.choice(divs)
    dims.append(d); n //= d
  if n > 1: dims.append(n)
  dims += [1] * r.choice([0, 0, 1])
  r.shuffle(dims)
  return tuple(dims)
