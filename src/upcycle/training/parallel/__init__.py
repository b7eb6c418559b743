"""How a run spreads over processes and memory: the accelerator (single, DDP, FSDP2), the sharding helpers that
read and write whole tensors of a sharded model, and activation checkpointing."""
