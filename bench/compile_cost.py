"""Cold cost of turning one small C kernel into a callable, both ways cffi allows, side by side:

  (a) one gcc call into a shared library, then cffi's ABI mode (`ffi.cdef` + `ffi.dlopen`) -- what runtime/cpu.py does;
  (b) cffi's API mode (`ffi.set_source` + `ffi.compile` + import of the extension it builds).

Each first build runs in a fresh process (median over --repeats processes, each with its own empty directory);
"again" is a second, different kernel built in the same process. Run: python3 bench/compile_cost.py
"""
from __future__ import annotations
import argparse, os, statistics, subprocess, sys, tempfile, time
from tabulate import tabulate

KERNEL = """
void add_{n}(float* restrict out, const float* restrict a, const float* restrict b, int n) {{
  #pragma omp parallel for
  for (int i = 0; i < n; i++) out[i] = a[i] + b[i] * {n}.0f;
}}
"""

WORKER = r'''
import os, sys, time, subprocess, importlib, cffi
way, work = sys.argv[1], sys.argv[2]
KERNEL = sys.argv[3]
def build(n):
  src = KERNEL.format(n=n)
  decl = f"void add_{n}(float* out, const float* a, const float* b, int n);"
  t0 = time.perf_counter()
  if way == "gcc+dlopen":
    c, so = os.path.join(work, f"k{n}.c"), os.path.join(work, f"k{n}.so")
    open(c, "w").write(src)
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", so, c], check=True)
    ffi = cffi.FFI(); ffi.cdef(decl); lib = ffi.dlopen(so)
  else:
    ffi = cffi.FFI(); ffi.cdef(decl)
    ffi.set_source(f"_k{n}", src, extra_compile_args=["-O3", "-march=native", "-fopenmp"], extra_link_args=["-fopenmp"])
    ffi.compile(tmpdir=work, verbose=False)
    sys.path.insert(0, work); lib = importlib.import_module(f"_k{n}").lib
  getattr(lib, f"add_{n}")
  return time.perf_counter() - t0
print(build(1), build(2))
'''


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  rows = {}
  for way in ("gcc+dlopen", "cffi set_source"):
    first, again = [], []
    for _ in range(args.repeats):
      with tempfile.TemporaryDirectory() as work:
        out = subprocess.run([sys.executable, "-c", WORKER, way, work, KERNEL], capture_output=True, text=True, check=True)
        a, b = map(float, out.stdout.split())
        first.append(a); again.append(b)
    rows[way] = (statistics.median(first), statistics.median(again))
  (a1, a2), (b1, b2) = rows["gcc+dlopen"], rows["cffi set_source"]
  print(tabulate([("gcc + ffi.dlopen (used)", f"{a1 * 1e3:.0f}", f"{a2 * 1e3:.0f}"),
                  ("cffi set_source + compile", f"{b1 * 1e3:.0f}", f"{b2 * 1e3:.0f}"),
                  ("ratio", f"{b1 / a1:.1f}x", f"{b2 / a2:.1f}x")],
                 headers=["way", "first build ms (fresh process)", "again ms (same process)"], tablefmt="github"))
  print(f"medians of {args.repeats} fresh processes; one small OpenMP kernel each")


if __name__ == "__main__":
  main()
