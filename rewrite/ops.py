"""Every operation of every level of the graph, in one enum, grouped by level."""
from enum import Enum, auto


class Ops(Enum):
  # graph structure
  SINK = auto(); NOOP = auto()
  # tensor level
  BUFFER = auto(); CONST = auto(); VIEW = auto(); REDUCE_AXIS = auto(); CONTIGUOUS = auto(); COPY = auto(); ASSIGN = auto()
  DETACH = auto()  # the value of its source, through which no gradient flows (rules/gradient.py); gone before realize
  DEFINE_VAR = auto(); IOTA = auto()
  # kernel level
  KERNEL = auto(); DEFINE_GLOBAL = auto(); LOAD = auto(); STORE = auto(); INDEXED = auto()
  # loop level
  RANGE = auto(); END = auto(); REDUCE = auto(); DEFINE_ACC = auto(); INDEX = auto(); SPECIAL = auto(); IF = auto(); ENDIF = auto()
  BARRIER = auto(); VECTORIZE = auto(); GEP = auto(); DEFINE_LOCAL = auto()
  # a block's product tile on tensor cores (rules/opt/tensor_core.py): a lane's accumulators, read with GEP
  MMA = auto()
  # linearization: statements in their loops (BLOCK), a loop's block complete and in place (BLOCKEND)
  BLOCK = auto(); BLOCKEND = auto()
  # host level: the steps of a host program (rules/host.py)
  ALLOC = auto(); FREE = auto(); CALL = auto(); EXTERN = auto(); PICK = auto()
  # ALU unary
  CAST = auto(); BITCAST = auto(); NEG = auto(); EXP2 = auto(); LOG2 = auto(); SIN = auto(); SQRT = auto(); RECIP = auto(); TRUNC = auto()
  # ALU binary
  ADD = auto(); MUL = auto(); IDIV = auto(); MOD = auto(); MAX = auto(); FDIV = auto()
  CMPLT = auto(); CMPNE = auto(); AND = auto(); OR = auto(); XOR = auto(); SHL = auto(); SHR = auto()
  # ALU ternary
  WHERE = auto(); MULACC = auto()

  def __repr__(self): return f"Ops.{self.name}"
  # Enum hashes by name in Python code; every UOp construction and every matcher dispatch hashes an op, so use the
  # C-level identity hash (members are singletons, also across pickling, and compare by identity anyway)
  __hash__ = object.__hash__


class GroupOp:
  Unary = frozenset({Ops.NEG, Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIP, Ops.TRUNC})
  Binary = frozenset({Ops.ADD, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.FDIV, Ops.CMPLT, Ops.CMPNE,
                      Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR})
  Ternary = frozenset({Ops.WHERE, Ops.MULACC})
  ALU = Unary | Binary | Ternary
  Elementwise = ALU | {Ops.CAST, Ops.BITCAST}
  Commutative = frozenset({Ops.ADD, Ops.MUL, Ops.MAX, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR})
  Comparison = frozenset({Ops.CMPLT, Ops.CMPNE})
  Tensor = frozenset({Ops.BUFFER, Ops.CONST, Ops.IOTA, Ops.VIEW, Ops.REDUCE_AXIS, Ops.CONTIGUOUS, Ops.COPY, Ops.ASSIGN, Ops.DETACH})
  Kernel = frozenset({Ops.KERNEL, Ops.DEFINE_GLOBAL, Ops.LOAD, Ops.STORE, Ops.INDEXED})
  Loop = frozenset({Ops.RANGE, Ops.END, Ops.REDUCE, Ops.DEFINE_ACC, Ops.INDEX, Ops.SPECIAL, Ops.IF, Ops.ENDIF, Ops.BARRIER,
                    Ops.VECTORIZE, Ops.GEP, Ops.DEFINE_LOCAL, Ops.BLOCK, Ops.BLOCKEND, Ops.MMA})
  Host = frozenset({Ops.ALLOC, Ops.FREE, Ops.CALL, Ops.EXTERN, Ops.PICK, Ops.COPY})
