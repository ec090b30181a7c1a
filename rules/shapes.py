"""shape_of: the shape of a node of the tensor-level graph (docs/design.md, "The tensor-level graph").

Shapes are not stored on UOps; they follow from the node and its sources. Results are cached per node for as long as
the node lives, and computed sources-first with a stack, so a 200,000-deep chain does not recurse. The walk stops at
nodes whose shape is known or is their own (a VIEW's is its View's): asking for the shape of a node built on top of
a large graph (the tensor front end does, for each movement of a computed tensor) costs the new nodes only.
"""
from __future__ import annotations
import weakref
from rewrite import UOp, Ops, GroupOp

_shapes: weakref.WeakKeyDictionary[UOp, tuple[int, ...]] = weakref.WeakKeyDictionary()

# ops whose shape needs no source's
_OWN = frozenset({Ops.BUFFER, Ops.CONST, Ops.DEFINE_VAR, Ops.IOTA, Ops.VIEW})
# ops whose shape is their first source's: elementwise ops (sources share one shape) and whole-tensor wrappers
_like_first_source = GroupOp.Elementwise - {Ops.WHERE} | {Ops.CONTIGUOUS, Ops.COPY, Ops.ASSIGN, Ops.NOOP, Ops.DETACH}


def shape_of(u: UOp) -> tuple[int, ...]:
  """The shape of tensor-level node `u`; ValueError for nodes of the kernel or loop level, which have no shape."""
  if (known := _shapes.get(u)) is not None: return known
  if u.op in _OWN: return _shape_from_sources(u)
  stack = [u]
  while stack:
    node = stack[-1]
    if node in _shapes: stack.pop(); continue
    missing = [s for s in node.src if s.op not in _OWN and s not in _shapes]
    if missing: stack.extend(missing); continue
    for s in node.src:
      if s.op in _OWN and s not in _shapes: _shapes[s] = _shape_from_sources(s)
    _shapes[node] = _shape_from_sources(node)
    stack.pop()
  return _shapes[u]


def _shape_from_sources(u: UOp) -> tuple[int, ...]:
  op = u.op
  if op is Ops.BUFFER: return (u.arg.size,)
  if op in (Ops.CONST, Ops.DEFINE_VAR): return ()
  if op is Ops.IOTA: return (u.arg,)
  if op is Ops.VIEW: return u.arg.shape
  if op is Ops.REDUCE_AXIS:
    src_shape, axes = _shapes[u.src[0]], u.arg[1]
    if any(not 0 <= a < len(src_shape) for a in axes):
      raise ValueError(f"REDUCE_AXIS over axes {axes} of a source of shape {src_shape}: an axis is out of range")
    return tuple(1 if d in axes else s for d, s in enumerate(src_shape))
  if op is Ops.WHERE: return _shapes[u.src[1]]  # the condition may be bool of the same shape; the value decides
  if op in _like_first_source and u.src: return _shapes[u.src[0]]
  raise ValueError(f"shape_of: {op} is not a node of the tensor-level graph (shapes exist only before kernels are "
                   f"formed); call shape_of on tensor-level nodes")
