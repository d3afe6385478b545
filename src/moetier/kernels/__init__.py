"""Compute on an expert slot: the SwiGLU expert functions, the quantized slot formats and their
matmuls, the plain-weight matmul with its small-row kernel chosen per call (matmul.py), sparse
SwiGLU, the native (csrc/) kernels with their torch fallbacks, ISA detection.

Invariants: kernels/ never imports runtime/ and reads no environment variable (switches arrive
as arguments from RuntimeConfig); no process-wide torch flag is changed around a call.
"""
