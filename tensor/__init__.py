"""The user's front door: `from tensor import Tensor, dtypes`. Tensor operations build a lazy tensor-level graph;
`.realize()`, `.numpy()`, `.tolist()` and `.item()` run it on the device DEVICE names (CPU or CUDA). `jit` (tensor/jit.py)
replays a function's host program without building its graph."""
from rewrite import dtypes
from .tensor import Tensor
from .random import manual_seed
from .args import AxisError
from .autograd import no_grad
from .jit import jit, JitError

__all__ = ["Tensor", "dtypes", "manual_seed", "AxisError", "no_grad", "jit", "JitError"]
