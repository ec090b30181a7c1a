"""runtime/cache.py: where compiled artifacts live, when they are reused, and when they are refused.

The "compiler" here is a Python function that writes bytes, so these tests need no gcc; test_runtime_cpu.py runs the
real one.
"""
import hashlib
import os
import shutil
import stat
import warnings
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from runtime import cache

REPO = Path(__file__).resolve().parent.parent


class FakeCompiler:
  """A build(src_path, out_path) that records its calls and writes a recognisable artifact."""
  def __init__(self): self.calls = []

  def __call__(self, src: Path, out: Path):
    self.calls.append(src)
    out.write_bytes(b"ARTIFACT:" + src.read_bytes() * 100)


pytestmark = pytest.mark.usefixtures("cache_env")  # every test builds into a private cache (tests/conftest.py)


def entry(source="int x;", extra=("fakecc 1.0",)):
  """Build (or find) the artifact of `source` with a fresh FakeCompiler; returns (path, compiler)."""
  cc = FakeCompiler()
  return cache.build_cached(source, extra, ".so", cc), cc


def test_build_once_then_memory_then_disk(cache_env):
  path, cc = entry()
  assert len(cc.calls) == 1 and path.parent == cache_env
  assert path.read_bytes().startswith(b"ARTIFACT:int x;")
  # the source sits next to the artifact, named by the same key, so an error message can point at it
  assert path.with_suffix(".c").read_text() == "int x;" and cc.calls[0] == path.with_suffix(".c")
  assert entry()[1].calls == []              # same process: memory
  cache.clear_memory()
  again, cc2 = entry()
  assert again == path and cc2.calls == []   # fresh memory: disk


def test_key_covers_source_and_compiler():
  a, _ = entry("int x;", ("gcc 12", "-O3"))
  assert entry("int y;", ("gcc 12", "-O3"))[0] != a
  assert entry("int x;", ("gcc 13", "-O3"))[0] != a
  assert entry("int x;", ("gcc 12", "-O2"))[0] != a


def test_cache_dir_is_private(cache_env):
  entry()
  assert stat.S_IMODE(cache_env.stat().st_mode) == 0o700
  for f in cache_env.iterdir():
    assert f.stat().st_uid == os.geteuid() and not f.stat().st_mode & 0o077, f


def test_no_temporary_files_left(cache_env):
  entry()
  assert sorted(p.suffix for p in cache_env.iterdir()) == [".c", ".so", ".sum"]


def test_default_location_follows_xdg(monkeypatch, tmp_path):
  monkeypatch.delenv("GRAFT_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert cache.cache_dir() == tmp_path / "xdg" / "graft"
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert cache.cache_dir() == tmp_path / "home" / ".cache" / "graft"


def test_second_process_hits_the_disk(cache_env):
  path, _ = entry()
  mtime = path.stat().st_mtime_ns
  child = ("from runtime import cache\n"
           "def refuse(src, out): raise SystemExit('rebuilt')\n"
           "print(cache.build_cached('int x;', ('fakecc 1.0',), '.so', refuse), dict(cache.stats))\n")
  r = subprocess.run([sys.executable, "-c", child], cwd=REPO, env={**os.environ}, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  assert r.stdout.split()[0] == str(path) and "'disk': 1" in r.stdout and "build" not in r.stdout
  assert path.stat().st_mtime_ns == mtime


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_sum", "garbage_sum"])
def test_damaged_entry_is_rebuilt(damage):
  path, _ = entry()
  good = path.read_bytes()
  if damage == "truncate": path.write_bytes(good[:len(good) // 2])
  if damage == "flip": path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
  if damage == "delete_sum": Path(f"{path}.sum").unlink()
  if damage == "garbage_sum": Path(f"{path}.sum").write_text("not a checksum")
  cache.clear_memory()
  again, cc = entry()
  assert len(cc.calls) == 1 and again == path and path.read_bytes() == good
  cache.clear_memory()
  assert entry()[1].calls == []  # healed


def test_failed_build_leaves_no_entry(cache_env):
  def half_then_crash(src, out):
    out.write_bytes(b"half an artifact")
    raise RuntimeError("compiler crashed")
  with pytest.raises(RuntimeError, match="compiler crashed"):
    cache.build_cached("int x;", ("fakecc 1.0",), ".so", half_then_crash)
  assert [p.suffix for p in cache_env.iterdir()] == [".c"]  # only the source, for the error message
  path, cc = entry()
  assert len(cc.calls) == 1 and path.read_bytes().startswith(b"ARTIFACT:")


def test_entry_writable_by_others_is_not_loaded(cache_env):
  path, _ = entry()
  path.chmod(0o777)
  cache.clear_memory()
  with pytest.warns(UserWarning, match="writable by others"):
    other, cc = entry()
  assert len(cc.calls) == 1 and other.parent != cache_env
  assert not other.parent.stat().st_mode & 0o077


def test_group_writable_directory_is_not_used(cache_env):
  entry()
  cache_env.chmod(0o770)
  cache.clear_memory()
  with pytest.warns(UserWarning, match="cache directory"):
    other, cc = entry()
  assert len(cc.calls) == 1 and other.parent != cache_env


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_entry_of_another_user_is_not_loaded(cache_env):
  path, _ = entry()
  os.chown(path, 12345, 12345)
  cache.clear_memory()
  with pytest.warns(UserWarning, match="not owned by you"):
    other, cc = entry()
  assert len(cc.calls) == 1 and other.parent != cache_env


def test_symlinked_entry_is_not_loaded(cache_env, tmp_path):
  path, _ = entry()
  elsewhere = tmp_path / "elsewhere.so"
  path.rename(elsewhere)
  path.symlink_to(elsewhere)
  cache.clear_memory()
  with pytest.warns(UserWarning):
    assert len(entry()[1].calls) == 1


def test_cache_off_builds_in_a_private_dir(monkeypatch, cache_env):
  monkeypatch.setenv("GRAFT_CACHE", "0")
  path, cc = entry()
  assert len(cc.calls) == 1 and path.exists() and not cache_env.exists()
  assert not path.parent.stat().st_mode & 0o077
  assert entry()[1].calls == []  # memory still serves this process


def test_unusable_cache_dir_falls_back(monkeypatch, tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  monkeypatch.setenv("GRAFT_CACHE_DIR", str(blocker))
  with pytest.warns(UserWarning, match="cannot be created"):
    path, cc = entry()
  assert len(cc.calls) == 1 and path.exists()


def load_artifact(path: Path) -> bytes:
  """A loader that refuses what FakeCompiler did not write, as dlopen refuses a file without an ELF header."""
  data = path.read_bytes()
  if not data.startswith(b"ARTIFACT:"): raise OSError(f"{path}: invalid ELF header")
  return data


def write_whole_but_wrong(path: Path, data: bytes):
  """Replace an entry's artifact by `data` with a checksum that matches it, as a faulty disk or compiler would."""
  path.unlink()
  path.write_bytes(data)
  Path(f"{path}.sum").write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")


@pytest.mark.parametrize("data", [b"", b"\x7fELF but not really"], ids=["empty", "bad header"])
def test_an_entry_that_fails_to_load_is_rebuilt(data):
  path, _ = entry()
  write_whole_but_wrong(path, data)
  cache.clear_memory()
  cc = FakeCompiler()
  with pytest.warns(UserWarning, match="failed to load"):
    again, loaded = cache.load_cached("int x;", ("fakecc 1.0",), ".so", cc, load_artifact)
  assert len(cc.calls) == 1 and again == path and loaded.startswith(b"ARTIFACT:int x;")
  cache.clear_memory()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert cache.load_cached("int x;", ("fakecc 1.0",), ".so", FakeCompiler(), load_artifact)[0] == path  # healed


def test_a_fresh_build_that_fails_to_load_raises_at_once():
  def bad_compiler(src, out): out.write_bytes(b"not an artifact")
  with pytest.raises(OSError, match="invalid ELF header"):
    cache.load_cached("int x;", ("fakecc 1.0",), ".so", bad_compiler, load_artifact)


@pytest.fixture
def unwritable_cache(monkeypatch):
  """A cache directory this process may read but not write: mode 0500, and as root (who may write anyway) the
  process acts as user nobody while the test runs. Yields the directory; its first entry is "int x;"."""
  nobody = 65534 if os.geteuid() == 0 else None
  base = Path(tempfile.mkdtemp(prefix="graft-ro-"))
  if nobody is not None: os.chown(base, nobody, nobody)
  monkeypatch.setenv("GRAFT_CACHE_DIR", str(base / "cache"))
  monkeypatch.setattr(cache, "_private", None)  # a private directory of this user, not one root made earlier
  if nobody is not None: os.seteuid(nobody)
  try:
    cache.clear_memory()
    entry("int x;")
    (base / "cache").chmod(0o500)
    cache.clear_memory()
    yield base / "cache"
  finally:
    if nobody is not None: os.seteuid(0)
    (base / "cache").chmod(0o700)
    shutil.rmtree(base)


def test_read_only_cache_dir_builds_privately_with_one_warning(unwritable_cache):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert entry("int x;")[0].parent == unwritable_cache  # what is there still loads
    built = [entry(f"int y{i};") for i in range(3)]
  assert all(len(cc.calls) == 1 and path.parent != unwritable_cache and path.exists() for path, cc in built)
  assert not built[0][0].parent.stat().st_mode & 0o077
  assert len(caught) == 1 and "read-only" in str(caught[0].message)


def test_untrusted_entries_warn_once_per_process(cache_env):
  paths = [entry(f"int z{i};")[0] for i in range(3)]
  for p in paths: p.chmod(0o777)
  cache.clear_memory()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for i in range(3): assert len(entry(f"int z{i};")[1].calls) == 1
  assert len(caught) == 1 and "writable by others" in str(caught[0].message)


def test_parent_directories_the_cache_makes_are_private(monkeypatch, tmp_path):
  monkeypatch.setenv("GRAFT_CACHE_DIR", str(tmp_path / "new" / "deeper" / "cache"))
  path, _ = entry()
  for d in (tmp_path / "new", tmp_path / "new" / "deeper", path.parent):
    assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
