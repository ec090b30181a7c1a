"""The compiled-artifact cache shared by all devices: `build_cached(source, key_extra, suffix, build) -> Path`.

An artifact (a .so, a cubin) is keyed by the sha256 of its source, of `key_extra` (compiler path, version, flags,
target machine) and of its suffix. Lookup goes to a per-process dict first, then to the cache directory:

  - `$GRAFT_CACHE_DIR` if set, else `$XDG_CACHE_HOME/graft`, else `~/.cache/graft`;
  - `GRAFT_CACHE=0` turns the disk cache off: artifacts are built in a private temporary directory, removed at exit.

An entry is three files: `<key><suffix>` (the artifact), `<key><suffix>.sum` (its sha256 and size) and `<key>.c`
or `<key>.cu` (the source, kept so compiler errors and debuggers can name a real file). Files are written to a
temporary name in the same directory, fsynced and renamed into place, the checksum last, so a concurrent process sees
either no entry or a whole one. Because a loaded library runs with our privileges, an entry is only loaded when the
directory and its files belong to this user and are not writable by group or others, and when the artifact's size
and sha256 match its checksum file. A corrupt or truncated entry is rebuilt in place, and so is one that passes its
checksum but fails to load (`load_cached`: an empty or garbled library written whole); an untrusted one is left alone
and the artifact is built in the private directory instead (with a warning that says which path to fix). A directory
we may not write to (read-only) still serves the entries it has; what is missing is built in the private directory.
The directories the cache makes (parents included) are 0700. Each kind of warning is given once per process and
directory, not once per kernel.
"""
from __future__ import annotations
import atexit
import collections
import hashlib
import os
import shutil
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Callable, TypeVar
from rewrite.env import env_flag

FORMAT = "graft-cache-1"  # bump when the entry layout changes, so old entries are ignored
SOURCE_SUFFIX = {".so": ".c", ".cubin": ".cu", ".ptx": ".cu", ".fatbin": ".cu"}

# what happened to each request: "memory" hits, "disk" hits, "build"s; tests and benchmarks read it
stats: collections.Counter[str] = collections.Counter()
_memory: dict[tuple[str, str], Path] = {}
_private: Path | None = None
_warned: set[tuple[str, str]] = set()  # (kind, place) of the warnings given (each is given once per process)
T = TypeVar("T")


def cache_dir() -> Path | None:
  """The disk cache directory the environment asks for, or None when GRAFT_CACHE=0."""
  if not env_flag("GRAFT_CACHE", True, "the disk cache"): return None
  if (d := os.environ.get("GRAFT_CACHE_DIR")): return Path(d).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME", "")
  # the XDG spec says a relative value is invalid and must be ignored
  return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "graft"


def private_dir() -> Path:
  """A directory only this process uses (mkdtemp makes it 0700), removed when the interpreter exits."""
  global _private
  if _private is None or not _private.is_dir():
    _private = Path(tempfile.mkdtemp(prefix="graft-"))
    atexit.register(shutil.rmtree, _private, ignore_errors=True)
  return _private


def cache_key(source: str, key_extra: tuple[str, ...], suffix: str) -> str:
  h = hashlib.sha256()
  for part in (FORMAT, suffix, source, *key_extra):
    # length-prefixed, so ("ab", "c") and ("a", "bc") differ
    b = part.encode()
    h.update(len(b).to_bytes(8, "little") + b)
  return h.hexdigest()


def build_cached(source: str, key_extra: tuple[str, ...], suffix: str, build: Callable[[Path, Path], None],
                 source_suffix: str | None = None) -> Path:
  """The path of the artifact built from `source`: from memory, from disk, or made now by `build(src_path, out_path)`,
  which must write the artifact to `out_path` (and raise when it cannot). `source_suffix` names the source file's
  extension (the compiler may go by it); by default it follows `suffix` (.so -> .c, .cubin/.ptx -> .cu)."""
  return _find_or_build(source, key_extra, suffix, build, source_suffix)[0]


def load_cached(source: str, key_extra: tuple[str, ...], suffix: str, build: Callable[[Path, Path], None],
                load: Callable[[Path], T], unloadable: type[Exception] | tuple[type[Exception], ...] = OSError,
                source_suffix: str | None = None) -> tuple[Path, T]:
  """`build_cached`, then `load(path)`: the path and what `load` made of it. An entry that passed its checksum but
  fails to load with `unloadable` (an empty or non-ELF file, written whole by a faulty disk or compiler) is rebuilt
  in place, with a warning, and loaded again; an artifact built just now that fails to load raises at once."""
  path, how = _find_or_build(source, key_extra, suffix, build, source_suffix)
  try: return path, load(path)
  except unloadable as e:
    if how == "build": raise
    _warn_once("unloadable", path.parent, f"graft cache entry {path} passed its checksum but failed to load ({e}); "
                                          f"it is rebuilt")
  path, _ = _find_or_build(source, key_extra, suffix, build, source_suffix, rebuild=True)
  return path, load(path)


def _find_or_build(source: str, key_extra: tuple[str, ...], suffix: str, build: Callable[[Path, Path], None],
                   source_suffix: str | None, rebuild: bool = False) -> tuple[Path, str]:
  """(path, how): how is "memory", "disk" or "build". `rebuild` builds anew, replacing the entry."""
  source_suffix = source_suffix or SOURCE_SUFFIX.get(suffix, ".c")
  key = cache_key(source, key_extra, suffix)
  disk = cache_dir()
  where = disk if disk is not None else private_dir()
  if not rebuild and (path := _memory.get((str(where), key))) is not None and path.exists():
    stats["memory"] += 1
    return path, "memory"
  if disk is not None:
    if (problem := _dir_problem(disk)) is not None:
      _warn_once("directory", disk, f"graft cache directory {disk} {problem}, so nothing is loaded from it; fix it "
                                    f"(chmod 700), point GRAFT_CACHE_DIR elsewhere or set GRAFT_CACHE=0")
      where = private_dir()
    else:
      status = "missing" if rebuild else _check_entry(disk, key, suffix)
      if status == "ok":
        stats["disk"] += 1
        path = _memory[(str(disk), key)] = disk / f"{key}{suffix}"
        return path, "disk"
      if status == "untrusted":
        _warn_once("untrusted", disk, f"graft cache entry {disk / (key + suffix)} is not owned by you or is writable "
                                      f"by others, so it is not loaded; delete it to let the cache heal (other such "
                                      f"entries of {disk} are not reported)")
        where = private_dir()
      elif not os.access(disk, os.W_OK | os.X_OK, effective_ids=os.access in os.supports_effective_ids):
        _warn_once("read-only", disk, f"graft cache directory {disk} is read-only, so kernels not in it yet are built "
                                      f"in a private temporary directory, removed at exit; make it writable, point "
                                      f"GRAFT_CACHE_DIR elsewhere or set GRAFT_CACHE=0")
        where = private_dir()
  stats["build"] += 1
  path = _build_entry(where, key, source, source_suffix, suffix, build)
  # an untrusted disk entry keeps the memory key on the disk directory, so this process asks the disk only once
  _memory[(str(disk if disk is not None else where), key)] = path
  return path, "build"


def _warn_once(kind: str, place: Path, message: str) -> None:
  """Warn about `kind` of trouble with `place` once per process: a long run must not repeat it for every kernel."""
  if (kind, str(place)) in _warned: return
  _warned.add((kind, str(place)))
  warnings.warn(message, stacklevel=4)


# ---------------------------------------------------------------- checks

def _trusted_stat(st: os.stat_result) -> bool:
  return st.st_uid == os.geteuid() and not (st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _dir_problem(d: Path) -> str | None:
  """Create `d` 0700 if it is missing; None when it is ours and only we can write to it, else what is wrong."""
  try:
    # parents too are made 0700 (mkdir's parents=True would give them the umask's mode)
    for p in [*reversed([p for p in d.parents if not p.exists()]), d]: p.mkdir(mode=0o700, exist_ok=True)
    st = d.stat()
  except OSError as e:
    return f"cannot be created ({e.strerror})"
  if not stat.S_ISDIR(st.st_mode): return "is not a directory"
  return None if _trusted_stat(st) else "is not owned by you or is writable by others"


def _open_trusted(path: Path) -> tuple[int, os.stat_result] | str:
  """An open fd and its stat for a regular file we own and only we can write, else 'missing' or 'untrusted'."""
  try: fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
  except FileNotFoundError: return "missing"
  except OSError: return "untrusted"  # a symlink (ELOOP) or unreadable
  st = os.fstat(fd)
  if not stat.S_ISREG(st.st_mode) or not _trusted_stat(st):
    os.close(fd)
    return "untrusted"
  return fd, st


def _check_entry(d: Path, key: str, suffix: str) -> str:
  """'ok', 'missing', 'corrupt' or 'untrusted' for the entry `key` in `d`."""
  results = []
  for path in (d / f"{key}{suffix}.sum", d / f"{key}{suffix}"):
    opened = _open_trusted(path)
    if isinstance(opened, str):
      for fd, _ in results: os.close(fd)
      return opened
    results.append(opened)
  (sum_fd, _), (art_fd, art_st) = results
  try:
    with os.fdopen(sum_fd, "rb") as f: fields = f.read(200).split()
    with os.fdopen(art_fd, "rb") as f:
      # size first: a truncated artifact is caught without reading it
      if len(fields) != 2 or fields[1] != str(art_st.st_size).encode(): return "corrupt"
      return "ok" if _sha256_file(f).encode() == fields[0] else "corrupt"
  except OSError:
    return "corrupt"


def _sha256_file(f) -> str:
  h = hashlib.sha256()
  while (chunk := f.read(1 << 20)): h.update(chunk)
  return h.hexdigest()


# ---------------------------------------------------------------- writing

def _build_entry(d: Path, key: str, source: str, source_suffix: str, suffix: str,
                 build: Callable[[Path, Path], None]) -> Path:
  src_path, out_path = d / f"{key}{source_suffix}", d / f"{key}{suffix}"
  _write_atomic(src_path, source.encode())
  fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{key}", suffix=suffix + ".tmp")
  os.close(fd)
  tmp_path = Path(tmp)
  try:
    build(src_path, tmp_path)
    if not tmp_path.exists() or tmp_path.stat().st_size == 0:
      raise RuntimeError(f"building {src_path} wrote no artifact to {tmp_path}")
    with open(tmp_path, "rb") as f:
      digest, size = _sha256_file(f), os.fstat(f.fileno()).st_size
      os.fsync(f.fileno())
    # compilers and linkers recreate their output with umask bits; ours stay private
    os.chmod(tmp_path, 0o700)
    os.replace(tmp_path, out_path)
    # the checksum goes last: its presence is what makes the entry complete
    _write_atomic(d / f"{key}{suffix}.sum", f"{digest} {size}\n".encode())
  finally:
    tmp_path.unlink(missing_ok=True)
  return out_path


def _write_atomic(path: Path, data: bytes) -> None:
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    Path(tmp).unlink(missing_ok=True)
    raise
  _fsync_dir(path.parent)


def _fsync_dir(d: Path) -> None:
  # makes the rename itself durable; some filesystems refuse to open directories, which is fine to ignore
  try:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try: os.fsync(fd)
    finally: os.close(fd)
  except OSError:
    pass


def clear_memory() -> None:
  """Forget the in-memory entries (the disk ones stay): the next request goes to the disk again."""
  _memory.clear()
