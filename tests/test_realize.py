"""Realizing from the user's side: debug output, the on-disk compile cache across processes, compiler errors."""
import os, subprocess, sys, textwrap
import numpy as np
import pytest

PROGRAM = textwrap.dedent("""
  import numpy as np
  from tensor import Tensor
  from runtime import cache
  x = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
  out = ((x * 2 + 1).relu().sum(axis=1)).numpy()
  assert np.allclose(out, (np.arange(12, dtype=np.float32).reshape(3, 4) * 2 + 1).sum(axis=1)), out
  print("builds", cache.stats["build"], "disk hits", cache.stats["disk"])
""")


def run(env_extra: dict, program: str = PROGRAM) -> subprocess.CompletedProcess:
  env = {**os.environ, **env_extra}
  return subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)


def test_second_process_hits_the_disk_cache(tmp_path):
  first = run({"GRAFT_CACHE_DIR": str(tmp_path)})
  assert first.returncode == 0, first.stderr
  assert "builds 1 disk hits 0" in first.stdout
  second = run({"GRAFT_CACHE_DIR": str(tmp_path)})
  assert second.returncode == 0, second.stderr
  assert "builds 0 disk hits 1" in second.stdout


def test_a_corrupted_cache_entry_is_rebuilt(tmp_path):
  assert run({"GRAFT_CACHE_DIR": str(tmp_path)}).returncode == 0
  for lib in [*tmp_path.glob("*.so"), *tmp_path.glob("*.cubin")]: lib.write_bytes(lib.read_bytes()[:100])  # truncated, as a crash mid-write would leave it
  again = run({"GRAFT_CACHE_DIR": str(tmp_path)})
  assert again.returncode == 0, again.stderr
  assert "builds 1" in again.stdout


def test_debug_levels_print_realizes_kernels_and_source(tmp_path):
  one = run({"DEBUG": "1", "GRAFT_CACHE_DIR": str(tmp_path)}).stdout
  assert "realize: 1 kernels" in one
  two = run({"DEBUG": "2", "GRAFT_CACHE_DIR": str(tmp_path)}).stdout
  assert "ms" in two and ("GB/s" in two or "GFLOP/s" in two)
  three = run({"DEBUG": "3", "GRAFT_CACHE_DIR": str(tmp_path)}).stdout
  assert "void r_3_" in three and "*(data0+" in three  # the kernel's source, its store included


@pytest.mark.skipif(os.environ.get("DEVICE", "CPU").upper() != "CPU",
                    reason="CC names the CPU's C compiler; a missing nvcc is tested in test_runtime_cuda.py")
def test_a_missing_compiler_names_itself(tmp_path):
  r = run({"CC": "/nonexistent/cc", "GRAFT_CACHE_DIR": str(tmp_path)})
  assert r.returncode != 0
  assert "/nonexistent/cc" in r.stderr and "CompileError" in r.stderr


def test_unknown_device_is_refused():
  r = run({"DEVICE": "TPU"}, "from tensor import Tensor\nTensor([1.0, 2.0]).numpy()")
  assert r.returncode != 0 and "TPU" in r.stderr and "CPU" in r.stderr


@pytest.mark.skipif(os.environ.get("DEVICE", "CPU").upper() != "CPU", reason="OpenMP loops are the CPU's C renderer's")
def test_a_parallel_loop_body_is_a_function_of_its_own(tmp_path):
  # gcc vectorizes loops in a plain function that it leaves scalar inside OpenMP's outlined region
  program = "from tensor import Tensor\nx = Tensor.ones(512, 512)\n(x * 2 + 1).numpy()"
  out = run({"DEBUG": "3", "GRAFT_CACHE_DIR": str(tmp_path)}, program).stdout
  assert "#pragma omp for" in out and "_body0(" in out and "__attribute__((noinline))" in out


def test_a_warm_call_reuses_its_plan_and_another_constant_does_not(monkeypatch):
  from tensor import Tensor
  from runtime import realize as rt
  monkeypatch.setattr(rt, "_plans", {})   # a table that earlier tests filled would drop its oldest plan as this one adds
  x = Tensor(np.arange(6, dtype=np.float32))
  def program(c): return rt.build_program([((x * c + 1).uop, x.device)])
  program(2.0)
  plans = len(rt._plans)
  program(2.0)                     # the same graph, rebuilt: its plan is found by its structure
  assert len(rt._plans) == plans
  program(-2.0)                    # another constant is another program
  assert len(rt._plans) == plans + 1
  np.testing.assert_allclose((x * -2.0 + 1).numpy(), np.arange(6) * -2.0 + 1)


def test_new_kernels_are_dealt_into_compiler_calls_of_about_equal_source():
  from runtime.realize import CompiledKernel, compile_groups
  cks = [CompiledKernel(f"k{i}", "CUDA", "x" * n, None, [], 0, 0, frozenset()) for i, n in enumerate([900, 100, 500, 400, 50, 450])]
  groups = compile_groups(cks, 3)
  assert sorted(ck.name for g in groups for ck in g) == sorted(ck.name for ck in cks)   # each kernel once
  assert sorted(sum(len(ck.source) for ck in g) for g in groups) == [650, 850, 900]
  assert compile_groups(cks, 1) == [sorted(cks, key=lambda ck: -len(ck.source))] and len(compile_groups(cks[:2], 8)) == 2
