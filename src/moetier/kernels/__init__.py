"""Compute on an expert slot: the SwiGLU expert functions, the quantized slot formats and their
matmuls, sparse SwiGLU, the native (csrc/) kernels with their torch fallbacks, ISA detection."""
