"""`upcycle compare`: which upcycling method wins on a given model and data, measured the same way.

plan.py (the grid of cells and their configs, every check before any output), cell.py (one cell: convert,
train or resume, evaluate, diagnose), diagnostics.py (the analysis metrics of a model on held-out inputs),
table.py (cells -> comparison.json and comparison.md), study_figures.py (PNG), study.py (a study run cell after
cell; `upcycle.commands.compare` is the command).
"""
