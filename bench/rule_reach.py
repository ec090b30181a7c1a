"""How much of the compiler's work sits behind whole-graph rules: the share of the function lines in rules/ that only
rules on a SINK reach.

  python bench/rule_reach.py            # the share, and the functions behind whole-graph rules, largest first
  python bench/rule_reach.py --top 40   # more of them
  python bench/rule_reach.py --rules    # also each rule of the pipeline and how it is classed

A rule on a SINK is handed the whole graph (the whole schedule, kernel or host program) whatever else its pattern
says: one such rule can do a stage's work as a plain walk, which is what the project's style asks us not to write.
So a rule counts as whole-graph when its pattern's root op is SINK, whatever its arg or sources (a phase marker
like arg="steps", or "each source is a STORE", narrows nothing in practice).

How it counts. Every rule set of the pipeline (rules/pipeline.py) is imported and each rule's function found by its
code (file, first line). The static call graph of the functions defined in rules/ is read with `ast`: an edge for
each name a function mentions that resolves to a function of rules/ (a call, or a function passed along: `key=f`),
through nested definitions, the module's own definitions and its `from ... import`s; an attribute `x.f` resolves to
every method named f of a class in rules/ (an over-approximation: it can only lower the figure); a module-level rule
set a function mentions (`graph_rewrite(u, _to_slots)`) leads to its rules' functions; a class mentioned leads to its
own `__init__`/`__post_init__`. Lines are the non-blank lines of a function, less those of functions nested in it.
The share is (lines reached only from whole-graph rules) / (lines reached from any rule of the pipeline). What the
pipeline calls before a stage's rules (`Stage.prepare`: a policy choosing a kernel's plan, an index of the schedule)
is reached from no rule; its lines are printed apart, so nothing moved there goes unseen. It is a static measure of
the code's shape, not of time.
"""
from __future__ import annotations
import argparse, ast, importlib, os, sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RULES_DIR = os.path.join(ROOT, "rules")


@dataclass
class Fn:
  """A function (or module-level lambda, or rule set) of rules/ and the names it mentions."""
  name: str                  # module:qualname
  path: str
  line: int
  lines: int = 0
  names: set[str] = field(default_factory=set)      # bare names mentioned (resolved later in its scope)
  attrs: set[str] = field(default_factory=set)      # attribute names mentioned (x.attr)
  scope: tuple[str, ...] = ()                        # qualnames of the enclosing functions, innermost last
  edges: set[str] = field(default_factory=set)


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _source_files() -> list[str]:
  return sorted(os.path.join(d, f) for d, _, fs in os.walk(RULES_DIR) for f in fs if f.endswith(".py"))


class _Reader(ast.NodeVisitor):
  """Collects the functions of one module, their own lines and the names each mentions."""

  def __init__(self, module: str, path: str, text: list[str]):
    self.module, self.path, self.text = module, path, text
    self.fns: dict[str, Fn] = {}
    self.stack: list[Fn] = []           # enclosing functions
    self.classes: list[str] = []
    self.methods: dict[str, list[str]] = {}   # method name -> qualified names
    self.class_inits: dict[str, list[str]] = {}
    self.imports: dict[str, tuple[str, str]] = {}  # local name -> (module, name)

  def _nonblank(self, a: int, b: int) -> int: return sum(1 for i in range(a - 1, b) if self.text[i].strip())

  def _function(self, node, name: str):
    qual = f"{self.stack[-1].name}.{name}" if self.stack else f"{self.module}:{'.'.join([*self.classes, name])}"
    fn = Fn(qual, self.path, node.lineno, self._nonblank(node.lineno, node.end_lineno),
            scope=tuple(f.name for f in self.stack))
    if self.stack: self.stack[-1].lines -= fn.lines     # a nested function's lines are its own
    self.fns[qual] = fn
    if self.classes and not self.stack:
      self.methods.setdefault(name, []).append(qual)
      if name in ("__init__", "__post_init__", "__new__"): self.class_inits.setdefault(self.classes[-1], []).append(qual)
    self.stack.append(fn)
    self.generic_visit(node)
    self.stack.pop()

  def visit_FunctionDef(self, node): self._function(node, node.name)
  visit_AsyncFunctionDef = visit_FunctionDef

  def visit_Lambda(self, node):
    if self.stack: return self.generic_visit(node)   # part of the function it is written in
    self._function(node, f"<lambda:{node.lineno}>")

  def visit_ClassDef(self, node):
    self.classes.append(node.name)
    self.generic_visit(node)
    self.classes.pop()

  def visit_ImportFrom(self, node):
    base = node.module or ""
    if node.level:
      parts = self.module.split(".")
      pkg = parts if self.path.endswith("__init__.py") else parts[:-1]
      base = ".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
    for a in node.names: self.imports[a.asname or a.name] = (base, a.name)

  def visit_Name(self, node):
    if self.stack: self.stack[-1].names.add(node.id)

  def visit_Attribute(self, node):
    if self.stack: self.stack[-1].attrs.add(node.attr)
    self.generic_visit(node)


def read_sources():
  readers = {}
  for path in _source_files():
    with open(path) as f: text = f.read()
    r = _Reader(_module_name(path), path, text.splitlines())
    r.visit(ast.parse(text, path))
    readers[r.module] = r
  return readers


def build_graph():
  """(functions by name, rules: list of (stage, rule name, pattern, whole_graph, function name or None), the stages'
  prepare functions: list of (stage, function name))."""
  from rewrite import PatternMatcher, Ops
  from rules.pipeline import pipeline
  readers = read_sources()
  fns: dict[str, Fn] = {k: v for r in readers.values() for k, v in r.fns.items()}
  by_code = {(os.path.realpath(f.path), f.line): f.name for f in fns.values()}
  methods: dict[str, list[str]] = {}
  for r in readers.values():
    for m, quals in r.methods.items(): methods.setdefault(m, []).extend(quals)

  def fn_of(rule_fn) -> str | None:
    while not hasattr(rule_fn, "__code__") and hasattr(rule_fn, "func"): rule_fn = rule_fn.func   # functools.partial
    code = getattr(rule_fn, "__code__", None)
    return None if code is None else by_code.get((os.path.realpath(code.co_filename), code.co_firstlineno))

  # module-level rule sets are nodes too: mentioning one reaches its rules
  for mod, r in readers.items():
    m = importlib.import_module(mod)
    for var, val in vars(m).items():
      if isinstance(val, PatternMatcher) and var not in r.imports:
        fns[f"{mod}:{var}"] = Fn(f"{mod}:{var}", r.path, 0, edges={n for rule in val.rules if (n := fn_of(rule.fn))})

  def resolve(mod: str, name: str, depth: int = 0) -> list[str]:
    r = readers.get(mod)
    if r is None or depth > 5: return []
    if f"{mod}:{name}" in fns: return [f"{mod}:{name}"]
    if name in r.class_inits: return r.class_inits[name]
    if name in r.imports: return resolve(*r.imports[name], depth + 1)
    return []

  for f in list(fns.values()):
    if not f.line: continue
    mod = f.name.split(":")[0]
    for n in f.names:
      nested = [f"{s}.{n}" for s in (*f.scope, f.name) if f"{s}.{n}" in fns]
      f.edges.update(nested[-1:] or resolve(mod, n))
    for a in f.attrs:
      f.edges.update(methods.get(a, ()))
      if (imp := readers[mod].imports.get(a)): f.edges.update(resolve(*imp))
  rules, prepares = [], []
  for stage in pipeline:
    if (prepare := getattr(stage, "prepare", None)) is not None: prepares.append((stage.name, fn_of(prepare)))  # older trees: none
    for rule in stage.rules.rules:
      alts = rule.pattern.expand_alternatives()
      whole = all(p.op == frozenset({Ops.SINK}) for p in alts)
      rules.append((stage.name, rule.name, rule.pattern, whole, fn_of(rule.fn)))
  return fns, rules, prepares


def reached(fns: dict[str, Fn], roots) -> set[str]:
  seen, stack = set(), [r for r in roots if r]
  while stack:
    n = stack.pop()
    if n in seen or n not in fns: continue
    seen.add(n)
    stack.extend(fns[n].edges)
  return seen


@dataclass
class Reach:
  share: float                         # behind / total
  behind: int                          # lines reached only from whole-graph rules
  total: int                           # lines reached from any rule of the pipeline
  only: list[tuple[str, int]]          # those functions, largest first, with their lines
  rules: list[tuple]                   # (stage, rule name, pattern, whole_graph, function)
  prepared: int                        # lines reached from the stages' prepare functions and from no rule
  prepares: list[tuple[str, str, int]]  # (stage, its prepare function, the lines it reaches that no rule does)


def measure() -> Reach:
  fns, rules, prepares = build_graph()
  from_whole = reached(fns, [f for *_, whole, f in rules if whole])
  from_local = reached(fns, [f for *_, whole, f in rules if not whole])
  only = sorted(from_whole - from_local, key=lambda n: -fns[n].lines)
  total = sum(fns[n].lines for n in from_whole | from_local)
  behind = sum(fns[n].lines for n in only)
  by_rules = from_whole | from_local
  prepared = sum(fns[n].lines for n in reached(fns, [f for _, f in prepares]) - by_rules)
  per_prepare = [(stage, f, sum(fns[n].lines for n in reached(fns, [f]) - by_rules)) for stage, f in prepares]
  return Reach(behind / total, behind, total, [(n, fns[n].lines) for n in only if fns[n].lines], rules, prepared, per_prepare)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--top", type=int, default=15, help="how many of the functions behind whole-graph rules to list")
  ap.add_argument("--rules", action="store_true", help="list every rule of the pipeline and how it is classed")
  args = ap.parse_args()
  r = measure()
  if args.rules:
    for stage, name, pattern, whole, fn in r.rules:
      print(f"  {'WHOLE' if whole else 'local'}  {stage:12s} {name:40s} {fn or '(outside rules/)'}")
  print(f"function lines in rules/ reached by the pipeline's rules: {r.total}")
  print(f"reached only from whole-graph rules (pattern on a SINK): {r.behind} ({r.share:.0%})")
  for n, lines in r.only[:args.top]: print(f"  {lines:4d}  {n}")
  whole_rules = sorted({f"{stage}: {name}" for stage, name, _, whole, _ in r.rules if whole})
  print(f"whole-graph rules ({len(whole_rules)}): {', '.join(whole_rules)}")
  print(f"reached by no rule, only from what the pipeline calls before a stage's rules (Stage.prepare: policies that "
        f"choose a plan, indexes of the schedule or program): {r.prepared} lines, from "
        + ", ".join(f"{stage}: {fn.split(':')[1] if fn else '?'} ({lines})" for stage, fn, lines in r.prepares))


if __name__ == "__main__":
  main()
