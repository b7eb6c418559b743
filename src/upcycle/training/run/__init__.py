"""What a run writes into its folder as it trains: the folder's own rules (`folder.RunFolder`), whole checkpoints
written atomically (`checkpointer`, `state`), the log and the trackers. The format others read is `upcycle.runs`."""
