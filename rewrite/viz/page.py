"""Writing a recording: `path.json` (the data) or `path.html` (one self-contained page: the data, the SVG drawings of
its graphs and the viewer's script, all inlined; it loads nothing from anywhere).

The JSON form ("graft-viz 1"):
  nodes:  [[op, dtype, arg text, [source numbers]], ...]                    a node's number is its place here
  rules:  [{name, location (file:line), source (the rule's function's text)}, ...]
  root:   a scope {kind, name, attrs, items}, items in order being scopes or rewrites:
          {stage, top_down, before, after (node numbers), seconds, error, nested: [rewrites called by a rule],
           steps: [[rule, node before, node after, first new node, end of new nodes, seconds], ...]}
  kernel_times: {kernel name: [seconds of each run]}
The page adds to each rewrite the drawings of its graphs (`draw`: before and after, each a list of pages, each an
index into `svgs`) and of its first steps (`step_draw`), laid out by rewrite/viz/layout.py.
"""
from __future__ import annotations
import base64, gzip, inspect, json, os, re, sys, time
from pathlib import Path
from . import layout

STEP_DRAWINGS = 30          # steps per rewrite drawn (each as its matched node and result, 2 levels of sources)
MAX_STEP_DRAWINGS = 800    # steps drawn in all (the rest are listed with their rule, without a drawing)


_CHECKOUT = Path(__file__).resolve().parents[2]   # the folder holding rewrite/, rules/...


def where(location: str) -> str:
  """file:line, the file relative to Graft's checkout when it is in it (a page is read on other machines)."""
  path, _, line = location.rpartition(":")
  try: return f"{Path(path).resolve().relative_to(_CHECKOUT)}:{line}"
  except ValueError: return location


def rule_source(rule) -> str:
  """The rule's function; a lambda with the lines before it too (where its pattern is written)."""
  try: lines, first = inspect.getsourcelines(rule.fn)
  except (OSError, TypeError): return ""
  if getattr(rule.fn, "__name__", "") == "<lambda>" and first > 1:
    try: above = inspect.getsourcelines(inspect.getmodule(rule.fn))[0][max(0, first - 4):first - 1]
    except (OSError, TypeError): above = []
    lines = above + lines
  return "".join(lines[:80]) + ("    ...\n" if len(lines) > 80 else "")


def _rewrite_data(r) -> dict:
  return {"stage": r.stage, "top_down": r.top_down, "before": r.before, "after": r.after, "seconds": r.seconds,
          "error": r.error, "steps": [[s.rule, s.before, s.after, s.new_from, s.new_to, s.seconds] for s in r.steps],
          "nested": [_rewrite_data(n) for n in r.nested]}


def _scope_data(s) -> dict:
  return {"kind": s.kind, "name": s.name, "attrs": s.attrs,
          "items": [_scope_data(i) if hasattr(i, "items") else _rewrite_data(i) for i in s.items]}


def data(rec) -> dict:
  """The recording as JSON-able data (the .json file's content)."""
  return {"format": "graft-viz 1", "command": " ".join([os.path.basename(sys.argv[0] or "python"), *sys.argv[1:]]),
          "nodes": [list(n) for n in rec.nodes],
          "rules": [{"name": r.name, "location": where(r.location), "source": rule_source(r)} for r in rec.rules],
          "root": _scope_data(rec.root), "kernel_times": rec.kernel_times}


def _rewrites(scope: dict):
  for item in scope["items"]:
    if "items" in item: yield from _rewrites(item)
    else: yield item


def add_drawings(d: dict) -> tuple[list[str], str]:
  """Lay out the graphs of every top-level rewrite (before and after, in pages) and of its first steps; returns the
  SVGs and a note for the page (what was drawn, or why nothing was)."""
  if not layout.available():
    return [], "Graphviz's dot was not found when this page was written (apt-get install graphviz): graphs are listed as text"
  table, sources, graph_of = d["nodes"], [], {}

  def draw(root: int | None) -> list[int]:
    """Indices (in `sources`) of root's graph's pages; a graph met before is drawn once."""
    if root is None: return []
    if root not in graph_of:
      pages = layout.paginate(table, layout.under(table, root))
      page_of = {n: i for i, p in enumerate(pages) for n in p} if len(pages) > 1 else None
      graph_of[root] = [len(sources) + i for i in range(len(pages))]
      sources.extend(layout.dot_source(table, p, page_of) for p in pages)
    return graph_of[root]

  drawn_steps = 0
  for r in _rewrites(d["root"]):
    r["draw"] = [draw(r["before"]), draw(r["after"])]
    r["step_draw"] = []
    for rule, before, after, new_from, new_to, _ in r["steps"][:STEP_DRAWINGS]:
      if drawn_steps >= MAX_STEP_DRAWINGS: break
      marks = {n: "new" for n in range(new_from, new_to)}
      marks[before], marks[after] = "matched", "result"
      r["step_draw"].append(len(sources))
      sources.append(layout.dot_source(table, layout.near(table, [before, after], 2), marks=marks))
      drawn_steps += 1
  t0 = time.perf_counter()
  svgs = layout.render(sources)
  return svgs, f"{len(graph_of)} graphs and {drawn_steps} steps drawn by Graphviz dot in {time.perf_counter() - t0:.1f} s"


def _inline_json(value) -> str:
  # inside <script>, "</" would end the element early and "<!--" change how it is read: escape both (still JSON)
  return json.dumps(value, separators=(",", ":"), default=str).replace("</", "<\\/").replace("<!--", "<\\u0021--")


def packed(svgs: list[str]) -> str:
  """The drawings as the page holds them: joined by NUL, gzipped, in base64 (a fifth of their size: the page unpacks
  them with the browser's own DecompressionStream)."""
  return base64.b64encode(gzip.compress("\0".join(svgs).encode(), 6, mtime=0)).decode()


def html(rec) -> str:
  d = data(rec)
  svgs, note = add_drawings(d)
  d["note"] = note
  here = Path(__file__).parent
  parts = {"STYLE": (here / "page.css").read_text(), "SCRIPT": (here / "page.js").read_text(),
           "DATA": _inline_json(d), "SVGS": packed(svgs)}
  # one pass: a placeholder's text inside another part (a rule's source, say) is left alone
  return re.sub(r"/\*(STYLE|SCRIPT|DATA|SVGS)\*/", lambda m: parts[m.group(1)], (here / "page.html").read_text())


def write(rec, path: str) -> None:
  text = json.dumps(data(rec), default=str) if path.endswith(".json") else html(rec)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f: f.write(text)
  os.replace(tmp, path)
