"""The rewrite engine: hash-consed UOp graphs, patterns, compiled matchers and graph_rewrite. Knows nothing of tensors."""
from .ops import Ops, GroupOp
from .dtypes import DType, PtrDType, dtypes
from .uop import UOp, pretty
from .upat import UPat
from .matcher import PatternMatcher, Rule
from .graph_rewrite import graph_rewrite, substitute, splice_sinks, rewrite_each, InOrder, RewriteLoopError, RuleError
from . import stats, viz
from .verify import verify, VerifyError

__all__ = ["Ops", "GroupOp", "DType", "PtrDType", "dtypes", "UOp", "pretty", "UPat", "PatternMatcher", "Rule",
           "graph_rewrite", "substitute", "splice_sinks", "rewrite_each", "InOrder", "RewriteLoopError", "RuleError", "stats", "viz",
           "verify", "VerifyError"]
