"""PatternMatcher: rules `(UPat, function)`, indexed by root op and compiled into straight-line Python.

Each root op gets one generated function holding the checks of every rule that can match it, so that matching a
node walks no pattern tree and makes no call until a rule's function runs. Inside it, the node's sources are
unpacked once for all rules, and the function branches on the ops of those sources (a decision tree that keeps
the rules' order among the rules that can still match), so a node usually meets only the few rules that concern
it. The generated source is kept (`PatternMatcher.source(op)`) for whoever wants to read it.
"""
from __future__ import annotations
import inspect, itertools, time
from dataclasses import dataclass
from typing import Any, Callable
from .ops import Ops
from .upat import UPat, _ANY, caller_location


@dataclass(eq=False)
class Rule:
  """One rule: its pattern, its function, and what the function takes."""
  pattern: UPat
  fn: Callable
  name: str
  location: str                    # file:line of the rule's function (or of the rule list)
  params: tuple[str, ...]          # captured names passed positionally, in the function's order
  wants_ctx: bool
  kwparams: tuple[str, ...] = ()   # captured names passed by keyword (keyword-only parameters, **kwargs)
  fn_time: float = 0.0             # seconds spent in fn, accumulated by the timed matchers only

  def timed_fn(self) -> Callable:
    perf, fn = time.perf_counter, self.fn
    def call(*args, **kwargs):
      t0 = perf()
      try: return fn(*args, **kwargs)
      finally: self.fn_time += perf() - t0
    return call

  def __repr__(self): return f"<rule {self.name} at {self.location}>"


def _describe_fn(fn: Callable, fallback: str) -> tuple[str, str]:
  code = getattr(fn, "__code__", None)
  loc = f"{code.co_filename}:{code.co_firstlineno}" if code is not None else fallback
  name = getattr(fn, "__name__", type(fn).__name__)
  return name, loc


def _make_rule(pat: UPat, fn: Callable, where: str, given_name: str | None = None) -> Rule:
  if not isinstance(pat, UPat): raise ValueError(f"{where}: a rule is (UPat, function); got {type(pat).__name__} as the pattern")
  if not callable(fn): raise ValueError(f"{where}: a rule is (UPat, function); got {type(fn).__name__} as the function")
  name, loc = _describe_fn(fn, where)
  if given_name is not None: name = given_name
  elif name == "<lambda>": name = repr(pat) if len(repr(pat)) <= 60 else repr(pat)[:57] + "..."
  try: sig = inspect.signature(fn)
  except (TypeError, ValueError): sig = None
  params: list[str] = []
  kwparams: list[str] = []
  wants_ctx = False
  var_kw = False
  alternatives = pat.expand_alternatives()
  for alt in alternatives: _check_repeated_names(alt, loc)
  if sig is not None:
    gap = False  # once a parameter is not passed positionally (ctx, or a skipped default), the rest go by keyword
    for p in sig.parameters.values():
      if p.kind is p.VAR_KEYWORD: var_kw = True; continue
      if p.kind is p.VAR_POSITIONAL: gap = True; continue
      if p.name == "ctx": wants_ctx = gap = True; continue
      for alt in alternatives:
        if p.name not in alt.names() and p.default is p.empty:
          raise ValueError(f"{loc}: rule {name} takes parameter {p.name!r}, which its pattern {alt!r} does not bind "
                           f"(it binds {sorted(alt.names()) or 'nothing'})")
      if not all(p.name in alt.names() for alt in alternatives): gap = True; continue
      if gap or p.kind is p.KEYWORD_ONLY: kwparams.append(p.name)
      else: params.append(p.name)
  if var_kw: kwparams += sorted(set.intersection(*(a.names() for a in alternatives)) - set(params) - set(kwparams))
  return Rule(pat, fn, name, loc, tuple(params), wants_ctx, kwparams=tuple(kwparams))


def _check_repeated_names(pat: UPat, loc: str):
  """A name used twice must be able to bind one node: compatible constraints, and never its own ancestor."""
  seen: dict[str, list[tuple[UPat, tuple[UPat, ...]]]] = {}
  stack: list[tuple[UPat, tuple[UPat, ...]]] = [(pat, ())]
  while stack:
    p, ancestors = stack.pop()
    if p.name: seen.setdefault(p.name, []).append((p, ancestors))
    for s in p.src or (): stack.append((s, ancestors + (p,)))
  for name, uses in seen.items():
    for (a, anc_a), (b, anc_b) in itertools.combinations(uses, 2):
      why = None
      if a in anc_b or b in anc_a: why = "a node cannot be its own source"
      elif a.op is not None and b.op is not None and not (a.op & b.op): why = f"ops {sorted(o.name for o in a.op)} and {sorted(o.name for o in b.op)} never agree"
      elif a.dtype is not None and b.dtype is not None and not (a.dtype & b.dtype): why = "dtypes never agree"
      elif a.arg is not _ANY and b.arg is not _ANY and a.arg != b.arg: why = f"args {a.arg!r} and {b.arg!r} differ"
      if why: raise ValueError(f"{loc}: name {name!r} is used twice in pattern {pat!r} but cannot bind one node: {why}")


class _Codegen:
  """Emits the Python checks of one pattern, bound to one rule, into a function body."""

  def __init__(self, consts: dict[str, Any], prefix: str):
    self.lines: list[str] = []
    self.consts, self.prefix, self.nvars = consts, prefix, 0

  def const(self, value) -> str:
    # one global name per distinct object (an op, a dtype, an arg), shared by every rule of the function
    return _kname(self.consts, value)

  def var(self) -> str:
    self.nvars += 1
    return f"{self.prefix}v{self.nvars}"

  def emit(self, depth: int, line: str): self.lines.append("  " * depth + line)

  def pattern(self, p: UPat, v: str, depth: int, fail: str, bound: dict[str, str], skip_op: bool, each: set[str]) -> int:
    """Emit checks that node `v` matches `p`; return the depth at which the remaining code goes."""
    if p.op is not None and not skip_op:
      if len(p.op) == 1: self.emit(depth, f"if {v}.op is not {self.const(next(iter(p.op)))}: {fail}")
      else: self.emit(depth, f"if {v}.op not in {self.const(p.op)}: {fail}")
    if p.dtype is not None:
      if len(p.dtype) == 1: self.emit(depth, f"if {v}.dtype is not {self.const(next(iter(p.dtype)))}: {fail}")
      else: self.emit(depth, f"if {v}.dtype not in {self.const(p.dtype)}: {fail}")
    if p.arg is not _ANY: self.emit(depth, f"if {v}.arg != {self.const(p.arg)}: {fail}")
    if p.name:
      if p.name in each:  # inside an every-source loop: bind once, then every source must be that node
        self.emit(depth, f"if {bound[p.name]} is None: {bound[p.name]} = {v}")
        self.emit(depth, f"elif {v} is not {bound[p.name]}: {fail}")
      elif p.name in bound: self.emit(depth, f"if {v} is not {bound[p.name]}: {fail}")
      else: bound[p.name] = v
    if p.src is None: return depth
    n = len(p.src)
    if p.src_kind == "each":
      sub = p.src[0]
      if any(q.src_kind in ("any_order", "each") for q in _walk(sub)):
        raise ValueError(f"pattern {p!r}: a pattern every source must match cannot itself hold unordered sources")
      for name in sorted(sub.names() - set(bound)):
        bound[name] = f"{self.prefix}{name}"
        self.emit(depth, f"{bound[name]} = None")
        each = each | {name}
      s, ok = self.var(), self.var()
      self.emit(depth, f"{ok} = True")
      self.emit(depth, f"for {s} in {v}.src:")
      self.pattern(sub, s, depth + 1, f"{ok} = False; break", bound, False, each)
      self.emit(depth, f"if not {ok}: {fail}")
      return depth
    self.emit(depth, f"if len({v}.src) {'<' if p.allow_any_len else '!='} {n}: {fail}")
    names = [self.var() for _ in range(n)]
    if p.src_kind == "any_order" and n > 1:
      if n == 2: self.emit(depth, f"for {names[0]}, {names[1]} in (({v}.src[0], {v}.src[1]), ({v}.src[1], {v}.src[0])):")
      else: self.emit(depth, f"for {', '.join(names)} in {self.const(itertools.permutations)}({v}.src[:{n}]):")
      depth, fail = depth + 1, "continue"
    elif p.allow_any_len:
      for i, nm in enumerate(names): self.emit(depth, f"{nm} = {v}.src[{i}]")
    else: self.emit(depth, f"{', '.join(names)}{',' if n == 1 else ''} = {v}.src")
    for sub, nm in zip(p.src, names): depth = self.pattern(sub, nm, depth, fail, bound, False, each)
    return depth


# Patterns are compiled two ways. The common shape (in-order sources, and small any-order source lists) becomes
# straight-line code: one `if` per (alternative, ordering of unordered sources) whose condition is a chain of `and`ed
# checks, breadth first so that the cheapest tests (ops of the root's sources) come first and a failing rule costs a
# few bytecodes. Patterns with an every-source UPat, or too many orderings, use _Codegen's loops.
_MAX_ORDERINGS = 24


def _orderings(p: UPat) -> int:
  """How many straight-line copies p needs (one per combination of orderings of its any-order source lists)."""
  if p.src is None: return 1
  if p.src_kind == "each": return _MAX_ORDERINGS + 1
  n = 1
  if p.src_kind == "any_order":
    for k in range(2, len(p.src) + 1): n *= k
  for q in p.src: n *= _orderings(q)
  return n


def _choices(p: UPat) -> list[list[tuple[int, ...]]]:
  """Every way to order p's any-order source lists: a list of permutations, in pre-order of p's nodes."""
  out: list[list[tuple[int, ...]]] = [[]]
  stack = [p]
  order: list[UPat] = []
  while stack:  # pre-order, the order in which the loop form would nest its loops
    q = stack.pop()
    order.append(q)
    stack.extend(reversed(q.src or ()))
  for q in order:
    if q.src_kind == "any_order" and len(q.src) > 1:
      out = [c + [perm] for c in out for perm in itertools.permutations(range(len(q.src)))]
  return out


def _straight(cg: _Codegen, alt: UPat, perms: list[tuple[int, ...]], top: list[tuple[str, str]] | None) \
    -> tuple[list[str], dict[str, str], dict[str, frozenset]]:
  """Conditions (in evaluation order) for node `u` to match `alt` under one choice of orderings, the names bound, and
  the ops required of the root's sources (op expression -> ops), which the caller tests by branching.

  `top` gives, when the caller has unpacked the root's sources, an (expression, op expression) per source; the
  length of the root's source tuple is then already known to fit."""
  conds: list[str] = []
  reqs: dict[str, frozenset] = {}
  bound: dict[str, str] = {}
  perm_iter = iter(perms)
  # pre-order permutation choices are consumed in the same order _choices produced them
  perm_of: dict[int, tuple[int, ...]] = {}
  stack = [alt]
  while stack:
    q = stack.pop()
    if q.src_kind == "any_order" and len(q.src) > 1: perm_of[id(q)] = next(perm_iter)
    stack.extend(reversed(q.src or ()))
  # Breadth first, and a node's source list is opened only after its siblings' own checks: (q, node expression,
  # op expression or None, is root, open its sources now)
  queue: list[tuple[UPat, str, str | None, bool, bool]] = [(alt, "u", None, True, False)]
  head = 0
  while head < len(queue):
    q, v, opx, is_root, expand = queue[head]; head += 1
    if expand:
      n = len(q.src)
      perm = perm_of.get(id(q), tuple(range(n)))
      if is_root and top is not None: kids = [top[perm[j]] for j in range(n)]
      else:
        t = cg.var()
        conds.append(f"len({t} := {v}.src) {'>=' if q.allow_any_len else '=='} {n}")
        kids = [(f"{t}[{perm[j]}]", None) for j in range(n)]
      for sub, (kv, kop) in zip(q.src, kids): queue.append((sub, kv, kop, False, False))
      continue
    checks = (q.op is not None and not is_root and opx is None) + (q.dtype is not None) + (q.arg is not _ANY) + \
      (bool(q.name) and q.name in bound) + (q.src is not None)
    # name the node at its first check when it is read again later, rather than index it again for every check
    pending = checks > 1 and not v.isidentifier()
    nv = cg.var() if pending else v
    def node() -> str:
      nonlocal pending
      if pending: pending = False; return f"({nv} := {v})"
      return nv
    if q.op is not None and not is_root and opx is not None: reqs[opx] = q.op
    elif q.op is not None and not is_root:
      ox = f"{node()}.op"
      if len(q.op) == 1: conds.append(f"{ox} is {cg.const(next(iter(q.op)))}")
      else: conds.append(f"{ox} in {cg.const(q.op)}")
    if q.dtype is not None:
      if len(q.dtype) == 1: conds.append(f"{node()}.dtype is {cg.const(next(iter(q.dtype)))}")
      else: conds.append(f"{node()}.dtype in {cg.const(q.dtype)}")
    if q.arg is not _ANY: conds.append(f"{node()}.arg == {cg.const(q.arg)}")
    if q.name:
      if q.name in bound: conds.append(f"{node()} is {bound[q.name]}")
      else: bound[q.name] = v if pending else nv
    if q.src is not None: queue.append((q, v if pending else nv, opx, is_root, True))
  return conds, bound, reqs


def _branch(items: list[tuple[dict[str, frozenset], Callable[[int], list[str]]]], depth: int, lines: list[str], consts: dict,
            flat: bool = False):
  """Emit items (in order) as a decision tree on the ops of the unpacked sources.

  An op variable holds one op, so items that require different ops of it exclude each other: branching on it (`if
  o1 is CONST: ... elif o1 is ADD: ...`) sends a node only through the items that can match it, each branch keeping
  the items' order and also holding every item that does not care about that variable."""
  pad = "  " * depth
  counts: dict[str, int] = {}
  for reqs, _ in items:
    for v in reqs: counts[v] = counts.get(v, 0) + 1
  if flat or not counts or len(items) < 2:
    last_note = None
    for reqs, render in items:
      if reqs:  # a lone item tests its ops inline
        tests = [f"{v} is {_kname(consts, next(iter(ops)))}" if len(ops) == 1 else f"{v} in {_kname(consts, ops)}" for v, ops in reqs.items()]
        lines.append(f"{pad}if {' and '.join(tests)}:")
        lines.extend(render(depth + 1))
      else:
        code = render(depth)
        # a rule's orderings come one after another: name the rule once
        if code[0].lstrip().startswith("#"):
          if code[0] == last_note: code = code[1:]
          else: last_note = code[0]
        lines.extend(code)
    return
  var = max(counts, key=lambda v: (counts[v], v))
  ops: list = []
  for reqs, _ in items:
    for o in sorted(reqs.get(var, ()), key=lambda o: o.value):
      if o not in ops: ops.append(o)
  # items indifferent to var are copied into every branch; where that would multiply the code, test inline instead
  copies = sum(1 for reqs, _ in items if var not in reqs) * len(ops) + len(items)
  if copies > max(4 * len(items), 32): return _branch([(reqs, r) for reqs, r in items], depth, lines, consts, flat=True)
  for i, o in enumerate(ops):
    sub = [({v: r for v, r in reqs.items() if v != var}, render) for reqs, render in items if var not in reqs or o in reqs[var]]
    lines.append(f"{pad}{'if' if i == 0 else 'elif'} {var} is {_kname(consts, o)}:")
    _branch(sub, depth + 1, lines, consts)
  rest = [(reqs, render) for reqs, render in items if var not in reqs]
  if rest:
    lines.append(f"{pad}else:")
    _branch(rest, depth + 1, lines, consts)


def _kname(consts: dict, value) -> str:
  ids = consts.setdefault("__ids__", {})
  if (key := ids.get(id(value))) is not None: return key
  key = ids[id(value)] = f"_k{len(ids)}"
  consts[key] = value
  return key


def _call_args(rule: Rule, bound: dict[str, str]) -> str:
  return ", ".join([bound[p] for p in rule.params] + [f"{k}={bound[k]}" for k in rule.kwparams] + (["ctx=ctx"] if rule.wants_ctx else []))


def _walk(p: UPat):
  yield p
  for s in p.src or (): yield from _walk(s)


def _root_ops(p: UPat) -> frozenset[Ops] | None:
  alts = p.expand_alternatives()
  if any(a.op is None for a in alts): return None
  return frozenset().union(*(a.op for a in alts))


class PatternMatcher:
  """An ordered list of rules; the first that matches a node and returns non-None wins."""

  def __init__(self, rules: list[tuple[UPat, Callable]], name: str | None = None):
    where = caller_location()
    self.name = name
    self.rules: list[Rule] = []
    for i, r in enumerate(rules):
      # a rule is (pattern, function), or (pattern, function, name) to name it in REWRITE_STATS (a lambda's own name
      # would be its pattern)
      if not (isinstance(r, tuple) and (len(r) == 2 or (len(r) == 3 and isinstance(r[2], str) and r[2]))):
        raise ValueError(f"{where}: rule #{i} must be a (UPat, function) pair or a (UPat, function, name), got {r!r}")
      self.rules.append(_make_rule(r[0], r[1], where, r[2] if len(r) == 3 else None))
    self._compile()

  @classmethod
  def _from_rules(cls, rules: list[Rule]) -> PatternMatcher:
    pm = cls.__new__(cls)
    pm.name, pm.rules = None, list(rules)
    pm._compile()
    return pm

  def __add__(self, other: PatternMatcher) -> PatternMatcher:
    # a sum written where it is used (`target_rules + cstyle_rules` in a render call) compiles once, not per call
    sums = self.__dict__.setdefault("_sums", {})
    if (hit := sums.get(id(other))) is not None and hit[0] is other: return hit[1]
    out = PatternMatcher._from_rules(self.rules + other.rules)
    out.name = f"{self.name}+{other.name}" if self.name and other.name else None
    sums[id(other)] = (other, out)
    return out
  def __len__(self): return len(self.rules)
  def __repr__(self): return f"<PatternMatcher {self.name or ''} of {len(self.rules)} rules>"

  def _compile(self):
    by_op: dict[Ops, list[Rule]] = {}
    for rule in self.rules:
      ops = _root_ops(rule.pattern)
      for op in (Ops if ops is None else ops): by_op.setdefault(op, []).append(rule)
    self.rules_for = by_op
    self._sources: dict[Ops, str] = {}
    self.dispatch: dict[Ops, Callable] = {op: self._compile_op(op, rules, timed=False) for op, rules in by_op.items()}
    get = self.dispatch.get
    def rewrite(u, ctx=None):
      fn = get(u.op)
      return None if fn is None else fn(u, ctx)
    rewrite.__doc__ = PatternMatcher.rewrite.__doc__
    self.rewrite = rewrite  # a plain function: calling it skips the attribute lookups of the method (hot in loops)
    self._timed: dict[Ops, list[tuple[Rule, Callable]]] | None = None

  def _compile_op(self, op: Ops, rules: list[Rule], timed: bool) -> Callable:
    consts: dict[str, Any] = {"_ONCE": (None,)}
    entries: list[tuple[int, Rule, UPat]] = []
    for ri, rule in enumerate(rules):
      consts[f"_fn{ri}"] = rule.timed_fn() if timed else rule.fn
      for alt in rule.pattern.expand_alternatives():
        if alt.op is None or op in alt.op: entries.append((ri, rule, alt))
    def fixed_len(alt: UPat) -> int | None:
      return len(alt.src) if alt.src is not None and alt.src_kind != "each" and not alt.allow_any_len else None
    def fits(alt: UPat, k: int | None) -> bool:  # can alt match a node with k sources (None: a count no block took)
      if alt.src is None or alt.src_kind == "each": return True
      if alt.allow_any_len: return k is None or len(alt.src) <= k
      return len(alt.src) == k
    # One block per source count that some pattern fixes: inside it the count is known and the sources are unpacked
    # once for every rule. Rules keep their order within a block; a rule whose pattern fits several counts (no
    # sources, or allow_any_len) is copied into each block it fits.
    counts = sorted({k for _, _, alt in entries if (k := fixed_len(alt)) is not None})
    lines = ["def match(u, ctx):"]
    nvar = [0]
    def emit_entries(depth: int, k: int | None, top: list[tuple[str, str]] | None):
      # each item: (ops required of the unpacked sources, a function depth -> code lines)
      items: list[tuple[dict[str, frozenset], Callable[[int], list[str]]]] = []
      for ri, rule, alt in entries:
        if not fits(alt, k): continue
        cg = _Codegen(consts, f"r{ri}_")
        cg.nvars = nvar[0]
        note = f"# {rule.name}  ({rule.location})"
        if _orderings(alt) <= _MAX_ORDERINGS:
          use_top = top if fixed_len(alt) == k or (alt.allow_any_len and alt.src is not None) else None
          for pi, perms in enumerate(_choices(alt)):
            conds, bound, reqs = _straight(cg, alt, perms, use_top)
            call = f"if (r := _fn{ri}({_call_args(rule, bound)})) is not None: return r"
            def render(d: int, conds=conds, call=call, note=note) -> list[str]:
              pad = "  " * d
              out = [pad + note] if note else []
              if conds: return out + [f"{pad}if {' and '.join(conds)}:", f"{pad}  {call}"]
              return out + [pad + call]
            items.append((reqs, render))
        else:
          def render(d: int, ri=ri, rule=rule, alt=alt, note=note) -> list[str]:
            cg = _Codegen(consts, f"r{ri}_")
            cg.emit(d, note)
            cg.emit(d, "for _ in _ONCE:")
            bound: dict[str, str] = {}
            end = cg.pattern(alt, "u", d + 1, "break", bound, skip_op=True, each=set())
            cg.emit(end, f"if (r := _fn{ri}({_call_args(rule, bound)})) is not None: return r")
            return cg.lines
          items.append(({}, render))
        nvar[0] = cg.nvars
      _branch(items, depth, lines, consts)
    if counts:
      lines.append("  s = u.src")
      if len(counts) > 1: lines.append("  n = len(s)")
    for k in counts:
      lines.append(f"  if {'n' if len(counts) > 1 else 'len(s)'} == {k}:")
      top = None
      if 0 < k <= 4:
        names = [f"s{j}" for j in range(k)]
        lines.append(f"    {', '.join(names)}{',' if k == 1 else ''} = s")
        lines.append(f"    {', '.join(f'o{j}' for j in range(k))} = {', '.join(f's{j}.op' for j in range(k))}")
        top = [(f"s{j}", f"o{j}") for j in range(k)]
      elif k > 4: top = [(f"s[{j}]", None) for j in range(k)]
      emit_entries(2, k, top)
      lines.append("    return None")
    emit_entries(1, None, None)
    lines.append("  return None")
    consts.pop("__ids__", None)
    src = "\n".join(lines)
    if not timed: self._sources[op] = src
    namespace = dict(consts)
    exec(compile(src, f"<PatternMatcher {op.name}>", "exec"), namespace)
    return namespace["match"]

  def source(self, op: Ops) -> str:
    """The generated Python that matches nodes of this op."""
    return self._sources.get(op, "")

  def rewrite(self, u, ctx=None):
    """The first rule's non-None result for node `u`, or None."""
    fn = self.dispatch.get(u.op)
    return None if fn is None else fn(u, ctx)

  # one function per rule, for statistics and for naming the rules of a rewrite loop
  def per_rule(self, op: Ops) -> list[tuple[Rule, Callable]]:
    if self._timed is None:
      self._timed = {o: [(r, PatternMatcher._compile_single(o, r)) for r in rules] for o, rules in self.rules_for.items()}
    return self._timed.get(op, [])

  @staticmethod
  def _compile_single(op: Ops, rule: Rule) -> Callable:
    pm = PatternMatcher.__new__(PatternMatcher)
    return pm._compile_op(op, [rule], timed=True)

  def rewrite_traced(self, u, ctx=None) -> tuple[Rule | None, Any]:
    """Like rewrite(), but also returns which rule fired."""
    for rule, fn in self.per_rule(u.op):
      r = fn(u, ctx)
      if r is not None: return rule, r
    return None, None
