"""Analysis of upcycled MoE layers: metrics as plain numbers (METHODS §5)."""
