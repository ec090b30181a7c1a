"""The CPU device end to end: Buffers, the pooled allocator, and C kernels built with gcc and run through cffi."""
import hashlib
import os, re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rewrite.dtypes import dtypes
from runtime import cache
from runtime.buffer import Buffer
from runtime.cpu import CPUDevice, kernel_prototype
from runtime.device import CompileError, Device, get_device

REPO = Path(__file__).resolve().parent.parent

# Kernels follow the C renderer's convention: the definition starts a line with `void NAME(`
ADD = """
void add(float* restrict out, const float* restrict a, const float* restrict b, int n) {
  #pragma omp parallel for
  for (int i = 0; i < n; i++) out[i] = a[i] + b[i];
}
void scale(double* out, const double* x, double k, long long n) {
  for (long long i = 0; i < n; i++) out[i] = x[i] * k;
}
"""


@pytest.fixture(autouse=True)
def cache_env(tmp_path, monkeypatch):
  monkeypatch.setenv("GRAFT_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.delenv("GRAFT_CACHE", raising=False)
  monkeypatch.delenv("CC", raising=False)
  cache.clear_memory()
  yield tmp_path / "cache"
  cache.clear_memory()


@pytest.fixture(scope="module")
def cpu(): return get_device("CPU")


def test_devices_are_named_and_cached(monkeypatch, cpu):
  assert isinstance(cpu, CPUDevice) and cpu.name == "CPU" and get_device("cpu") is cpu
  monkeypatch.setenv("DEVICE", "CPU")
  assert Device.default() is cpu
  monkeypatch.setenv("DEVICE", "TPU")
  with pytest.raises(ValueError, match="CPU, CUDA"):
    Device.default()


def test_add_kernel_matches_numpy(cpu):
  progs = cpu.build(ADD, ["add", "scale"])
  n = 1000
  a, b = np.random.rand(n).astype(np.float32), np.random.rand(n).astype(np.float32)
  A, B = Buffer("CPU", n, dtypes.float32).copyin(a), Buffer("CPU", n, dtypes.float32).copyin(b)
  out = Buffer("CPU", n, dtypes.float32)
  assert progs["add"](out.handle, A.handle, B.handle, n) is None
  np.testing.assert_array_equal(out.numpy(), a + b)  # no -ffast-math: bit-equal to numpy

  x = np.random.rand(n)
  X, Y = Buffer("CPU", n, dtypes.float64).copyin(x), Buffer("CPU", n, dtypes.float64)
  elapsed = progs["scale"](Y.handle, X.handle, 2.5, n, wait=True)
  assert isinstance(elapsed, float) and 0 < elapsed < 10  # seconds the call took, not a count or a stub 0
  np.testing.assert_array_equal(Y.numpy(), x * 2.5)


def test_prototypes_come_from_the_source():
  assert kernel_prototype(ADD, "add") == "void add(uintptr_t, uintptr_t, uintptr_t, int);"
  assert kernel_prototype(ADD, "scale") == "void scale(uintptr_t, uintptr_t, double, long long);"
  with pytest.raises(ValueError, match="void missing\\("):
    kernel_prototype(ADD, "missing")


def test_build_is_cached(cpu, cache_env):
  cpu.build(ADD, ["add"])
  before = dict(cache.stats)
  cpu.build(ADD, ["add"])
  assert cache.stats["build"] == before.get("build", 0)
  assert len(list(cache_env.glob("*.so"))) == 1 and len(list(cache_env.glob("*.c"))) == 1


# a later run of the program: it builds ADD (from the disk cache when it can) and adds with it
ADD_IN_A_NEW_PROCESS = ("import numpy as np\n"
                        "from runtime import cache\n"
                        "from runtime.buffer import Buffer\n"
                        "from runtime.device import get_device\n"
                        "from rewrite.dtypes import dtypes\n"
                        f"add = get_device('CPU').build({ADD!r}, ['add'])['add']\n"
                        "a = Buffer('CPU', 4, dtypes.float32).copyin(np.arange(4, dtype=np.float32))\n"
                        "out = Buffer('CPU', 4, dtypes.float32)\n"
                        "add(out.handle, a.handle, a.handle, 4)\n"
                        "print(out.numpy().tolist(), dict(cache.stats))\n")


def run_add_in_a_new_process() -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-c", ADD_IN_A_NEW_PROCESS], cwd=REPO, capture_output=True, text=True)


def test_second_process_loads_from_disk(cpu, cache_env):
  so = cpu.build(ADD, ["add"])["add"].path
  mtime = so.stat().st_mtime_ns
  r = run_add_in_a_new_process()
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == "[0.0, 2.0, 4.0, 6.0] {'disk': 1}"  # no 'build': gcc never ran
  assert so.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("data", [b"", b"\x7fELF\x02\x01\x01 and no more"], ids=["empty", "bad ELF"])
def test_a_cached_library_that_fails_to_load_is_rebuilt(cpu, cache_env, data):
  so = cpu.build(ADD, ["add"])["add"].path
  so.unlink()  # (this process has it mapped: a new file, not an overwrite)
  so.write_bytes(data)
  Path(f"{so}.sum").write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")  # its checksum matches
  r = run_add_in_a_new_process()
  assert r.returncode == 0, r.stderr
  assert r.stdout.strip() == "[0.0, 2.0, 4.0, 6.0] {'disk': 1, 'build': 1}" and "failed to load" in r.stderr
  r = run_add_in_a_new_process()
  assert r.stdout.strip() == "[0.0, 2.0, 4.0, 6.0] {'disk': 1}" and r.stderr == ""  # healed


def mapped_libraries(d: Path) -> int:
  """How many distinct files under `d` this process has mapped, from /proc/self/maps."""
  with open("/proc/self/maps") as f:
    return len({line.split()[-1] for line in f if line.rstrip().endswith(".so") and str(d) in line})


def test_loaded_libraries_are_capped_and_evicted_kernels_load_again(cpu, cache_env, monkeypatch):
  monkeypatch.setenv("GRAFT_MAX_LIBRARIES", "3")
  programs = [cpu.build(ADD.replace("a[i] + b[i]", f"a[i] + b[i] + {k}"), ["add"])["add"] for k in range(6)]
  assert mapped_libraries(cache_env) == 3
  a = Buffer("CPU", 5, dtypes.float32).copyin(np.arange(5, dtype=np.float32))
  out = Buffer("CPU", 5, dtypes.float32)
  for k, add in enumerate(programs):  # the first three were unloaded: each loads again, and another goes
    add(out.handle, a.handle, a.handle, 5)
    assert out.numpy().tolist() == [2 * i + k for i in range(5)]
    assert mapped_libraries(cache_env) <= 3
  monkeypatch.setenv("GRAFT_MAX_LIBRARIES", "many")
  with pytest.raises(ValueError, match="GRAFT_MAX_LIBRARIES='many'"): cpu.build(ADD, ["add"])


def rotate_kernel(name: str, n: int) -> str:
  """out[i] = a[(i + n/2) % n] + 1, a loop of one-element chunks that the threads of a team share (renderers/c.py's
  form): each half of out is read from the half that other chunks write."""
  from renderers.c import team_entries
  return f"""#include <stdint.h>
static void {name}_work(float* restrict out, const float* restrict a) {{
  #pragma omp for schedule(dynamic, 1) nowait
  for (int i = 0; i < {n}; i++) out[i] = a[(i + {n // 2}) % {n}] + 1;
}}
{team_entries(name, ["float* restrict out", "const float* restrict a"])}
"""


def test_a_team_runs_kernels_one_after_another_in_one_parallel_region(cpu, cache_env, monkeypatch):
  n = 1 << 12
  rotate = cpu.build(rotate_kernel("rotate", n), ["rotate"])["rotate"]
  assert rotate.team is not None and cpu.build(ADD, ["add"])["add"].team is None   # no add_team: a team of its own
  a = Buffer("CPU", n, dtypes.float32).copyin(np.arange(n, dtype=np.float32))
  b, c, d = (Buffer("CPU", n, dtypes.float32) for _ in range(3))
  # each kernel reads what the one before wrote on other threads: the team waits for all of it in between
  for _ in range(20): cpu.run_team([(rotate, [b.handle, a.handle]), (rotate, [c.handle, b.handle]), (rotate, [d.handle, c.handle])])
  np.testing.assert_array_equal(d.numpy(), np.roll(np.arange(n, dtype=np.float32), -n // 2) + 3)
  monkeypatch.setenv("GRAFT_MAX_LIBRARIES", "1")
  cpu.build(ADD.replace("a[i] + b[i]", "a[i] - b[i]"), ["add"])   # unloads rotate's library: the team loads it again
  assert rotate.team is None
  cpu.run_team([(rotate, [b.handle, a.handle]), (rotate, [c.handle, b.handle])])
  np.testing.assert_array_equal(c.numpy(), np.arange(n, dtype=np.float32) + 2)
  # kernels of two libraries under a cap of one: loading the second unloads the first, so they run one by one
  other = cpu.build(rotate_kernel("other", n), ["other"])["other"]
  cpu.run_team([(rotate, [b.handle, a.handle]), (other, [c.handle, b.handle]), (rotate, [d.handle, c.handle])])
  np.testing.assert_array_equal(d.numpy(), np.roll(np.arange(n, dtype=np.float32), -n // 2) + 3)


def test_a_team_takes_its_kernels_addresses_after_loading_them_all(cpu, cache_env, monkeypatch):
  # [pa, px, py, pa] under a cap of 3 with px and py unloaded and pa's library the oldest: loading px and py unloads pa's,
  # and the second pa loads it again at a new address, which the first call must use too (not the unmapped old one)
  monkeypatch.setenv("GRAFT_MAX_LIBRARIES", "3")
  n = 1 << 12
  px, py = (cpu.build(rotate_kernel(name, n).replace("+ 1;", "+ 100;"), [name])[name] for name in ("px", "py"))
  pa = cpu.build(rotate_kernel("pa", n), ["pa"])["pa"]
  for name in ("z1", "z2"): cpu.build(rotate_kernel(name, n), [name])
  assert pa.team is not None and px.team is None and py.team is None
  a = Buffer("CPU", n, dtypes.float32).copyin(np.arange(n, dtype=np.float32))
  b, c, d, e = (Buffer("CPU", n, dtypes.float32) for _ in range(4))
  cpu.run_team([(pa, [b.handle, a.handle]), (px, [c.handle, b.handle]), (py, [d.handle, c.handle]), (pa, [e.handle, d.handle])])
  np.testing.assert_array_equal(e.numpy(), np.arange(n, dtype=np.float32) + 202)


def test_tensor_programs_outlive_their_libraries(cache_env, monkeypatch):
  from tensor import Tensor
  monkeypatch.setenv("GRAFT_MAX_LIBRARIES", "2")
  xs = [np.arange(n, dtype=np.float32) for n in (3, 4, 5, 6)]
  for _ in range(2):  # the second round runs plans whose kernels' libraries were unloaded
    for x in xs: np.testing.assert_array_equal((Tensor(x) * 3 + 1).numpy(), x * 3 + 1)
  assert mapped_libraries(cache_env) <= 2


def test_compile_error_shows_gcc_and_the_source(cpu):
  bad = "void broken(float* out) { out[0] = undeclared_thing; }\n"
  with pytest.raises(CompileError) as e:
    cpu.build(bad, ["broken"])
  msg = str(e.value)
  assert "undeclared_thing" in msg and "error" in msg
  src = next(w for w in msg.split() if w.endswith(".c"))
  assert Path(src).read_text() == bad  # the path in the message is the real file


def test_missing_compiler(cpu, monkeypatch):
  monkeypatch.setenv("CC", "/nonexistent/cc")
  with pytest.raises(CompileError, match="'/nonexistent/cc' not found"):
    cpu.build(ADD, ["add"])


def test_cache_off_still_builds(cpu, monkeypatch, cache_env):
  monkeypatch.setenv("GRAFT_CACHE", "0")
  prog = cpu.build(ADD, ["add"])["add"]
  assert not cache_env.exists() and prog.path.exists()
  a = Buffer("CPU", 3, dtypes.float32).copyin(np.ones(3, np.float32))
  prog(a.handle, a.handle, a.handle, 3)
  assert a.numpy().tolist() == [2.0, 2.0, 2.0]


def test_buffer_is_lazy_and_checks_copies():
  buf = Buffer("CPU", 6, dtypes.int32)
  assert not buf.allocated and buf.nbytes == 24 and "unallocated" in repr(buf)
  buf.copyin(np.arange(6, dtype=np.int32).reshape(2, 3))  # any shape with the right element count
  assert buf.allocated and buf.numpy().tolist() == [0, 1, 2, 3, 4, 5]
  with pytest.raises(ValueError, match="float64.*astype"):
    buf.copyin(np.zeros(6))
  with pytest.raises(ValueError, match="5 elements.*holds 6"):
    buf.copyin(np.zeros(5, np.int32))
  assert buf != Buffer("CPU", 6, dtypes.int32) and len({buf, buf}) == 1  # identity, not contents
  with pytest.raises(ValueError, match="CPU, CUDA"):
    Buffer("GPU", 6, dtypes.int32)


def test_buffer_roundtrip_every_dtype():
  for dt in dtypes.all():
    x = (np.arange(10) % 2).astype(dt.np) if dt.np is not None else np.arange(10, dtype=np.uint16)
    assert np.array_equal(Buffer("CPU", 10, dt).copyin(x).numpy(), x), dt


def test_a_split_version_keeps_the_old_contents_and_hands_the_memory_on():
  old = Buffer("CPU", 1000, dtypes.float32).copyin(np.arange(1000, dtype=np.float32))
  memory = old.handle
  new = old.split_version()                  # one copy, memory to memory (CPUAllocator.copy)
  assert new.handle == memory and old.handle != memory
  new.copyin(np.zeros(1000, np.float32))
  np.testing.assert_array_equal(old.numpy(), np.arange(1000, dtype=np.float32))


def test_freed_memory_is_reused(cpu):
  alloc = cpu.allocator
  alloc.clear_pool()
  buf = Buffer("CPU", 1000, dtypes.float32)
  h = buf.handle
  del buf  # back to the pool...
  assert alloc.pool[4000] == [h]
  assert Buffer("CPU", 1000, dtypes.float32).handle == h  # ...and out again for the same size
  alloc.clear_pool()
  assert alloc.pooled_bytes() == 0


def test_handles_are_aligned(cpu):
  bufs = [Buffer("CPU", n, dtypes.uint8) for n in (1, 3, 64, 100, 4097, 3 << 20)]
  assert all(b.handle % 64 == 0 for b in bufs)
  assert bufs[-1].handle % (2 << 20) == 0  # huge-page aligned, so madvise can use 2 MiB pages


def test_library_cap_bench_runs(tmp_path):
  r = subprocess.run([sys.executable, str(REPO / "bench" / "library_cap.py"), "--kernels", "3", "--cache-dir",
                      str(tmp_path / "cache")], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  rows = [ln for ln in r.stdout.splitlines() if ln.startswith(("| default cap", "| no cap"))]
  assert len(rows) == 2 and all("failed" not in ln for ln in rows), r.stdout


def test_the_openmp_runtime_stays_mapped_when_every_kernel_library_is_unloaded():
  # its idle worker threads spin inside it after a parallel loop: unmapping it under them is a SIGSEGV
  program = ("import numpy as np\n"
             "from runtime.device import get_device\n"
             "from runtime.buffer import Buffer\n"
             "from rewrite.dtypes import dtypes\n"
             "cpu = get_device('CPU')\n"
             # a library without a parallel loop first: it loads no OpenMP runtime, so there is nothing to pin yet
             "cpu.build('void serial(float* x) { x[0] = 1; }', ['serial'])\n"
             f"add = cpu.build({ADD!r}, ['add'])['add']\n"
             "a = Buffer('CPU', 1 << 16, dtypes.float32).copyin(np.ones(1 << 16, dtype=np.float32))\n"
             "add(a.handle, a.handle, a.handle, 1 << 16)\n"
             "while cpu._libs: cpu._libs.popitem()[1].unload()\n"
             "print(any('omp' in line for line in open('/proc/self/maps')), a.numpy()[:2].tolist())\n")
  r = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True,
                     env={**os.environ, "OMP_NUM_THREADS": "4", "OMP_WAIT_POLICY": "active"})
  assert r.returncode == 0, r.stderr
  assert r.stdout.split() == ["True", "[2.0,", "2.0]"]


def omp_settings(**env: str) -> dict[str, str]:
  """The wait settings libgomp reports (OMP_DISPLAY_ENV) when a parallel kernel first loads it in a fresh process whose
  environment holds only `env` of the two variables."""
  program = ("from runtime.device import get_device\n"
             "from runtime.buffer import Buffer\n"
             "from rewrite.dtypes import dtypes\n"
             f"add = get_device('CPU').build({ADD!r}, ['add'])['add']\n"
             "a = Buffer('CPU', 64, dtypes.float32)\n"
             "add(a.handle, a.handle, a.handle, 64)\n")
  base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
  r = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True,
                     env={**base, **env, "OMP_DISPLAY_ENV": "VERBOSE", "GRAFT_CACHE": "0"})
  assert r.returncode == 0, r.stderr
  # (libgomp of GCC 12 prints `OMP_WAIT_POLICY = 'PASSIVE'`; newer ones prefix a device: `[host] OMP_WAIT_POLICY = ...`)
  found = re.findall(r"^\s*(?:\[\w+\]\s*)?(OMP_WAIT_POLICY|GOMP_SPINCOUNT) = '?([^'\s]+)", r.stdout + r.stderr, re.M)
  return dict(reversed(found))   # (the first line of each name: the host's)


def test_threads_sleep_between_parallel_loops_unless_the_user_asks_them_to_spin():
  # passive: a thread that finishes a loop sleeps at once (libgomp's default spins ~4 ms); a user's GOMP_SPINCOUNT
  # still reaches libgomp beside it (a short spin before the sleep: the experiment docs/design.md describes)
  assert omp_settings()["OMP_WAIT_POLICY"] == "PASSIVE"
  assert omp_settings(GOMP_SPINCOUNT="20000") == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}
  assert omp_settings(OMP_WAIT_POLICY="active")["OMP_WAIT_POLICY"] == "ACTIVE"
