"""graph_rewrite: apply a PatternMatcher everywhere in a graph until no rule matches (a fixed point).

Every node is finished once per call (memoized in `done`: node -> what it became). Bottom-up, a node is rebuilt
from its finished sources and matched; what a rule returns is finished in turn, and the node becomes that. The
driver recurses while the graph is shallow (cheapest in Python) and continues with an explicit stack below a depth
budget, so depth never meets the recursion limit; top-down rewriting always uses the explicit stack. Termination
is watched: a rewrite that returns to a node still waiting on its own rewrite is a cycle, and too many rewrites
waiting on one another is a rewrite that grows forever; both raise RewriteLoopError naming the rules and what the
node was rewritten to. A rule that raises, or returns something other than a UOp or None, raises RuleError naming it.
"""
from __future__ import annotations
import contextlib, gc, threading, time
from typing import Any, Callable, Iterator
from .ops import Ops
from .uop import UOp, _with_src
from .matcher import PatternMatcher, Rule
from .upat import UPat
from . import stats, viz

_gc_isenabled, _gc_disable, _gc_enable = gc.isenabled, gc.disable, gc.enable
_gc_lock = threading.Lock()
_gc_pause = [0, False]  # rewrites running now (in all threads); whether the collector was on when the first began


def _pause_gc() -> None:
  with _gc_lock:
    if _gc_pause[0] == 0: _gc_pause[1] = _gc_isenabled(); _gc_disable()
    _gc_pause[0] += 1


def _resume_gc() -> None:
  # the pause is process-wide: the collector comes back when the last rewrite of any thread is done
  with _gc_lock:
    _gc_pause[0] -= 1
    if _gc_pause[0] == 0 and _gc_pause[1]: _gc_enable()
MAX_LINEAGE = 5000  # rewrites waiting on one another (or, top-down, growing rewrites in a row) before it is a loop


class RewriteLoopError(RuntimeError):
  """A rule set that keeps rewriting: names the rules that keep firing and the node."""


class RuleError(RuntimeError):
  """A rule's function raised; names the rule, the stage and the node. The original exception is chained."""


def graph_rewrite(root: UOp, matcher: PatternMatcher, ctx: Any = None, name: str | None = None, top_down: bool = False) -> UOp:
  """Rewrite `root` with `matcher` to a fixed point.

  Bottom-up by default: a node's sources are rewritten before the node. `top_down=True` tries each node before its
  sources, and descends into what it became. Each node is rewritten once per call (memoized). Iterative: graph
  depth is not limited by Python's recursion limit.
  """
  stage = name or matcher.name or "graph_rewrite"
  # The cyclic garbage collector can reclaim nothing a rewrite builds (UOps are immutable, so acyclic), yet while a
  # large rewrite allocates it would scan the whole live graph over and over: up to a third of the time. It is
  # paused for the rewrite and restored after (unless it was off already); cyclic garbage of a rule's own making
  # waits until the rewrite returns. Threads rewrite concurrently: the pause is counted (_pause_gc).
  _pause_gc()
  try:
    if (recorder := viz.recorder) is not None and (rec := recorder.begin(stage, root, top_down)) is not None:
      return _recorded(recorder, rec, root, matcher, ctx, top_down, stage)
    if not stats.active: return _rewrite(root, matcher, matcher.dispatch, ctx, top_down, stage)[0]
    t0 = time.perf_counter()
    lvl = stats.level()
    dispatch = _timed_dispatch(matcher, stage) if lvl >= 2 else matcher.dispatch
    out, rewrites = _rewrite(root, matcher, dispatch, ctx, top_down, stage)
    elapsed = time.perf_counter() - t0
  finally:
    _resume_gc()
  _count(stage, root, out, rewrites, elapsed)
  return out


def _recorded(recorder: viz.Recorder, rec: viz.Rewrite, root: UOp, matcher: PatternMatcher, ctx, top_down: bool,
              stage: str) -> UOp:
  """graph_rewrite while rewrite.viz records (rec: the recorder's record of this call): rules are tried one at a time
  so the recorder learns which one fired; the statistics, when on, count the stage and (REWRITE_STATS=2) each rule
  as usual."""
  t0, out, error = time.perf_counter(), None, None
  dispatch = _timed_dispatch(matcher, stage, fired=lambda rule, u, r, dt: recorder.step(rec, rule, u, r, dt))
  try:
    out, rewrites = _rewrite(root, matcher, dispatch, ctx, top_down, stage)
  except BaseException as e:
    error = e
    raise
  finally:
    recorder.end(rec, out, time.perf_counter() - t0, error)
  if stats.active: _count(stage, root, out, rewrites, time.perf_counter() - t0)
  return out


def _count(stage: str, root: UOp, out: UOp, rewrites: int, elapsed: float) -> None:
  for c in stats.active:
    s = c.stage(stage)
    s.calls += 1; s.rewrites += rewrites; s.time += elapsed
    s.nodes_in += len(root.toposort); s.nodes_out += len(out.toposort)


# Bottom-up rewriting recurses (a Python call per node is cheaper than driving an explicit stack) until this many
# levels deep, then goes on iteratively from there: depth of the graph never meets the recursion limit. A
# graph_rewrite called from inside a rule gets less, and deeper nesting none.
RECURSION_BUDGET = (150, 40)
_nesting = [0]


def _rewrite(root: UOp, matcher: PatternMatcher, dispatch: dict, ctx, top_down: bool, stage: str) -> tuple[UOp, int]:
  try: return _drive(root, matcher, dispatch, ctx, top_down, stage)
  except (RewriteLoopError, RuleError, RecursionError): raise
  except Exception:
    # No rule raised (those are named where they are called): the engine tripped over what a rule returned. Run
    # again with every result checked, which names the rule; this costs nothing until something goes wrong.
    _drive(root, matcher, _checked_dispatch(matcher, stage), ctx, top_down, stage)
    raise


def _drive(root: UOp, matcher: PatternMatcher, dispatch: dict, ctx, top_down: bool, stage: str) -> tuple[UOp, int]:
  nesting = _nesting[0]
  if top_down or nesting >= len(RECURSION_BUDGET): return _iterate(root, matcher, dispatch, ctx, top_down, stage, {}, {})
  _nesting[0] = nesting + 1
  try: return _recurse(root, matcher, dispatch, ctx, stage, RECURSION_BUDGET[nesting])
  finally: _nesting[0] = nesting


def _recurse(root: UOp, matcher: PatternMatcher, dispatch: dict, ctx, stage: str, budget: int) -> tuple[UOp, int]:
  """Bottom-up rewrite by recursion, handing subgraphs deeper than `budget` to _iterate (sharing its state)."""
  done: dict[UOp, UOp] = {}
  links: dict[UOp, tuple[UOp, UOp]] = {}  # node -> (its result, the node the rule fired on), while unfinished
  done_get, get = done.get, dispatch.get
  rewrites = 0

  def visit(n: UOp, depth: int) -> UOp:
    nonlocal rewrites
    if (f := done_get(n)) is not None: return f
    src = n.src
    if src:
      if depth >= budget:
        f, k = _iterate(n, matcher, dispatch, ctx, False, stage, done, links)
        rewrites += k
        return f
      d = depth + 1
      # a source already finished, or a leaf no rule is for (half the nodes of an expression tree), costs no call
      if len(src) == 2:
        a, b = src
        if (fa := done_get(a)) is None: fa = a if not a.src and get(a.op) is None else visit(a, d)
        if (fb := done_get(b)) is None: fb = b if not b.src and get(b.op) is None else visit(b, d)
        new_src = (fa, fb)
      elif len(src) == 1:
        a = src[0]
        if (fa := done_get(a)) is None: fa = a if not a.src and get(a.op) is None else visit(a, d)
        new_src = (fa,)
      else:
        new = []
        for s in src:
          if (f := done_get(s)) is None: f = s if not s.src and get(s.op) is None else visit(s, d)
          new.append(f)
        new_src = tuple(new)
      if new_src == src: nn = n
      else:
        nn = _with_src(n, new_src)
        if (f := done_get(nn)) is not None: done[n] = f; return f  # met elsewhere already: known
    else: nn = n
    if (fn := get(nn.op)) is None: r = None
    else:
      try: r = fn(nn, ctx)
      except (RewriteLoopError, RuleError, RecursionError): raise
      except Exception as e: raise _rule_error(_failing_rule(matcher, nn, ctx), nn, stage, e) from e
    if r is None or r is nn:
      done[n] = nn
      if nn is not n: done[nn] = nn
      return nn
    # a rule rewrote nn (n, rebuilt) to r: n becomes what r becomes. While r is being finished, n is pending in
    # links, where meeting it again means a cycle; a rewrite that grows forever recurses past the budget into
    # _iterate, which counts the pending rewrites.
    rewrites += 1
    if (f := done_get(r)) is None:
      if r is n or r is nn or r in links: _loop(matcher, ctx, stage, links, n)
      links[n] = (r, nn)
      f = visit(r, depth + 1)
      del links[n]
    done[n] = f
    if nn is not n: done[nn] = f
    return f

  try: return visit(root, 0), rewrites
  except RecursionError:
    # the caller was already deep in the stack: finish iteratively. What is done stays done; the rewrites that were
    # waiting are redone (their rules may run a second time), and a rule that recurses forever on its own raises
    # again there, as a RuleError.
    links.clear()
    out, more = _iterate(root, matcher, dispatch, ctx, False, stage, done, links)
    return out, rewrites + more
  finally:
    # visit calls itself, through its own closure: left alone, it (and `done`, every node of this rewrite, and the
    # buffers they name) would be garbage for the cyclic collector instead of going when this returns
    del visit


def _rule_error(rule: Rule | None, node: UOp, stage: str, e: Exception) -> RuleError:
  who = f"rule {rule.name} at {rule.location}" if rule else "a rule"
  return RuleError(f"{who} raised {type(e).__name__}: {e}\n  in stage {stage!r} while matching {node!r}")


def _iterate(root: UOp, matcher: PatternMatcher, dispatch: dict, ctx, top_down: bool, stage: str,
             done: dict[UOp, UOp], links: dict[UOp, tuple[UOp, UOp]]) -> tuple[UOp, int]:
  # One explicit stack of nodes. A node stays on it until it is finished (in `done`): at its first visit it pushes
  # the sources not yet finished; once they are, it is rebuilt from their results and matched. What a rule returns
  # is finished on the spot when its sources are (the usual case: rules build on finished nodes); otherwise the
  # node waits (in `links`: node -> (its result, the node the rule fired on)) under its result on the stack, and
  # takes what the result became. `done` and `links` may come from _recurse, which hands deep subgraphs here.
  lineage: dict[UOp, int] = {}              # top_down: how many growing rewrites led to a node
  tried: set[UOp] = set()                   # top_down: nodes already tried before their sources
  stack: list[UOp] = [root]
  push, pop, get, done_get, _tuple, _map = stack.append, stack.pop, dispatch.get, done.get, tuple, map
  rewrites = 0
  n = nn = root
  try:
    while stack:
      n = stack[-1]
      if n in done: pop(); continue
      src = n.src
      new_src = _tuple(_map(done_get, src))
      if None in new_src:  # some source is not finished
        if top_down:
          if n in links:
            r, nn = links.pop(n)
            if (f := done_get(r)) is None: _loop(matcher, ctx, stage, links, n)  # n met again inside its own result
            done[n] = f; pop(); continue
          if n not in tried:
            tried.add(n)
            nn = n
            if (fn := get(n.op)) is not None and (r := fn(n, ctx)) is not None and r is not n:
              rewrites += 1
              # a chain of rewrites that never ends builds ever new nodes; rewriting to one of the node's own sources
              # shrinks the graph, which cannot go on forever (and legitimately goes on along a long chain)
              lineage[r] = depth = lineage.get(n, 0) + (r not in src)
              if depth > MAX_LINEAGE or r in links: _loop(matcher, ctx, stage, links, n)
              if (f := done_get(r)) is not None: done[n] = f; pop()
              else: links[n] = (r, n); push(r)
              continue
        waits = False
        for s in src:
          if s in done: continue
          if not s.src:  # a leaf is finished here rather than pushed and visited
            nn = s
            if (fn := get(s.op)) is None or (r := fn(s, ctx)) is None or r is s: done[s] = s; continue
            rewrites += 1
            if (f := done_get(r)) is not None: done[s] = f; continue
            if r in links: _loop(matcher, ctx, stage, links, s)
            links[s] = (r, s); push(s); push(r); waits = True
            continue
          if s in links: _loop(matcher, ctx, stage, links, s)
          push(s); waits = True
        if waits: continue
        new_src = _tuple(_map(done_get, src))
      elif links and n in links:  # its rewrite is finished, unless n was met again inside its own result
        r, nn = links.pop(n)
        if (f := done_get(r)) is None: _loop(matcher, ctx, stage, links, n)
        done[n] = f
        if nn is not n: done[nn] = f
        pop(); continue
      if new_src == src: nn = n
      else:
        nn = _with_src(n, new_src)
        if (f := done_get(nn)) is not None: done[n] = f; pop(); continue  # met elsewhere already: known
      if (fn := get(nn.op)) is None or (top_down and nn is n and n in tried) or (r := fn(nn, ctx)) is None or r is nn:
        done[n] = nn
        if nn is not n: done[nn] = nn
        pop(); continue
      # a rule rewrote nn (n, rebuilt) to r
      rewrites += 1
      if top_down:
        lineage[r] = depth = lineage.get(n, 0) + (r not in new_src)
        if depth > MAX_LINEAGE: _loop(matcher, ctx, stage, links, n)
      chain: list[tuple[UOp, UOp, UOp]] = []  # rewrites of what r became: (node, rebuilt node fired on, result)
      while (f := done_get(r)) is None:  # finish r here if its sources are finished
        if r is n or r is nn or r in links: _loop(matcher, ctx, stage, links, n)
        rs = r.src
        new_rs = _tuple(_map(done_get, rs))
        if None in new_rs: break
        if new_rs == rs: rr = r
        else:
          rr = _with_src(r, new_rs)
          if (f := done_get(rr)) is not None: done[r] = f; break
        nn2, nn = nn, rr
        if (fn := get(rr.op)) is None or (r2 := fn(rr, ctx)) is None or r2 is rr:
          done[r] = f = rr
          if rr is not r: done[rr] = rr
          nn = nn2
          break
        nn = nn2
        rewrites += 1
        chain.append((r, rr, r2))
        if len(chain) > MAX_LINEAGE: _loop(matcher, ctx, stage, links, n)
        r = r2
      if f is None:  # r waits for its sources on the stack, under it what it came from, under those n
        if chain:
          links[n] = (chain[0][0], nn)
          for c, cr, c2 in chain: links[c] = (c2, cr); push(c)
        else: links[n] = (r, nn)
        if not top_down and len(links) > MAX_LINEAGE: _loop(matcher, ctx, stage, links, n)
        push(r); continue
      for c, cr, _ in chain:
        done[c] = f
        if cr is not c: done[cr] = f
      done[n] = f
      if nn is not n: done[nn] = f
      pop()
  except (RewriteLoopError, RuleError): raise
  except Exception as e:
    node = nn if nn is not None else n
    if (rule := _failing_rule(matcher, node, ctx)) is None: raise  # not a rule's exception: _rewrite finds it
    raise _rule_error(rule, node, stage, e) from e
  return done[root], rewrites


def _failing_rule(matcher: PatternMatcher, node: UOp, ctx) -> Rule | None:
  if not isinstance(node, UOp): return None
  for rule, fn in matcher.per_rule(node.op):
    try: fn(node, ctx)
    except Exception: return rule
  return None


def _loop(matcher: PatternMatcher, ctx, stage: str, links: dict, node: UOp):
  # Name the rules that keep firing: those of the rewrites still waiting on their results (the loop is among them),
  # and those met by replaying the rules from the node for a while (rules are deterministic).
  fired: dict[str, int] = {}
  def note(u: UOp) -> UOp | None:
    rule, r = matcher.rewrite_traced(u, ctx)
    if rule is not None: key = f"{rule.name} ({rule.location})"; fired[key] = fired.get(key, 0) + 1
    return r
  for _, before in list(links.values())[-50:]: note(before)
  rule, returned = matcher.rewrite_traced(node, ctx)
  cur = node
  for _ in range(50):
    if cur is None: break
    cur = note(cur)
  names = "\n    ".join(fired) or "(unknown)"
  what = f"\n  where rule {rule.name} ({rule.location}) returned {returned!r}" if rule is not None else ""
  raise RewriteLoopError(f"rewrite in stage {stage!r} does not terminate: these rules keep firing\n    {names}\n"
                         f"  on node {node!r}{what}")


def _checked_dispatch(matcher: PatternMatcher, stage: str) -> dict:
  """Per-op functions that try each rule separately and raise RuleError naming the rule that raises or returns
  something other than a UOp or None: the slow path that explains what tripped the engine."""
  out = {}
  for op in matcher.rules_for:
    def dispatch(u, ctx, entries=matcher.per_rule(op)):
      for rule, fn in entries:
        try: r = fn(u, ctx)
        except (RewriteLoopError, RuleError, RecursionError): raise
        except Exception as e: raise _rule_error(rule, u, stage, e) from e
        if r is None: continue
        if not isinstance(r, UOp):
          raise RuleError(f"rule {rule.name} at {rule.location} returned {r!r} (a {type(r).__name__}); a rule returns "
                          f"a UOp, or None for no change\n  in stage {stage!r} while matching {u!r}")
        return r
      return None
    out[op] = dispatch
  return out


def _timed_dispatch(matcher: PatternMatcher, stage: str, fired: Callable | None = None) -> dict:
  """Per-op functions that try each rule separately, timing matching and the rule's function apart for the
  statistics collectors at REWRITE_STATS=2 (if any), and telling `fired(rule, u, result, seconds)` which rule fired
  (the viewer's recorder)."""
  perf = time.perf_counter
  collectors = [c for c in stats.active if c.level >= 2]
  out = {}
  for op in matcher.rules_for:
    entries = [(rule, fn, [c.rule(stage, rule) for c in collectors]) for rule, fn in matcher.per_rule(op)]
    def dispatch(u, ctx, entries=entries):
      for rule, fn, rstats in entries:
        before = rule.fn_time
        t0 = perf()
        r = fn(u, ctx)
        total = perf() - t0
        in_fn = rule.fn_time - before
        for rs in rstats:
          rs.attempts += 1; rs.fn_time += in_fn; rs.match_time += total - in_fn
          if r is not None: rs.matches += 1
        if r is not None:
          if fired is not None: fired(rule, u, r, total)
          return r
      return None
    out[op] = dispatch
  return out


@contextlib.contextmanager
def rewrite_each(matcher: PatternMatcher, stage: str, nodes: int = 0) -> Iterator[Callable]:
  """For a stage that applies `matcher` to nodes itself rather than through graph_rewrite (a renderer maps each
  instruction of a list to its text): yields `rewrite(u, ctx)`, the first rule's result for u, and records the
  stage's statistics like graph_rewrite does (one call of `nodes` nodes; per rule at REWRITE_STATS=2)."""
  if not stats.active:
    yield matcher.rewrite
    return
  dispatch = _timed_dispatch(matcher, stage) if stats.level() >= 2 else matcher.dispatch
  get, fired = dispatch.get, [0]
  def rewrite(u: UOp, ctx=None):
    r = None if (fn := get(u.op)) is None else fn(u, ctx)
    if r is not None: fired[0] += 1
    return r
  t0 = time.perf_counter()
  try: yield rewrite
  finally:
    elapsed = time.perf_counter() - t0
    for c in stats.active:
      st = c.stage(stage)
      st.calls += 1; st.rewrites += fired[0]; st.time += elapsed; st.nodes_in += nodes; st.nodes_out += fired[0]


def rebuild_users_of_replaced_nodes(ctx: tuple[dict, set], u: UOp) -> UOp | None:
  """u (a source of which substitute replaced) over its sources' replacements."""
  mapping, replacements = ctx
  if u in replacements: return None  # a replacement may contain the node it replaces: it stays as it is
  return u.replace(src=tuple(mapping.get(x, x) for x in u.src))


# one matcher for every substitute() call (the mapping travels in the context): it is applied only to a node one of
# whose sources was replaced
_substitute_rules = PatternMatcher([(UPat(name="u"), rebuild_users_of_replaced_nodes)], name="substitute")


class InOrder:
  """Decisions that must be made in a list's order whatever order the rules fire in (a rule on each step of a list,
  where a step's decision depends on those of the steps before it): a rule for the step at place i calls
  `up_to(i, decide)`, which calls `decide(j)` for every place j up to i not decided yet, each once, in order. Every
  caller passes the same `decide` (the rules of one stage). A decision that raises stays not made: graph_rewrite
  runs the rule again to name it in its error, and the decision raises again."""

  def __init__(self): self.made = 0

  def up_to(self, place: int, decide: Callable[[int], None]) -> None:
    while self.made <= place:
      decide(self.made)
      self.made += 1


def splice_sinks(node: UOp) -> UOp | None:
  """A rule for a node whose sources are a list (a SINK of statements or steps): a source that is itself a SINK (what
  a rule returns when it makes several nodes of one) is replaced, in place, by its own sources. None when none is."""
  if not any(s.op is Ops.SINK for s in node.src): return None
  return node.replace(src=tuple(x for s in node.src for x in (s.src if s.op is Ops.SINK else (s,))))


def substitute(root: UOp, mapping: dict[UOp, UOp], name: str = "substitute",
               opaque: Callable[[UOp], bool] | None = None) -> UOp:
  """root with every node of `mapping` replaced by its value (which may contain the node it replaces): the users of
  a replaced node are rebuilt over the replacement, nothing else changes. One pass over root's cached toposort
  (sources first), the shared rule applied only where a source changed: a graph_rewrite would visit every node,
  and unrolling a tile substitutes hundreds of times a kernel.

  `opaque(node) -> bool` (optional) names nodes the caller knows to contain no key of `mapping`: the pass does not
  enter them, so it costs the part of root that may change, not all of root (a lane of a vector tile: the
  accumulators under it are vectors, which hold no lane)."""
  if not mapping: return root
  if root in mapping: return mapping[root]
  new = dict(mapping)
  ctx = (new, set(mapping.values()))
  order = root.toposort if opaque is None else _sources_first_outside(root, mapping, opaque)
  with rewrite_each(_substitute_rules, name, len(order)) as rewrite:
    for n in order:
      if n in new: continue
      for s in n.src:  # a loop, not any(...): this runs for every node of every tile copy
        if s in new:
          if (r := rewrite(n, ctx)) is not None: new[n] = r
          break
  return new.get(root, root)


def _sources_first_outside(root: UOp, stop: dict, opaque: Callable[[UOp], bool]) -> list[UOp]:
  """root's nodes, sources before users, without entering a node of `stop` or an opaque one (neither is listed)."""
  order: list[UOp] = []
  seen: set[UOp] = set()
  stack = [(root, False)]
  while stack:
    node, expanded = stack.pop()
    if expanded: order.append(node); continue
    if node in seen or node in stop or opaque(node): continue
    seen.add(node)
    stack.append((node, True))
    stack.extend((s, False) for s in reversed(node.src))
  return order
