"""Checkpoint I/O: reading and writing safetensors folders, the upcycle format, models loaded whole or a block at a
time, and where outputs may be written."""
