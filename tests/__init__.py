import os

# The suite runs on CPU. Where libtpu is installed (the tpu-aot extra, for tests/analysis/test_tpu_compile.py), JAX
# would also try to start a TPU backend in every process and print libtpu's warnings on stderr, which the one-line
# error tests read; the TPU compiler tests reach libtpu directly. Subprocesses inherit this.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
