"""The expert count changed after conversion: `upcycle prune` and `upcycle grow` (`expert_count.py`)."""
