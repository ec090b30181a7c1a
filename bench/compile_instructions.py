"""Compile cost in instructions (valgrind's callgrind): schedule + codegen of bench/compiler_speed.py's rows, counted
instead of timed, so that two trees compare exactly on a shared, noisy machine.

  python bench/compile_instructions.py                                 # this tree, sched_mlp and sched_tfm
  python bench/compile_instructions.py --against /path/to/other/tree   # side by side with another checkout
  python bench/compile_instructions.py --rows sched_mlp --runs 2,5

Each figure is (instructions of a process that codegens a row N times) - (the same with M times), over N - M: the
import and the first (cold) codegens cancel out. A run of a tree takes a minute or two under callgrind.
"""
from __future__ import annotations
import argparse, os, re, shutil, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = """
import gc, sys
root, row, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, root + '/bench'); sys.path.insert(0, root)
import compiler_speed as cs
c = cs.graft_compiler()
for _ in range(n):
  out = cs.MODELS[row](c.param); gc.collect(); c.codegen(out)
"""


def instructions(tree: str, row: str, n: int) -> int:
  with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f: f.write(WORKER)
  try:
    # the interpreter itself (sys.executable may be a launcher script that valgrind would follow instead)
    python = os.path.realpath(sys.executable)
    # one hash seed (set and dict orders, hence the work, are the same in every run), no debug output or statistics
    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "REWRITE_STATS", "REWRITE_STATS_FILE")}
    r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", python, f.name, tree, row, str(n)],
                       capture_output=True, text=True, cwd=tempfile.gettempdir(), env={**env, "PYTHONHASHSEED": "0"})
  finally: os.unlink(f.name)
  if r.returncode != 0 or not (m := re.search(r"Collected : (\d+)", r.stderr)):
    raise SystemExit(f"callgrind run of {row} in {tree} failed (exit {r.returncode}):\n{r.stderr[-2000:]}")
  return int(m.group(1))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rows", default="sched_mlp,sched_tfm", help="compiler_speed rows (comma-separated)")
  ap.add_argument("--against", action="append", default=[], help="another checkout to count beside this one")
  ap.add_argument("--runs", default="2,5", help="M,N: codegens in the short and the long process (default 2,5)")
  args = ap.parse_args(argv)
  if shutil.which("valgrind") is None: raise SystemExit("valgrind is not installed (apt-get install -y valgrind)")
  lo, hi = map(int, args.runs.split(","))
  if not 0 < lo < hi: ap.error("--runs: M,N with 0 < M < N")
  trees = [ROOT] + [os.path.abspath(t) for t in args.against]
  from tabulate import tabulate
  table = []
  for row in args.rows.split(","):
    counts = [(instructions(t, row, hi) - instructions(t, row, lo)) / (hi - lo) for t in trees]
    table.append([row, *(f"{c / 1e6:,.0f}" for c in counts), *(f"{counts[0] / c:.2f}" for c in counts[1:])])
  names = ["this tree"] + args.against
  print(tabulate(table, headers=["row", *(f"{n} (M instr.)" for n in names), *(f"this / {n}" for n in args.against)],
                 tablefmt="github"))


if __name__ == "__main__":
  main()
