"""Executor variants of a MoE layer call, one file each, found by name in registry.EXECUTORS.

- dense.py: every routed expert computed in full with torch on the compute domain (where native does not apply);
- native.py: every routed expert of a decode-sized call in one C call (CPU, bf16, kernel library loaded);
- sparse.py: intra-expert activation sparsity (native gather kernel, masked dense for big calls);
- hybrid.py: two domains at once, CPU and GPU, scheduled per call by the cost model (CUDA only).
The protocol they share is in base.py; runtime/wire.py chooses one per engine.

Invariant: a variant is one file here plus one entry in registry.EXECUTORS; no variant imports another.
"""
