import os

# The suite runs on CPU. Where libtpu is installed (the tpu-aot extra, for tests/analysis/test_tpu_compile.py), JAX
# would also try to start a TPU backend in every process and print libtpu's warnings on stderr, which the one-line
# error tests read; the TPU compiler tests reach libtpu directly. Subprocesses inherit this.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# XLA:CPU's LLVM backend at optimization level 0 in every test process and its children: the suite's programs are
# tiny, so most of its time goes to compiling them, which level 0 shortens (BENCHMARKS.md); the numbers agree within
# the tolerances the tests state, and runs compared bit for bit are built with the same flags. A level already set
# in XLA_FLAGS is kept.
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()
