"""The training objective: the task loss plus the router regularizers (load balance, z-loss, LIMoE entropy, DPSL),
the aux-loss-free balancer and Expert-Ensemble Self-Distillation's EMA teacher, summed by `objective.Objective`."""
