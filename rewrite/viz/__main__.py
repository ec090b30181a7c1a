"""python -m rewrite.viz [-o out.html] script.py [args]: run a script while recording its rewrites, then write the
viewer's page (or, for -o x.json, the data)."""
import argparse, runpy, sys
from . import record


def main() -> None:
  ap = argparse.ArgumentParser(prog="python -m rewrite.viz", description=__doc__.splitlines()[0].split(": ", 1)[1])
  ap.add_argument("-o", "--output", default="viz.html", help="the file to write: .html (the page) or .json (the data)")
  ap.add_argument("script")
  ap.add_argument("args", nargs=argparse.REMAINDER)
  a = ap.parse_args()
  if not a.output.endswith((".html", ".json")): ap.error(f"-o {a.output}: name a file ending in .html or .json")
  sys.argv = [a.script, *a.args]
  sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(a.script)))
  with record(a.output) as rec:
    try: runpy.run_path(a.script, run_name="__main__")
    except SystemExit as e:
      if e.code not in (0, None): raise
  print(f"rewrite.viz: wrote {a.output} ({len(rec.nodes)} nodes, {len(rec.rules)} rules)", file=sys.stderr)


if __name__ == "__main__":
  main()
