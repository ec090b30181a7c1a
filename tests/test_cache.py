"""runtime/cache.py: where compiled artifacts live, when they are reused, and when they are refused.

The "compiler" here is a Python function that writes bytes, so these tests need no gcc; test_runtime_cpu.py runs the
real one.
"""
import os
import stat
import subprocess
import sys
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
