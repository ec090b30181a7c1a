/* Empty on purpose: nvcc puts cuda_runtime.h before every translation unit, and for a source that declares itself
   what it uses (runtime/cuda.py, SELF_CONTAINED) this file, first on the include path, is the one it finds. */
