"""Training upcycled models: the loop (`trainer.py`, one step in `step.py`), the objective with every router
regularizer (the losses, DPSL, aux-loss-free balancing, the EESD teacher), freezing rules, where a run computes,
and its run folder and checkpoints. What a model trains on is a task (`upcycle.tasks`)."""
