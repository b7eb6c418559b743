"""How far the preservation check's allowance sits from real rounding and from a real break, on SmolLM2-135M.

Part 1, what rounding gives: `copy`, 8 experts top-2, every N-th block, per storage dtype, streamed (as `upcycle
convert default OUT` runs: computed in float32 on weights rounded to the dtype) and in memory (`--set
streaming=false`: computed in the dtype): the measured max |Δlogit|, the rounding noise of the dense model
computed in another order, and the allowance (docs/conversion.md, "Function preservation").
Part 2, what a break gives: every block MoE in float32, the experts of one block scaled (x1.01 or x2) after
`copy` made them: max |Δlogit| in multiples of the allowance (above 1: refused).

    .venv/bin/python benchmarks/studies/preservation_margin.py [--out benchmarks/results/preservation_margin.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from upcycle.scripts import output_file

ROOT = Path(__file__).resolve().parents[2]
ROUNDING = [(2, "float32"), (1, "float32"), (1, "bfloat16"), (1, "float16")]
BREAKS = [(0, 1.01), (15, 1.01), (29, 1.01), (15, 2.0)]


def report_of(cfg, method_fn=None, out: Path | None = None) -> dict:
    """The conversion's report (refused or not); written into `out` when given (the streamed path)."""
    from upcycle import methods as registry
    from upcycle.conversion.pipeline import PreservationError, convert

    saved = registry.METHODS["copy"]
    if method_fn is not None:
        registry.METHODS["copy"] = registry.Method(**{**saved.__dict__, "fn": method_fn})
    try:
        return convert(cfg, out, overwrite=True, progress=False).report.to_dict()
    except PreservationError as e:
        return e.report.to_dict()
    finally:
        registry.METHODS["copy"] = saved


def scaled_block(block: int, scale: float):
    """`copy`, with every expert's down projection in the `block`-th converted layer scaled by `scale`."""
    from upcycle import methods as registry

    copy, calls = registry.METHODS["copy"].fn, []

    def broken(ffn, layer, args):
        init = copy(ffn, layer, args)
        if len(calls) == block:
            init = replace(init, experts=replace(init.experts, w_down=init.experts.w_down * scale))
        calls.append(1)
        return init
    return broken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_file, default=ROOT / "benchmarks" / "results" / "preservation_margin.json")
    args = parser.parse_args()
    from upcycle.config import ConvertConfig
    from upcycle.config_reader import build
    from upcycle.machine import machine

    def cfg(every: int, dtype: str, **extra):
        return build(ConvertConfig, {"model": "default", "method": "copy", "moe": {"num_experts": 8, "top_k": 2},
                                     "placement": {"every": every}, "dtype": dtype, **extra})

    rounding, breaks = [], []
    with tempfile.TemporaryDirectory() as work:
        for (every, dtype), streamed in itertools.product(ROUNDING, (True, False)):
            t = time.perf_counter()
            r = report_of(cfg(every, dtype, streaming=streamed), out=Path(work) / "out" if streamed else None)
            p = r["preservation"]
            rounding.append({"every": every, "dtype": dtype, "path": "streamed" if streamed else "in memory",
                             "max_abs_logit_diff": r["max_abs_logit_diff"], "rounding_noise": p["rounding_noise"],
                             "allowed": p["allowed_max_abs_logit_diff"], "passed": p["passed"],
                             "seconds": round(time.perf_counter() - t, 1)})
            print(rounding[-1], flush=True)
    for block, scale in BREAKS:
        r = report_of(cfg(1, "float32", streaming=False), scaled_block(block, scale))
        p = r["preservation"]
        breaks.append({"block": block, "scale": scale, "max_abs_logit_diff": r["max_abs_logit_diff"],
                       "allowed": p["allowed_max_abs_logit_diff"], "passed": p["passed"],
                       "times_allowed": r["max_abs_logit_diff"] / p["allowed_max_abs_logit_diff"]})
        print(breaks[-1], flush=True)
    args.out.write_text(json.dumps({"machine": machine(), "command": "python benchmarks/studies/preservation_margin.py",
                                    "model": "the embedded SmolLM2-135M-Instruct, copy, 8 experts top-2",
                                    "rounding": rounding, "breaks": breaks}, indent=1) + "\n")


if __name__ == "__main__":
    main()
