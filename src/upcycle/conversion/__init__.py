"""Dense checkpoint -> upcycled model: the checks before anything is read, the probe and calibration data, the
block-by-block conversion of a model in memory, on disk or from several sources, the function-preservation
check, and the conversion report. Reading and writing folders is `upcycle.checkpoint`'s; writing a stock
checkpoint is `upcycle.export`'s."""
