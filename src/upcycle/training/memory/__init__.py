"""The memory plan of a run, made before any weight loads: the model built of fake tensors, its forward traced and
its steps simulated (`plan.plan_memory`), and the live-tensor peak measured on a real run to check it (`peak`)."""
