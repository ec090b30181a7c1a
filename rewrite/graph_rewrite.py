"""graph_rewrite: apply a PatternMatcher everywhere in a graph until no rule matches (a fixed point)."""
from __future__ import annotations
import time
from typing import Any
from .uop import UOp
from .matcher import PatternMatcher, Rule
from . import stats

MAX_LINEAGE = 5000  # rewrites of one node and of what it became, before we call it a loop


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
  if not stats.active: return _rewrite(root, matcher, matcher.dispatch, ctx, top_down, stage)[0]
  t0 = time.perf_counter()
  lvl = stats.level()
  dispatch = _timed_dispatch(matcher, stage) if lvl >= 2 else matcher.dispatch
  out, rewrites = _rewrite(root, matcher, dispatch, ctx, top_down, stage)
  elapsed = time.perf_counter() - t0
  for c in stats.active:
    s = c.stage(stage)
    s.calls += 1; s.rewrites += rewrites; s.time += elapsed
    s.nodes_in += len(root.toposort); s.nodes_out += len(out.toposort)
  return out


def _rewrite(root: UOp, matcher: PatternMatcher, dispatch: dict, ctx, top_down: bool, stage: str) -> tuple[UOp, int]:
  done: dict[UOp, UOp] = {}
  waiting: set[UOp] = set()          # nodes waiting for what they were rewritten to
  lineage: dict[UOp, int] = {}       # how many rewrites led to a node
  history: dict[UOp, tuple[UOp, UOp]] = {}  # node -> (the node a rule fired on, its result); read only to report a loop
  stack: list[tuple[UOp, int, Any]] = [(root, 0, None)]
  push, pop, get = stack.append, stack.pop, dispatch.get
  rewrites = 0
  n = nn = root
  try:
    while stack:
      n, step, r = pop()
      if step == 0:
        if n in done: continue
        if top_down and (fn := get(n.op)) is not None and (r := fn(n, ctx)) is not None and r is not n:
          nn = n
        else:
          push((n, 1, None))
          for s in reversed(n.src):
            if s not in done:
              if s in waiting: _loop(matcher, ctx, s, history, dispatch, stage)
              push((s, 0, None))
          continue
      elif step == 1:
        if n in done: continue
        src = n.src
        new_src = tuple([done[s] for s in src])
        if new_src == src: nn = n
        else:
          nn = UOp(n.op, n.dtype, new_src, n.arg)
          if nn in done: done[n] = done[nn]; continue  # the rebuilt node was met elsewhere: its rewrite is known
        if (fn := get(nn.op)) is None or (r := fn(nn, ctx)) is None or r is nn:
          done[n] = nn
          if nn is not n: done[nn] = nn
          continue
      else:
        waiting.discard(n)
        done[n] = done[r]
        continue
      # a rule rewrote nn (n, rebuilt) to r: finish r, then n becomes what r became
      rewrites += 1
      # A chain of rewrites that never ends builds ever new nodes; rewriting to one of the node's own sources makes the
      # graph smaller, which cannot go on forever (and does legitimately go on for a long chain), so it is not counted.
      depth = lineage[r] = lineage.get(n, 0) + (r not in nn.src)
      history[n] = (nn, r)
      if depth > MAX_LINEAGE or r in waiting: _loop(matcher, ctx, r, history, dispatch, stage, n)
      waiting.add(n)
      push((n, 2, r))
      push((r, 0, None))
  except (RewriteLoopError, RuleError): raise
  except Exception as e:
    node = nn if nn is not None else n
    rule = _failing_rule(matcher, node, ctx)
    who = f"rule {rule.name} at {rule.location}" if rule else "a rule"
    raise RuleError(f"{who} raised {type(e).__name__}: {e}\n  in stage {stage!r} while matching {node!r}") from e
  return done[root], rewrites


def _failing_rule(matcher: PatternMatcher, node: UOp, ctx) -> Rule | None:
  for rule, fn in matcher.per_rule(node.op):
    try: fn(node, ctx)
    except Exception: return rule
  return None


def _loop(matcher: PatternMatcher, ctx, node: UOp, history: dict, dispatch: dict, stage: str, start: UOp | None = None):
  # Walk back what the looping node was rewritten from and name the rules that fired on the way.
  fired: dict[str, int] = {}
  seen = 0
  cur = start if start is not None else node
  while cur in history and seen < 50:
    before, after = history[cur]
    rule, _ = matcher.rewrite_traced(before, ctx)
    if rule is not None: key = f"{rule.name} ({rule.location})"; fired[key] = fired.get(key, 0) + 1
    cur, seen = after, seen + 1
  if not fired:
    rule, _ = matcher.rewrite_traced(node, ctx)
    if rule is not None: fired[f"{rule.name} ({rule.location})"] = 1
  names = "\n    ".join(fired) or "(unknown)"
  raise RewriteLoopError(f"rewrite in stage {stage!r} does not terminate: these rules keep firing\n    {names}\n"
                         f"  on node {node!r}")


def _timed_dispatch(matcher: PatternMatcher, stage: str) -> dict:
  """Per-op functions that try each rule separately, timing matching and the rule's function apart."""
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
        if r is not None: return r
      return None
    out[op] = dispatch
  return out
