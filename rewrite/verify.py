"""verify: check that each rule over integer and boolean arithmetic keeps the meaning of what it rewrites.

For every rule, random instances of its pattern are built (variables become `DEFINE_VAR`s with random bounds,
unconstrained constants random values), the rule is applied, and the instance and the rule's result are evaluated on
many random assignments of the variables within their bounds, with C semantics (integer division truncates, results
wrap to the dtype's width). Any difference is a counterexample, reported with the rule's file:line.
"""
from __future__ import annotations
import random
from dataclasses import dataclass
from .ops import Ops
from .dtypes import DType, dtypes
from .uop import UOp
from .upat import UPat, _ANY
from .matcher import PatternMatcher, Rule

_INT_OPS = (Ops.ADD, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.AND, Ops.OR, Ops.XOR, Ops.NEG)
_BOOL_OPS = (Ops.CMPLT, Ops.CMPNE)


@dataclass
class Counterexample:
  rule: str
  location: str
  before: UOp
  after: UOp
  assignment: dict[str, int]
  expected: int | bool | str
  got: int | bool | str

  def __str__(self):
    values = ", ".join(f"{k}={v}" for k, v in self.assignment.items())
    return (f"{self.location}: rule {self.rule} changes the value: with {values or 'no variables'} the pattern gives "
            f"{self.expected} but the rewrite gives {self.got}\n  before: {_expr(self.before)}\n  after:  {_expr(self.after)}")


class VerifyError(AssertionError):
  def __init__(self, found: list[Counterexample]):
    super().__init__(f"{len(found)} rule(s) change meaning:\n" + "\n".join(map(str, found)))
    self.counterexamples = found


def verify(matcher: PatternMatcher, instances: int = 60, assignments: int = 20, seed: int = 0,
           raise_on_failure: bool = True) -> list[Counterexample]:
  """Counterexamples to the rules of `matcher` (at most one per rule); raise VerifyError if any, unless told not to."""
  rng = random.Random(seed)
  found: list[Counterexample] = []
  for rule in matcher.rules:
    if rule.wants_ctx: continue  # a rule that reads its context cannot be exercised out of one
    for alt in rule.pattern.expand_alternatives():
      cx = _check_rule(rule, alt, rng, instances, assignments)
      if cx is not None: found.append(cx); break
  if found and raise_on_failure: raise VerifyError(found)
  return found


def _check_rule(rule: Rule, pat: UPat, rng: random.Random, instances: int, assignments: int) -> Counterexample | None:
  single = PatternMatcher._from_rules([rule])
  for _ in range(instances):
    try: before = _instance(pat, rng, {}, None, [0])
    except _Unbuildable: return None
    if before is None or not (before.dtype.is_int or before.dtype.is_bool): continue
    try: after = single.rewrite(before)
    except Exception as e:
      return Counterexample(rule.name, rule.location, before, before, {}, "a rewrite", f"{type(e).__name__}: {e}")
    if after is None or after is before: continue
    variables = [n for n in before.toposort if n.op is Ops.DEFINE_VAR]
    for _ in range(assignments):
      env = {v: rng.randint(v.arg[1], v.arg[2]) for v in variables}
      try: expected = evaluate(before, env)
      except ZeroDivisionError: continue
      try: got = evaluate(after, env)
      except ZeroDivisionError: got = "division by zero"
      except KeyError as e: got = f"a variable the pattern did not have: {e}"
      if got != expected:
        return Counterexample(rule.name, rule.location, before, after, {v.arg[0]: env[v] for v in variables}, expected, got)
  return None


class _Unbuildable(Exception):
  """The pattern names ops that are not integer or boolean arithmetic: nothing to verify."""


def _instance(p: UPat, rng: random.Random, bound: dict[str, UOp], want: DType | None, counter: list) -> UOp | None:
  if p.name and p.name in bound: return bound[p.name]
  dtype = _pick_dtype(p, want, rng)
  if p.op is None:
    if counter[0] > 0 and not dtype.is_bool and rng.random() < 0.4: u = _random_expr(rng, counter, dtype)
    else: u = _variable(rng, dtype, counter)
    if p.name: bound[p.name] = u
    return u
  elif p.op == frozenset({Ops.CONST}):
    value = p.arg if p.arg is not _ANY else (rng.random() < .5 if dtype.is_bool else rng.choice((0, 1, -1, 2, 3, 4, 5, 7, 8, 16, -3, 12)))
    if dtype.is_unsigned and not isinstance(value, bool) and value < 0: value = -value
    u = UOp.const(dtype, value)
  else:
    ops = [o for o in p.op if o in _INT_OPS + _BOOL_OPS + (Ops.WHERE, Ops.CAST)]
    if not ops: raise _Unbuildable
    op = rng.choice(ops)
    if want is None and p.dtype is None and op in (Ops.AND, Ops.OR, Ops.XOR): dtype = rng.choice((dtypes.int32, dtypes.bool))
    if dtype.is_bool and op in (Ops.ADD, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.NEG): return None
    n = {Ops.NEG: 1, Ops.CAST: 1, Ops.WHERE: 3}.get(op, 2)
    subs = p.src if p.src is not None else (UPat(),) * n
    if p.src_kind == "each": subs = subs * n
    if len(subs) < n and not p.allow_any_len: return None
    subs = subs[:n] if len(subs) >= n else subs + (UPat(),) * (n - len(subs))
    if op in _BOOL_OPS: src_want = [dtypes.int32, dtypes.int32]
    elif op is Ops.WHERE: src_want = [dtypes.bool, dtype, dtype]
    elif op is Ops.CAST: src_want = [rng.choice((dtypes.int32, dtypes.bool))]
    else: src_want = [dtype] * n
    srcs = []
    for sp, w in zip(subs, src_want):
      s = _instance(sp, rng, bound, w, counter)
      if s is None: return None
      srcs.append(s)
    if op in _BOOL_OPS and srcs[0].dtype is not srcs[1].dtype: return None
    if op not in _BOOL_OPS and op is not Ops.CAST and any(s.dtype is not dtype for s in srcs[-2:] if op is not Ops.WHERE or s is not srcs[0]): return None
    u = UOp(op, dtypes.bool if op in _BOOL_OPS else dtype, tuple(srcs))
  if p.name: bound[p.name] = u
  return u


def _variable(rng: random.Random, dtype: DType, counter: list[int]) -> UOp:
  lo = rng.randint(-12, 12)
  hi = lo + rng.choice((0, 1, 3, 7, 20, 40))
  if dtype.is_bool: lo, hi = False, True
  elif dtype.is_unsigned: lo, hi = abs(lo), abs(lo) + hi - lo
  counter[0] += 1
  counter.append(UOp(Ops.DEFINE_VAR, dtype, (), (f"v{counter[0]}", lo, hi)))  # the instance's variables follow the count
  return counter[-1]


def _random_expr(rng: random.Random, counter: list, dtype: DType) -> UOp:
  """A small sum of multiples of variables already in the instance, so that like terms and index shapes occur."""
  pool = [u for u in counter[1:] if u.dtype is dtype]
  if not pool: return UOp.const(dtype, rng.randint(-4, 9))
  out = rng.choice(pool) * rng.choice((1, 2, 3, 4, 8, -1))
  if rng.random() < 0.6: out = out + rng.choice(pool) * rng.choice((1, 3, 16))
  return out + rng.randint(-3, 9) if rng.random() < 0.5 else out


def _pick_dtype(p: UPat, want: DType | None, rng: random.Random) -> DType:
  if p.op is not None and p.op <= frozenset(_BOOL_OPS): return dtypes.bool
  if p.dtype is not None:
    choices = sorted((d for d in p.dtype if isinstance(d, DType) and (d.is_int or d.is_bool)), key=lambda d: d.name)
    if not choices: raise _Unbuildable
    return want if want in choices else rng.choice(choices)
  return want or dtypes.int32


def _wrap(dtype: DType, v):
  if dtype.is_bool: return bool(v)
  bits = 8 * dtype.itemsize
  v &= (1 << bits) - 1
  return v - (1 << bits) if not dtype.is_unsigned and v >= 1 << (bits - 1) else v


def _cdiv(a: int, b: int) -> int:
  if b == 0: raise ZeroDivisionError
  q = abs(a) // abs(b)
  return q if (a >= 0) == (b > 0) else -q


_EVAL = {
  Ops.ADD: lambda a, b: a + b, Ops.MUL: lambda a, b: a * b, Ops.NEG: lambda a: -a, Ops.MAX: max,
  Ops.IDIV: _cdiv, Ops.MOD: lambda a, b: a - b * _cdiv(a, b),
  Ops.CMPLT: lambda a, b: a < b, Ops.CMPNE: lambda a, b: a != b,
  Ops.AND: lambda a, b: a & b, Ops.OR: lambda a, b: a | b, Ops.XOR: lambda a, b: a ^ b,
  Ops.SHL: lambda a, b: a << b, Ops.SHR: lambda a, b: a >> b, Ops.WHERE: lambda c, a, b: a if c else b,
}


def evaluate(u: UOp, env: dict[UOp, int]) -> int | bool:
  """The value of an integer/boolean expression, C semantics, variables from env."""
  values: dict[UOp, int | bool] = {}
  for n in u.toposort:
    if n.op is Ops.CONST: values[n] = _wrap(n.dtype, n.arg) if n.dtype.is_int else n.arg  # C reads -1u as 2**32-1
    elif n.op is Ops.DEFINE_VAR: values[n] = env[n]
    elif n.op is Ops.CAST: values[n] = _wrap(n.dtype, int(values[n.src[0]]))
    elif n.op in _EVAL: values[n] = _wrap(n.dtype, _EVAL[n.op](*(values[s] for s in n.src)))
    else: raise ValueError(f"verify cannot evaluate {n.op}")
  return values[u]


def _expr(u: UOp) -> str:
  sym = {Ops.ADD: "+", Ops.MUL: "*", Ops.IDIV: "//", Ops.MOD: "%", Ops.CMPLT: "<", Ops.CMPNE: "!=", Ops.AND: "&",
         Ops.OR: "|", Ops.XOR: "^", Ops.SHL: "<<", Ops.SHR: ">>"}
  text: dict[UOp, str] = {}
  for n in u.toposort:
    s = [text[x] for x in n.src]
    if n.op is Ops.CONST: text[n] = repr(n.arg)
    elif n.op is Ops.DEFINE_VAR: text[n] = f"{n.arg[0]}[{n.arg[1]}..{n.arg[2]}]"
    elif n.op in sym: text[n] = f"({s[0]} {sym[n.op]} {s[1]})"
    elif n.op is Ops.WHERE: text[n] = f"({s[0]} ? {s[1]} : {s[2]})"
    else: text[n] = f"{n.op.name.lower()}({', '.join(s)})"
  return text[u]
