"""Stock transformers MoE classes an upcycled decoder exports to: one module per class, a registry, the layout."""
