"""Pictures of an analysis: PNG figures drawn from the analysis.json dict alone (`plots.py`, one style for all of
them, so a number in a plot is the number in the file) and the self-contained report.html (`html_report.py`)."""
