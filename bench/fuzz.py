"""Differential fuzzing of the Tensor API against numpy: random programs (tests/fuzz_programs.py), a tally, and a
minimal reproduction of every failure.

  python3 bench/fuzz.py --count 10000                 # CPU; seeds 0..9999
  DEVICE=CUDA python3 bench/fuzz.py --count 2000 --jobs 12   # the same programs on a GPU
  python3 bench/fuzz.py --count 2000 --cuda-compile   # no GPU: their kernels rendered for CUDA, compiled by nvcc
  python3 bench/fuzz.py --count 1000 --sanitize       # kernels built with -fsanitize=address,undefined
  python3 bench/fuzz.py --count 1000 --twice          # each program again on new data: the warm call checked
  python3 bench/fuzz.py --count 500 --patterns        # programs around attention, linear layers, norms before products
  GRAFT_ATTENTION=1 python3 bench/fuzz.py --count 500 --patterns   # attention fused at every size

Programs run `--batch` at a time in one realize (one compile; outputs of one shape may fuse into one kernel, which is
itself worth testing); a batch with a failure is run again one program at a time to find it, and each failing
program is shrunk to a smallest one that still fails and printed as a script. The tally counts programs that gave
numpy's answer ("ok"), other numbers ("mismatch") or an exception from Graft ("error": a compile failure, say).
"""
from __future__ import annotations
import argparse
import collections
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.fuzz_programs import Generator, run_program as run_once, run_program_twice, shrink, reproduction, names_of, op_name  # noqa: E402


def sanitized_env() -> dict[str, str]:
  """The environment of a process whose kernels are built with the sanitizers (runtime/cpu.py, GRAFT_SANITIZE)."""
  cc = os.environ.get("CC", "gcc").split()[0]
  libasan = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
  return {**os.environ, "GRAFT_SANITIZE": "1", "LD_PRELOAD": libasan, "ASAN_OPTIONS": "detect_leaks=0",
          "UBSAN_OPTIONS": "print_stacktrace=1"}


def run(count: int, seed: int, batch: int, shrink_failures: bool, jobs: int = 1, out=sys.stdout,
        twice: bool = False, patterns: bool = False) -> collections.Counter:
  t0 = time.perf_counter()
  if jobs > 1:   # seeds split into `jobs` processes (a GPU machine's compiles run side by side)
    import concurrent.futures, multiprocessing
    bounds = [seed + count * j // jobs for j in range(jobs + 1)]
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
      parts = list(pool.map(_run_part, [(lo, hi - lo, batch, shrink_failures, twice, patterns) for lo, hi in zip(bounds, bounds[1:])]))
    tally, ops, reports = collections.Counter(), collections.Counter(), []
    for t, o, r in parts: tally += t; ops += o; reports += r
  else: tally, ops, reports = _run_part((seed, count, batch, shrink_failures, twice, patterns))
  for r in reports: print(r, file=out)
  device = os.environ.get("DEVICE", "CPU")
  print(f"\n{count} programs (seeds {seed}..{seed + count - 1}) on {device}"
        f"{' with sanitizers' if os.environ.get('GRAFT_SANITIZE') == '1' else ''}{', each twice' if twice else ''}{', around model patterns' if patterns else ''}, "
        f"batches of {batch}: "
        f"{tally['ok']} ok, {tally['mismatch']} mismatch, {tally['error']} error"
        f"{', %d batch-only failures' % tally['batch only'] if tally['batch only'] else ''} in {time.perf_counter() - t0:.0f} s"
        f"{f' ({jobs} processes)' if jobs > 1 else ''}", file=out)
  print("nodes by op: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())), file=out)
  return tally


def _run_part(args) -> tuple[collections.Counter, collections.Counter, list[str]]:
  """Programs seed..seed+count-1: (tally, nodes by op, a report of each failure)."""
  seed, count, batch, shrink_failures, twice, patterns = args
  run_program = run_program_twice if twice else run_once
  tally: collections.Counter = collections.Counter()
  ops: collections.Counter = collections.Counter()
  failures = []
  for start in range(seed, seed + count, batch):
    if (start - seed) % 500 < batch and start > seed:   # a long run says how far it is (stderr: not in the tally)
      print(f"seeds {seed}..{start - 1} done: {dict(tally)}", file=sys.stderr, flush=True)
    programs = {s: draw(s, patterns) for s in range(start, min(start + batch, seed + count))}
    for p in programs.values():
      for n in names_of(p): ops[op_name(n)] += 1
    whole = run_program([o for p in programs.values() for o in p]) if batch > 1 else None
    if whole is not None and whole.kind == "ok":
      tally["ok"] += len(programs)
      continue
    alone = {s: run_program(p) for s, p in programs.items()}
    for s, outcome in alone.items():
      tally[outcome.kind] += 1
      if outcome.kind != "ok": failures.append((s, programs[s], outcome))
    if whole is not None and all(o.kind == "ok" for o in alone.values()):
      tally["batch only"] += 1   # the batch failed where each program alone passes: the batch is the program
      failures.append((start, [o for p in programs.values() for o in p], whole))
  reports = []
  for s, p, outcome in failures:
    small = shrink(p, lambda c: run_program(c).kind != "ok") if shrink_failures else p
    reports.append(f"\n--- seed {s}: {outcome.kind}: {outcome.detail}\n    smallest failing program ({len(names_of(small))} "
                   f"of {len(names_of(p))} nodes; there: {run_program(small).detail or 'passes alone'}):\n{reproduction(small)}")
  return tally, ops, reports


def draw(seed: int, patterns: bool) -> list:
  """Program `seed`: of the whole API, or (`patterns`) around one pattern of a model (tests/fuzz_programs.py)."""
  return Generator(seed).pattern_program() if patterns else Generator(seed).program()


def compile_for_cuda(count: int, seed: int, batch: int, out=sys.stdout, patterns: bool = False) -> int:
  """Without a GPU: the kernels of the programs rendered for CUDA and compiled by nvcc for sm_90, `batch` programs
  per nvcc call (setitem and assign still run on the CPU). Returns the number of nvcc failures."""
  from runtime.realize import kernel_sources
  from runtime.cuda import compile_cuda
  from renderers.cuda import renderer
  from tests.fuzz_programs import tensor_values
  failed, t0 = 0, time.perf_counter()
  for start in range(seed, seed + count, batch):
    programs = {s: draw(s, patterns) for s in range(start, min(start + batch, seed + count))}
    outs = [(tensor_values(p)[o], o) for p in programs.values() for o in p]
    sources = kernel_sources([(t.uop, t.device) for t, _ in outs if not t.is_realized], "CUDA")
    try: compile_cuda(renderer.source(list(dict.fromkeys(sources))))
    except Exception as e:  # noqa: BLE001
      failed += 1
      print(f"--- seeds {start}..{start + len(programs) - 1}: {str(e)[:2000]}", file=out)
  print(f"\n{count} programs (seeds {seed}..{seed + count - 1}) rendered for CUDA and compiled by nvcc, {batch} per "
        f"call: {failed} failed calls in {time.perf_counter() - t0:.0f} s", file=out)
  return failed


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--count", type=int, default=1000)
  ap.add_argument("--seed", type=int, default=0, help="the first seed (program i uses seed + i)")
  ap.add_argument("--batch", type=int, default=8, help="programs per realize (1: each alone)")
  ap.add_argument("--no-shrink", action="store_true", help="print failing programs as generated")
  ap.add_argument("--jobs", type=int, default=1, help="processes to split the seeds over")
  ap.add_argument("--cuda-compile", action="store_true", help="no GPU needed: render the programs' kernels for CUDA and "
                                                              "compile them with nvcc (nothing runs)")
  ap.add_argument("--twice", action="store_true", help="run each program again on new inputs (a warm call: what the "
                                                       "first call compiled and recorded is reused) and check that too")
  ap.add_argument("--patterns", action="store_true", help="programs around the patterns models are made of "
                                                          "(attention, a linear layer's epilogue, a norm before a product)")
  ap.add_argument("--sanitize", action="store_true", help="run again in a process whose kernels are built with "
                                                          "-fsanitize=address,undefined (GRAFT_SANITIZE=1)")
  args = ap.parse_args()
  if args.sanitize and os.environ.get("GRAFT_SANITIZE") != "1":
    argv = [a for a in sys.argv[1:] if a != "--sanitize"]
    sys.exit(subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=sanitized_env()).returncode)
  if args.cuda_compile: sys.exit(1 if compile_for_cuda(args.count, args.seed, max(1, args.batch), patterns=args.patterns) else 0)
  tally = run(args.count, args.seed, max(1, args.batch), not args.no_shrink, max(1, args.jobs), twice=args.twice, patterns=args.patterns)
  sys.exit(0 if tally["ok"] == args.count and not tally["batch only"] else 1)


if __name__ == "__main__":
  main()
