"""The MoE core: the canonical dense FFN, the table of model families, the MoE layer with its router and expert
kernel, and the surgery that finds FFNs and installs MoE layers in their place. Imports nothing above it."""
