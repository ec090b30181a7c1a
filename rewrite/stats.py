"""Rewrite statistics: per named graph_rewrite (stage), per rule (level 2), and per kernel.

Off by default, and then graph_rewrite makes no timing call at all. `REWRITE_STATS=1` prints a table per stage and
one per kernel at exit, `REWRITE_STATS=2` adds one row per rule. `REWRITE_STATS_FILE=path.json` (or `.csv`) writes
the same data to a file at exit (and turns collection on at level 2 if REWRITE_STATS does not say otherwise).
In Python: `with rewrite.stats.collect() as s: ...; print(s.table("stage"))`; `s.table("rule")`, `s.table("kernel")`.
"""
from __future__ import annotations
import atexit, contextlib, csv, io, json, os
from dataclasses import dataclass, field, asdict
from .env import env_number


@dataclass
class StageStats:
  name: str
  calls: int = 0
  nodes_in: int = 0
  nodes_out: int = 0
  rewrites: int = 0
  time: float = 0.0


@dataclass
class RuleStats:
  name: str
  location: str
  stage: str
  matches: int = 0
  attempts: int = 0
  match_time: float = 0.0
  fn_time: float = 0.0


@dataclass
class Collector:
  """What one collection saw. `level` 1: stages; 2: stages and rules."""
  level: int = 2
  stages: dict[str, StageStats] = field(default_factory=dict)
  rules: dict[tuple[str, str, str], RuleStats] = field(default_factory=dict)
  kernels: dict[str, dict[str, StageStats]] = field(default_factory=dict)  # kernel name -> its stages
  plans: dict[str, str] = field(default_factory=dict)                     # kernel name -> its optimization plan

  def add_kernel(self, name: str, stages: dict[str, StageStats], plan: str = ""):
    """Record what compiling one kernel cost, stage by stage (the caller collected it with a nested collect()), and
    the optimization plan it was lowered with."""
    if plan: self.plans[name] = plan
    mine = self.kernels.setdefault(name, {})
    for st in stages.values():
      k = mine.setdefault(st.name, StageStats(st.name))
      k.calls += st.calls; k.nodes_in += st.nodes_in; k.nodes_out += st.nodes_out; k.rewrites += st.rewrites; k.time += st.time

  def stage(self, name: str) -> StageStats:
    if (s := self.stages.get(name)) is None: s = self.stages[name] = StageStats(name)
    return s

  def rule(self, stage: str, rule) -> RuleStats:
    key = (stage, rule.name, rule.location)
    if (r := self.rules.get(key)) is None: r = self.rules[key] = RuleStats(rule.name, rule.location, stage)
    return r

  def as_dict(self) -> dict:
    return {"stages": [asdict(s) for s in self.stages.values()], "rules": [asdict(r) for r in self.rules.values()],
            "kernels": [{"kernel": k, **asdict(s)} for k, stages in self.kernels.items() for s in stages.values()]}

  def to_csv(self) -> str:
    """One row per stage, rule and (kernel, stage); the column `kind` says which."""
    cols = ["kind", "stage", "rule", "location", "kernel", "calls", "nodes_in", "nodes_out", "rewrites", "matches",
            "attempts", "match_time", "fn_time", "time"]
    out = io.StringIO()
    w = csv.DictWriter(out, fieldnames=cols, restval="")
    w.writeheader()
    for s in self.stages.values(): w.writerow({"kind": "stage", "stage": s.name, **{k: v for k, v in asdict(s).items() if k != "name"}})
    for r in self.rules.values(): w.writerow({"kind": "rule", "rule": r.name, **{k: v for k, v in asdict(r).items() if k != "name"}})
    for k, stages in self.kernels.items():
      for s in stages.values(): w.writerow({"kind": "kernel", "kernel": k, "stage": s.name, **{k2: v for k2, v in asdict(s).items() if k2 != "name"}})
    return out.getvalue()

  def write(self, path: str):
    with open(path, "w") as f: f.write(self.to_csv() if path.endswith(".csv") else self.to_json())

  def to_json(self) -> str: return json.dumps(self.as_dict(), indent=1)

  def table(self, kind: str = "stage") -> str:
    from tabulate import tabulate
    if kind == "stage":
      rows = [(s.name, s.calls, s.nodes_in, s.nodes_out, s.rewrites, f"{s.time * 1e3:.2f}") for s in self.stages.values()]
      return tabulate(rows, headers=["stage", "calls", "nodes in", "nodes out", "rewrites", "ms"], tablefmt="simple")
    if kind == "rule":
      total = sum(r.match_time + r.fn_time for r in self.rules.values()) or 1.0
      ordered = sorted(self.rules.values(), key=lambda r: -(r.match_time + r.fn_time))
      rows = [(r.stage, r.name, short_path(r.location), r.matches, r.attempts, f"{r.match_time * 1e3:.2f}",
               f"{r.fn_time * 1e3:.2f}", f"{100 * (r.match_time + r.fn_time) / total:.1f}%") for r in ordered]
      return tabulate(rows, headers=["stage", "rule", "where", "matches", "attempts", "match ms", "rule ms", "share"], tablefmt="simple")
    if kind == "kernel":
      stage_names = list(dict.fromkeys(st for stages in self.kernels.values() for st in stages))
      rows = [(k, *(f"{stages[st].time * 1e3:.2f}/{stages[st].rewrites}" if st in stages else "" for st in stage_names),
               f"{sum(s.time for s in stages.values()) * 1e3:.2f}", self.plans.get(k, "")) for k, stages in self.kernels.items()]
      return tabulate(rows, headers=["kernel", *(f"{st} ms/rw" for st in stage_names), "total ms", "plan"], tablefmt="simple")
    raise ValueError(f"table kind must be 'stage', 'rule' or 'kernel', not {kind!r}")


def short_path(loc: str) -> str:
  """file:line with the file relative to the working directory when it is near it."""
  path, _, line = loc.rpartition(":")
  try: rel = os.path.relpath(path)
  except ValueError: rel = path
  return f"{rel if not rel.startswith('..' + os.sep + '..') else path}:{line}"


def _env_level() -> int: return env_number("REWRITE_STATS", 0, "a statistics level (1: stages, 2: and rules)")


# The collectors that are active now; graph_rewrite reads `active` once per call.
active: list[Collector] = []
_global: Collector | None = None
_file = os.environ.get("REWRITE_STATS_FILE", "")
if _env_level() > 0 or _file:
  _global = Collector(level=_env_level() or 2)
  active.append(_global)


def level() -> int: return max((c.level for c in active), default=0)


@contextlib.contextmanager
def collect(level: int = 2):
  """Collect statistics of every graph_rewrite inside the block."""
  c = Collector(level=level)
  active.append(c)
  try: yield c
  finally: active.remove(c)


def _print_at_exit():
  if _global is None or not _global.stages: return
  if _file:
    _global.write(_file)
    if _env_level() == 0: return
  print("\nrewrite statistics per stage (REWRITE_STATS=1)")
  print(_global.table("stage"))
  if _global.level >= 2 and _global.rules:
    print("\nrewrite statistics per rule (REWRITE_STATS=2)")
    print(_global.table("rule"))
  if _global.kernels:
    print("\nrewrite statistics per kernel (ms in each stage / rewrites)")
    print(_global.table("kernel"))


atexit.register(_print_at_exit)
