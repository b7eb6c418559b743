"""Where and how upcycle writes: every output built aside and moved into place whole (`staging.py`), the checks
and the lock that claim an output before any work (`claims.py`: inputs are never written, `--overwrite` replaces
only upcycle's own outputs, one writer at a time), and the record that says which files upcycle wrote
(`ownership.py`)."""
