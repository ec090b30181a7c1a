"""The benchmarks run (smoke runs at small sizes) and print their tables."""
import os, subprocess, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(script: str, *args: str, timeout: int = 600) -> str:
  """The standard output of `python3 bench/<script> args...`, which must exit 0."""
  out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=timeout)
  assert out.returncode == 0, out.stderr
  return out.stdout


def test_rewrite_engine_bench_prints_a_table():
  lines = bench("rewrite_engine.py", "--quick").splitlines()
  assert lines[0].startswith("| measure") and "graft" in lines[0]
  for row in ("(a) dispatch", "(b) rewrite", "(c) build"): assert any(row in l for l in lines), row
  assert any("UOps/s" in l for l in lines)


def test_gpu_reduce_bench_runs_its_table_on_the_cpu():
  # on the CPU no split is offered: the table's split column says so ("-"); on a GPU it holds the split's times
  lines = bench("gpu_reduce.py", "--device", "CPU", "--quick").splitlines()
  assert lines[1].startswith("| input") and "one kernel" in lines[1] and "split" in lines[1]
  assert len([l for l in lines if l.startswith("| ") and "x" in l.split("|")[1]]) == 3


def test_models_bench_runs_graft_and_its_jit_on_a_tiny_gpt():
  out = bench("models.py", "--layers", "1", "--tokens", "8", "--width", "32", "--heads", "2", "--only", "graft-plain,graft-jit")
  rows = {l.split()[1]: l for l in out.splitlines() if l.strip().startswith("graft")}
  assert set(rows) == {"plain", "jit"} and "failed" not in out, out
  assert "new/same input" in rows["plain"] and "host" in rows["jit"]


def test_warm_calls_bench_reports_the_ratio_and_the_growth():
  out = bench("warm_calls.py", "--calls", "1200", "--timed", "5", "--size", "8")
  assert "new input" in out and "resident growth after the first 1,000" in out


def test_graph_build_bench_times_each_operation_and_the_gpt_forward():
  out = bench("graph_build.py", "--quick")
  lines = out.splitlines()
  assert lines[0].startswith("operation") and "graft" in lines[0]
  for op in ("x + y", "x @ w", "x.softmax(-1)"): assert any(l.startswith(op) for l in lines), op
  assert any(l.startswith("gpt forward, 2 layers") and "find_program" in l for l in lines), out


def test_host_time_bench_splits_a_warm_call_of_each_workload():
  out = bench("host_time.py", "--repeats", "100").splitlines()
  assert out[0].split()[-7:] == ["build", "find_program", "run", "whole", "call", "to", "launch"], out[0]
  assert [l.split()[0] for l in out[1:]] == ["ew", "sum", "softmax", "layernorm", "attn"]
  assert all(float(x) > 0 for l in out[1:] for x in l.split()[1:])


def test_first_call_bench_splits_a_cold_call_into_lowering_compiling_and_the_rest():
  lines = bench("first_call.py", "--only", "ew").splitlines()
  assert lines[0].startswith("first call") and "compile" in lines[0]
  total, lower, compile_, rest = map(float, lines[1].split()[1:])
  assert lines[1].startswith("ew") and total > 0 and lower > 0 and compile_ > 0 and abs(total - lower - compile_ - rest) < 2e-3   # (each rounded to 1 ms)


def test_train_kernels_bench_splits_a_tiny_step_by_thread_count_and_phase():
  out = bench("train_kernels.py", "--layers", "1", "--tokens", "8", "--width", "32", "--heads", "2", "--batch", "2",
              "--vocab", "64", "--repeat", "2", "--threads", "1,2", "--phases")
  assert "kernel time ms: 1 thread" in out and ", 2 threads" in out, out
  phases = {line.split()[0]: float(line.split()[1]) for line in out.splitlines()
            if line.split()[:1] in (["forward"], ["backward"], ["optimizer"])}
  assert set(phases) == {"forward", "backward", "optimizer"} and all(ms > 0 for ms in phases.values()), out


def test_gpt_ops_bench_sets_each_step_beside_torch():
  out = bench("gpt_ops.py", "--only", "proj,layernorm", "--copies", "1", "--rounds", "1")
  rows = {l.split()[0]: l.split() for l in out.splitlines()[2:]}
  assert set(rows) == {"proj", "layernorm"}, out
  assert float(rows["proj"][1]) > 0 and "upcast" in " ".join(rows["proj"]), out   # graft's time, its register tile


def test_nvcc_time_bench_times_each_kernel_both_ways():
  import pytest
  from runtime import cuda
  from runtime.device import CompileError
  try: cuda.find_nvcc()
  except CompileError: pytest.skip("nvcc not found")
  lines = bench("nvcc_time.py", "--only", "softmax", "--repeats", "1", "--quick").splitlines()
  rows = [l.split() for l in lines[1:] if not l.split()[1] == "max"]
  assert rows and {r[4] for r in rows} == {"device", "headers"} and all(float(x) > 0 for r in rows for x in r[6:])
  assert lines[-1].split()[1] == "max" and "device" in lines[-1] and "headers" in lines[-1]
