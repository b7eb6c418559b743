"""Upcycled decoders written as stock checkpoints: the transformers MoE classes they export to (one module per
class, a registry, the layout all share), the writers of a stock folder and their checks (`stock_folder.py`),
`upcycle export` (`from_folder.py`) and GGUF for llama.cpp (`gguf.py`, `gguf_vocab.py`)."""
