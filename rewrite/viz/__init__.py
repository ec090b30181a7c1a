"""Recording the compiler at work for the rewrite viewer: every graph_rewrite, the rules that fired, what they changed.

  GRAFT_VIZ=out.html python examples/mlp.py      # at exit: one self-contained page (rewrite/viz/page.py)
  GRAFT_VIZ=out.json python examples/mlp.py      # the same data as JSON, for scripts and tests
  python -m rewrite.viz [-o out.html] script.py [args]

What is recorded: a tree of scopes that the runtime opens (a realize, each kernel it compiles; `scope()`), and in each
scope every graph_rewrite in call order, with its stage name, the root before and after, and each rule application
(step): the rule, the node it fired on, the node it returned, the nodes that application created and the seconds its
function took. A graph_rewrite called from inside a rule is filed under the one that called it (`nested`). Nodes are
kept once in one table (`nodes`: op, dtype, arg, sources by number): hash-consing makes a node met in many graphs one
entry, and a step refers to nodes by number. Kernels' run times come from the runtime (`kernel_time`).

Off (GRAFT_VIZ unset, no `record()` block), `recorder` is None and graph_rewrite reads that one attribute and goes on
as before (bench/viz_overhead.py measures it). On, each rewrite tries its rules one at a time (as REWRITE_STATS=2
does) so it knows which one fired: slower, never different.
"""
from __future__ import annotations
import atexit, contextlib, os, threading, time, weakref
from dataclasses import dataclass, field
from typing import Any

# The recording now, or None (graph_rewrite records nothing): set by GRAFT_VIZ at import, or by record().
recorder: Recorder | None = None


@dataclass
class Step:
  """One rule application: `rule` (a number in Recorder.rules) rewrote node `before` to node `after`; the nodes
  numbered from `new_from` up to `new_to` (excluded) were first met here (what the rule built, mostly)."""
  rule: int
  before: int
  after: int
  new_from: int
  new_to: int
  seconds: float


@dataclass
class Rewrite:
  """One graph_rewrite: its stage, the root before and after (node numbers; `after` None when it raised)."""
  stage: str
  top_down: bool
  before: int
  after: int | None = None
  seconds: float = 0.0
  error: str | None = None
  steps: list[Step] = field(default_factory=list)
  nested: list[Rewrite] = field(default_factory=list)


@dataclass
class Scope:
  """A part of the run the runtime names: `kind` "realize" or "kernel" (or any word), `name`, facts about it
  (`attrs`: a kernel's source and plan, a realize's host program), and what happened inside, in order."""
  kind: str
  name: str = ""
  attrs: dict[str, Any] = field(default_factory=dict)
  items: list = field(default_factory=list)   # Scope | Rewrite


class Recorder:
  def __init__(self, path: str | None = None):
    self.path = path
    self.nodes: list[tuple[str, str, str, tuple[int, ...]]] = []   # number -> (op, dtype, arg text, source numbers)
    # node -> number, without keeping the node alive (a BUFFER's arg holds device memory): a node that dies and is
    # built again later gets a new number, which only costs a table entry
    self._ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    self.rules: list = []                # number -> Rule
    self._rule_ids: dict[int, int] = {}  # id(Rule) -> number (rules live as long as their matchers: the module's)
    self.root = Scope("session", "")
    self.kernel_times: dict[str, list[float]] = {}
    self._lock = threading.Lock()
    self._local = threading.local()      # per thread: open scopes, running rewrites, pauses

  # ---- node and rule numbers

  def node(self, u) -> int:
    """u's number, numbering u and every source not numbered yet (sources first)."""
    ids = self._ids
    if (i := ids.get(u)) is not None: return i
    with self._lock:
      stack = [(u, False)]
      while stack:
        n, ready = stack.pop()
        if n in ids: continue
        if not ready:
          stack.append((n, True))
          stack.extend((s, False) for s in n.src if s not in ids)
          continue
        ids[n] = len(self.nodes)
        self.nodes.append((n.op.name, str(n.dtype).removeprefix("dtypes."), arg_text(n.arg), tuple(ids[s] for s in n.src)))
      return ids[u]

  def rule(self, rule) -> int:
    if (i := self._rule_ids.get(id(rule))) is None:
      with self._lock:
        i = self._rule_ids[id(rule)] = len(self.rules)
        self.rules.append(rule)
    return i

  # ---- what the runtime and the engine call

  def _state(self):
    st = self._local
    if not hasattr(st, "scopes"): st.scopes, st.running, st.paused = [self.root], [], 0
    return st

  def begin(self, stage: str, root, top_down: bool) -> Rewrite | None:
    """A graph_rewrite starts: its record (`step` fills it), or None while paused."""
    st = self._state()
    if st.paused: return None
    rec = Rewrite(stage, top_down, self.node(root))
    (st.running[-1].nested if st.running else st.scopes[-1].items).append(rec)
    st.running.append(rec)
    return rec

  def end(self, rec: Rewrite, out, seconds: float, error: BaseException | None) -> None:
    st = self._state()
    st.running.remove(rec)
    rec.seconds = seconds
    if out is not None: rec.after = self.node(out)
    if error is not None: rec.error = f"{type(error).__name__}: {error}"

  def step(self, rec: Rewrite, rule, u, r, seconds: float) -> None:
    """In the rewrite `rec`, `rule` returned r for node u, its function and matching taking `seconds`."""
    if r is u: return
    before = self.node(u)
    first = len(self.nodes)
    rec.steps.append(Step(self.rule(rule), before, self.node(r), first, len(self.nodes), seconds))

  @contextlib.contextmanager
  def scope(self, kind: str, name: str = ""):
    s = Scope(kind, name)
    st = self._state()
    st.scopes[-1].items.append(s)
    st.scopes.append(s)
    try: yield s
    finally: st.scopes.remove(s)

  @contextlib.contextmanager
  def paused(self):
    st = self._state()
    st.paused += 1
    try: yield
    finally: st.paused -= 1

  def write(self, path: str) -> None:
    from .page import write
    write(self, path)


def arg_text(arg, limit: int = 80) -> str:
  """A node's arg as the viewer prints it (cut to `limit` characters)."""
  if arg is None: return ""
  try: text = repr(arg)
  except Exception as e: text = f"<{type(arg).__name__}: repr raised {type(e).__name__}>"
  return text if len(text) <= limit else text[:limit - 3] + "..."


# ---- the module's interface: all of it does nothing while nothing records

def scope(kind: str, name: str = ""):
  """`with viz.scope("kernel") as s: ...; s.name = ...; s.attrs[...] = ...`: the graph_rewrites inside are filed
  under it. While nothing records, a throwaway Scope (setting its fields costs nothing that matters)."""
  if recorder is None: return contextlib.nullcontext(Scope(kind, name))
  return recorder.scope(kind, name)


def paused():
  """Nothing inside is recorded (the plan search lowers a kernel once per candidate: noise in a viewer)."""
  return contextlib.nullcontext() if recorder is None else recorder.paused()


def kernel_time(name: str, seconds: float) -> None:
  if recorder is not None: recorder.kernel_times.setdefault(name, []).append(seconds)


@contextlib.contextmanager
def record(path: str | None = None):
  """Record everything inside the block (instead of any recording already on); write it to `path` at the end
  (.html: the page, .json: the data) when given. Yields the Recorder."""
  global recorder
  saved, rec = recorder, Recorder(path)
  recorder = rec
  try: yield rec
  finally:
    recorder = saved
    if path: rec.write(path)


def _write_at_exit(rec: Recorder) -> None:
  import sys
  try: rec.write(rec.path)
  except Exception as e:   # at exit nothing can catch it: say what happened rather than print a traceback
    print(f"GRAFT_VIZ: could not write {rec.path}: {type(e).__name__}: {e}", file=sys.stderr)
    return
  print(f"GRAFT_VIZ: wrote {rec.path} ({len(rec.nodes)} nodes, {len(rec.rules)} rules)", file=sys.stderr)


def _from_environment() -> None:
  global recorder
  path = os.environ.get("GRAFT_VIZ", "").strip()
  if not path: return
  if not path.endswith((".html", ".json")):
    raise ValueError(f"GRAFT_VIZ={path!r}: name the file to write, ending in .html (the page) or .json (the data)")
  recorder = Recorder(path)
  atexit.register(_write_at_exit, recorder)


_from_environment()
