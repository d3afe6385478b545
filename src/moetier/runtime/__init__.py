"""The runtime layer of the pipeline (see DESIGN.md): real PyTorch execution of real checkpoints.

wire.py builds an Engine from an EngineConfig (the one place that wires); loader.py opens a checkpoint
into a model with TieredMoE blocks over a tiered store; moe_block.py runs route -> observe -> plan ->
move + compute -> combine per MoE layer call; executors/ holds the executor variants; observers.py,
precision.py and prefetch.py the route observers; engine.py the forward step, generation and eval;
batch.py the batch runner; lean.py and decode_hf.py the decoders.

Invariants: only wire.py decides what a model runs; runtime/ imports nothing of serve/, report/, cli/.
"""
