"""Random programs of the Tensor API give numpy's answers (tests/fuzz_programs.py; bench/fuzz.py runs many more).

Fixed seeds: the same few hundred programs on every run, in blocks realized together (one compile per block). A block
that fails is run one program at a time, and the first failing program is shrunk and printed as a script."""
import pytest
from tests.fuzz_programs import (Generator, Node, run_program, run_program_twice, shrink, reproduction, names_of,
                                  numpy_values, op_name)

BLOCK, BLOCKS = 25, 12   # 300 programs


def _check(programs: dict[int, list], run=run_program) -> None:
  whole = run([o for p in programs.values() for o in p])
  if whole.kind == "ok": return
  for seed, p in programs.items():
    if (outcome := run(p)).kind != "ok":
      small = shrink(p, lambda c: run(c).kind != "ok", budget=60)
      pytest.fail(f"seed {seed}: {outcome.kind}: {outcome.detail}\nsmallest failing program:\n{reproduction(small)}")
  pytest.fail(f"the block fails only when its programs are realized together: {whole.detail}")


@pytest.mark.parametrize("block", range(BLOCKS))
def test_random_programs_agree_with_numpy(block):
  _check({s: Generator(s).program() for s in range(block * BLOCK, (block + 1) * BLOCK)})


@pytest.mark.parametrize("block", range(4))
def test_random_programs_called_again_on_new_data_agree_with_numpy(block):
  # the second call reuses what the first compiled and recorded (a warm call): it must compute on its own inputs
  _check({s: Generator(s).program() for s in range(10_000 + block * BLOCK, 10_000 + (block + 1) * BLOCK)}, run_program_twice)


@pytest.mark.parametrize("block", range(2))
def test_programs_around_model_patterns_agree_with_numpy(block, monkeypatch):
  # attention (fused here at every size), a linear layer with its epilogue, a norm read by a product: at sizes past
  # the kernels' tiles, each followed by a few random steps, and each called again on new data
  monkeypatch.setenv("GRAFT_ATTENTION", "1")
  _check({s: Generator(s).pattern_program() for s in range(20_000 + block * BLOCK, 20_000 + (block + 1) * BLOCK)},
         run_program_twice)


def test_the_programs_cover_the_api():
  # what the fixed seeds exercise: every kind of node the generator knows, dtypes of every kind
  ops, dtypes = set(), set()
  for s in range(BLOCK * BLOCKS):
    for n in names_of(Generator(s).program()):
      ops.add(op_name(n))
      dtypes.add(n.dtype)
  for must in ("input", "full", "where", "matmul", "cat", "setitem", "assign", "reshape", "permute", "expand", "pad",
               "shrink", "flip", "getitem", "cast", "unary:exp", "unary:log", "unary:neg", "binary:add", "binary:lt",
               "scalar:sub", "reduce:sum", "reduce:max", "reduce:argmax", "unary:gelu", "nn:softmax", "nn:layernorm",
               "nn:logsumexp", "cumsum", "triangle:tril", "masked_fill", "gather", "take", "attention", "linear",
               "norm_linear"):
    assert must in ops, must
  assert {"float32", "float16", "float64", "int8", "uint8", "int32", "int64", "bool"} <= dtypes


def test_a_wrong_answer_is_found_and_shrunk_to_its_cause(monkeypatch):
  # a planted bug (numpy's side of `abs` made wrong) must be reported as a mismatch, and shrinking must keep
  # only what makes it: a source and the abs
  import tests.fuzz_programs as fp
  x = Node("input", ((3, 4), "float32", 1, True))
  prog = [Node("reduce", ("sum", 1, False), (Node("unary", ("abs",), (Node("flip", ((0,),), (x,)),)),))]
  assert run_program(prog).kind == "ok"
  monkeypatch.setitem(fp.UNARY, "abs", ("{0}.abs()", lambda a: -a))
  assert run_program(prog).kind == "mismatch"
  small = shrink(prog, lambda c: run_program(c).kind != "ok")
  assert [n.op for n in names_of(small)] == ["input", "unary"], reproduction(small)
  assert numpy_values(small)


def test_a_reproduction_is_a_script_of_the_tensor_api():
  text = reproduction(Generator(3).program())
  assert text.startswith("import numpy as np\nfrom tensor import Tensor\n") and "print(" in text
  compile(text, "<reproduction>", "exec")
