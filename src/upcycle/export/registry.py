"""The stock classes an upcycled model can be exported to, by name, in the order `auto` tries them for a source.

A new class: one module with its `StockClass` (`protocol.py`), and one line here.
"""

from __future__ import annotations

from . import mixtral, qwen2_moe, qwen3_moe
from .protocol import StockClass

STOCK_CLASSES: dict[str, StockClass] = {c.name: c for c in (
    qwen2_moe.CLASS,
    qwen3_moe.CLASS,
    mixtral.CLASS,
)}
