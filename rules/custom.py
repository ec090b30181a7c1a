"""Loading users' rule modules: `GRAFT_RULES=module.path` or `GRAFT_RULES=path/to/file.py`, several comma-separated.

A rule module is plain Python that builds PatternMatchers and places them in the pipeline with
`rules.pipeline.pipeline.insert(...)` or `.replace(...)` when it is imported (docs/rules.md). Importing it from a
script does the same as naming it in GRAFT_RULES.
"""
from __future__ import annotations
import importlib, importlib.util, os, sys
from types import ModuleType

_loaded: dict[str, ModuleType] = {}


class RulesLoadError(ImportError):
  """A module named in GRAFT_RULES could not be loaded."""


def load(spec: str) -> list[ModuleType]:
  """Import each module of a comma-separated list of module paths and .py files, once each."""
  modules = []
  for item in (s.strip() for s in spec.split(",")):
    if not item: continue
    if item in _loaded: modules.append(_loaded[item]); continue
    try: module = _load_file(item) if item.endswith(".py") or os.sep in item else importlib.import_module(item)
    except RulesLoadError: raise
    except Exception as e:
      raise RulesLoadError(f"GRAFT_RULES={spec!r}: cannot load {item!r}: {type(e).__name__}: {e}") from e
    _loaded[item] = module
    modules.append(module)
  return modules


def _load_file(path: str) -> ModuleType:
  full = os.path.abspath(path)
  if not os.path.isfile(full): raise RulesLoadError(f"GRAFT_RULES names {path!r}, which is not a file (looked at {full})")
  name = "graft_user_rules_" + "".join(c if c.isalnum() else "_" for c in full)
  if name in sys.modules: return sys.modules[name]
  spec = importlib.util.spec_from_file_location(name, full)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try: spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[name]
    raise
  return module


def load_from_environment() -> list[ModuleType]:
  spec = os.environ.get("GRAFT_RULES", "")
  return load(spec) if spec.strip() else []
