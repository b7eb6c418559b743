"""An upcycle folder's experts rewritten after conversion: their count (`upcycle prune` and `upcycle grow`,
`expert_count.py`), and their storage (`upcycle compress`, `compress.py`: full experts as a base plus low-rank
deltas)."""
