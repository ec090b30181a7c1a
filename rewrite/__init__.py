"""The rewrite engine: hash-consed UOp graphs, patterns, compiled matchers and graph_rewrite. Knows nothing of tensors."""
from .ops import Ops, GroupOp
from .dtypes import DType, PtrDType, dtypes
from .uop import UOp, pretty
