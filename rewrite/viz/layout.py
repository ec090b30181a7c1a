"""Graph layout for the viewer's page: Graphviz's `dot` turns each graph into SVG when the page is written.

A graph is the nodes under a root in the recorder's node table, sources above their users. A graph larger than
PAGE_NODES is cut into pages of at most that many nodes, in sources-first order (a source on another page is a
dashed stub naming that page): dot's time grows faster than linearly with a graph's size, pages keep it linear,
and a browser shows one page's SVG at a time. All graphs of a page file go through a few dot processes (one per
core), each laying out many graphs from one input.

Every SVG node carries the class `u<number>` (its node's number), which the page uses to highlight nodes.
"""
from __future__ import annotations
import os, re, shutil, subprocess, tempfile
from pathlib import Path
from ..ops import Ops, GroupOp

PAGE_NODES = 200
PAGE_EDGES = 300
MAX_FANIN = 24   # a node with more sources draws half as many edges and one stub for the rest
Table = list   # the recorder's nodes: number -> (op, dtype, arg text, source numbers)

# fill colours by the op's level: rewrite/ops.py's groups, by name (this module reads node tables, not UOps); the first
# group that names an op colours it (COPY is a tensor op and a host step: tensor blue)
def _names(ops) -> frozenset[str]: return frozenset(o.name for o in ops)
_COLOURS = [
  (_names({Ops.CONST, Ops.DEFINE_VAR, Ops.IOTA}), "#eeeeee"),
  (_names(GroupOp.Tensor), "#cfe2ff"),
  (_names(GroupOp.Kernel), "#ffe0b2"),
  (_names(GroupOp.Loop), "#d7f5d0"),
  (_names(GroupOp.Host | {Ops.SINK, Ops.NOOP}), "#e8dcf5"),
]
MARKS = {"matched": 'color="#d32f2f", penwidth=3', "result": 'color="#1565c0", penwidth=3', "new": 'fillcolor="#a5f0a0"'}


def available() -> bool: return shutil.which("dot") is not None


def under(table: Table, root: int) -> list[int]:
  """The numbers of root and every node under it, sources before users (numbers grow from sources to users: a node
  is numbered after its sources)."""
  seen, stack = {root}, [root]
  while stack:
    for s in table[stack.pop()][3]:
      if s not in seen: seen.add(s); stack.append(s)
  return sorted(seen)


def near(table: Table, roots: list[int], depth: int, most: int = 30) -> list[int]:
  """roots and their sources down to `depth` levels, at most `most` nodes (breadth first)."""
  seen, level = dict.fromkeys(roots), list(roots)
  for _ in range(depth):
    level = [s for n in level for s in table[n][3][:MAX_FANIN // 2] if s not in seen]
    seen.update(dict.fromkeys(level[:max(0, most - len(seen))]))
  return sorted(seen)


def paginate(table: Table, order: list[int]) -> list[list[int]]:
  """order cut into pages of at most PAGE_NODES nodes and PAGE_EDGES edges (dot's time follows the edges)."""
  pages, page, edges = [], [], 0
  for n in order:
    e = min(len(table[n][3]), MAX_FANIN // 2 + 1)
    if page and (len(page) >= PAGE_NODES or edges + e > PAGE_EDGES): pages.append(page); page, edges = [], 0
    page.append(n); edges += e
  return pages + [page]


def _quote(text: str) -> str: return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _fill(op: str) -> str:
  for ops, colour in _COLOURS:
    if op in ops: return colour
  return "white"


def dot_source(table: Table, ids: list[int], page_of: dict[int, int] | None = None, marks: dict[int, str] | None = None) -> str:
  """One graph in dot's language: the nodes `ids` and the edges among them. A source not in `ids` whose page is in
  `page_of` appears as a stub naming that page, or, where a node has several such sources, one stub for all of
  them (otherwise it is left out). A leaf (a constant, a buffer) is drawn once per user: shared leaves pull edges
  across the whole drawing, and dot's time goes to uncrossing them."""
  marks = marks or {}
  inside = set(ids)
  out = ['digraph g {', ' node [shape=box, style=filled, fontname="Helvetica", fontsize=10, height=0.3];',
         ' edge [arrowsize=0.6, color="#666666"];', ' ranksep=0.3; nodesep=0.2; mclimit=0.5; ordering=in;']

  def node(name: str, n: int, extra: str = "") -> str:
    op, dtype, arg, _ = table[n]
    # the dtype where it says something (a vector rule's work shows as float32 becoming float32x16)
    kind = "" if dtype in ("void", "int32", "index") or "ptr" in dtype else f" {dtype}"
    label = op + kind + (f"\n{arg if len(arg) <= 40 else arg[:37] + '...'}" if arg else "")
    mark = f", {MARKS[marks[n]]}" if n in marks else ""
    return (f' {name} [label="{_quote(label)}", class="u{n}", fillcolor="{_fill(op)}", '
            f'tooltip="{_quote(f"#{n} {op} {dtype} {arg}")}"{mark}{extra}];')

  for n in ids:
    src = table[n][3]
    if src or n in marks: out.append(node(f"n{n}", n))
    if len(src) > MAX_FANIN:   # a list of statements (a BLOCK, a SINK): its first sources, then one stub for the rest
      rest = len(src) - MAX_FANIN // 2
      out.append(f' x{n} [label="{rest} more sources", style="dashed", fontcolor="#777777", color="#999999", '
                 f'tooltip="{_quote(" ".join(f"#{x}" for x in src[MAX_FANIN // 2:]))}"];')
      out.append(f" x{n} -> n{n};")
      src = src[:MAX_FANIN // 2]
    outside = [s for s in src if s not in inside and page_of is not None and s in page_of]
    if len(outside) > 2:
      pages = sorted({page_of[s] + 1 for s in outside})
      where = f"page {pages[0]}" if len(pages) == 1 else f"pages {pages[0]}-{pages[-1]}"
      out.append(f' y{n} [label="{len(outside)} sources\\n({where})", style="dashed", fontcolor="#777777", color="#999999"];')
      out.append(f" y{n} -> n{n};")
    for i, s in enumerate(src):
      if s in inside and (table[s][3] or s in marks): name = f"n{s}"   # a leaf unless marked: one copy per use
      elif s in inside: name = f"l{s}_{n}_{i}"; out.append(node(name, s))
      elif len(outside) <= 2 and page_of is not None and s in page_of:
        name = f"s{s}_{n}"
        out.append(f' {name} [label="{_quote(f"{table[s][0]} #{s}")}\n(page {page_of[s] + 1})", class="u{s} stub", '
                   f'style="dashed", fontcolor="#777777", color="#999999"];')
      else: continue
      out.append(f" {name} -> n{n};")
  out.append("}")
  return "\n".join(out)


# what the page does not use: the prolog, comments, titles (tooltips carry the text), ids (several drawings share a
# page), the font (the page's style sets it), blank lines
_CLEAN = re.compile(r'<\?xml.*?\?>|<!DOCTYPE.*?>|<!--.*?-->|<title>.*?</title>\n?| id="[^"]*"| font-family="[^"]*"| font-size="10.00"', re.S)


def render(sources: list[str], workers: int | None = None, timeout: float = 600) -> list[str]:
  """SVG of each dot source, in order (a few dot processes, each laying out a share of the graphs in one go)."""
  if not sources: return []
  workers = max(1, min(workers or os.cpu_count() or 1, len(sources), 8))
  # shares of about equal text length, in order
  total, shares, cur, size = sum(map(len, sources)), [], [], 0
  for s in sources:
    cur.append(s); size += len(s)
    if size >= total / workers and len(shares) < workers - 1: shares.append(cur); cur, size = [], 0
  if cur: shares.append(cur)

  # each share through its own dot process, files in and out (no threads: this runs at exit too, when a new pool
  # of threads is refused)
  with tempfile.TemporaryDirectory(prefix="graft-viz-") as tmp:
    procs = []
    for i, share in enumerate(shares):
      src, dst = Path(tmp, f"{i}.dot"), Path(tmp, f"{i}.svg")
      src.write_text("\n".join(share))
      with open(src) as fin, open(dst, "w") as fout:
        procs.append((subprocess.Popen(["dot", "-Tsvg"], stdin=fin, stdout=fout, stderr=subprocess.PIPE, text=True), dst, len(share)))
    svgs = []
    for proc, dst, count in procs:
      try: _, err = proc.communicate(timeout=timeout)
      except subprocess.TimeoutExpired:
        for p, _, _ in procs: p.kill()
        raise RuntimeError(f"dot took more than {timeout} s")
      if proc.returncode != 0: raise RuntimeError(f"dot failed ({proc.returncode}): {err.strip()[:500]}")
      parts = [re.sub(r"\n\s*\n", "\n", _CLEAN.sub("", part)).strip() + "</svg>" for part in dst.read_text().split("</svg>")[:-1]]
      if len(parts) != count: raise RuntimeError(f"dot gave {len(parts)} drawings for {count} graphs")
      svgs += parts
  return svgs
