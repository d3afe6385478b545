"""Reading and writing stored experts by layout: checkpoint headers and safetensors reads, the
quantized tiers moetier writes (format, reader, quantize driver). Knows bytes, shapes and dtypes;
never imports the runtime, the store or the model tables (it is handed layouts)."""
