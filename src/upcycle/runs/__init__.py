"""A training run's folder and checkpoints as the commands that read runs see them (analyze, eval, compare): names,
the log, the checkpoint manifest. Nothing here trains or writes a run; `upcycle.training` does, in this format."""
