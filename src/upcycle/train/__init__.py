"""Training and evaluation of upcycled models: the loop, its tasks, the objective with every router regularizer
(the losses, DPSL, aux-loss-free balancing, the EESD teacher), freezing rules, run folders and checkpoints."""
