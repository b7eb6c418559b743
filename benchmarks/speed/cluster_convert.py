"""Conversion time and peak memory of `cluster` (Cluster-aware Upcycling) on the embedded SmolLM2-135M.

Setting: every other block (15 MoE layers), 8 experts, top-2, 64K calibration tokens per layer from
the embedded Wikipedia train split, float32, written to disk. Each run is a fresh child process, so its peak
RSS (`ru_maxrss`) is its own:

  copy      the same conversion without calibration (same model, same output size): the baseline
  cluster   calibration captured layer by layer (docs/design.md principle 6) + k-means + data-aware SVDs
  naive     what layer-by-layer capture avoids: hooks on all 15 target FFNs during ordinary forwards, keeping
            every layer's FFN inputs at once (capture only, no method; the memory floor of that approach)

Reported: wall time, the conversion's phase timings, peak RSS, and the sizes that explain it (dense model,
upcycled model, one layer's calibration sample, the calibration hidden states). One run per mode (a cluster
conversion takes minutes); 2-core machines are noisy, so compare within one results file.

Run: .venv/bin/python benchmarks/speed/cluster_convert.py [--tokens 65536] -> benchmarks/results/cluster_convert.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from upcycle.machine import machine
from upcycle.scripts import output_file

MB = 1024 * 1024



def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


def child_convert(method: str, tokens: int) -> dict:
    from upcycle.config import ConvertConfig
    from upcycle.config_reader import build
    from upcycle.conversion.pipeline import convert

    cfg = build(ConvertConfig, {"model": "default", "method": method, "moe": {"num_experts": 8, "top_k": 2},
                                "placement": {"every": 2}, "calibration": {"tokens": tokens}})
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        report = convert(cfg, Path(tmp) / "out", progress=False).report.to_dict()
        wall = time.perf_counter() - t
        written = sum(f.stat().st_size for f in (Path(tmp) / "out").iterdir())
    return {"wall_s": wall, "peak_rss_mb": peak_rss_mb(), "timings_s": report["timings_s"],
            "parameters": report["parameters"], "written_mb": written / MB, "calibration": report["calibration"],
            "max_abs_logit_diff": report["max_abs_logit_diff"], "kl_to_dense": report["kl_to_dense"],
            "router_cluster_agreement_min": min((layer.get("router_cluster_agreement", 1.0)
                                                 for layer in report["layers"]), default=None)}


@torch.no_grad()
def child_naive(tokens: int) -> dict:
    from upcycle.checkpoint.loading import load_dense
    from upcycle.config import CalibrationConfig, PlacementConfig
    from upcycle.core.surgery import plan_targets
    from upcycle.data.model_inputs import text_batches
    from upcycle.data.text import wikipedia_split

    t = time.perf_counter()
    model, tokenizer = load_dense("default")
    batches = text_batches(tokenizer, wikipedia_split()[0], CalibrationConfig(tokens=tokens))
    targets = plan_targets(model, PlacementConfig(every=2))
    kept: dict[str, list[torch.Tensor]] = {t.name: [] for t in targets}
    mask = {}
    for target in targets:
        def hook(module, args, _name=target.name):
            kept[_name].append(args[0][mask["m"].bool()].float().clone())
        model.get_submodule(target.path).mlp.register_forward_pre_hook(hook)
    for batch in batches:
        mask["m"] = batch["attention_mask"]
        model(**batch, use_cache=False)
    held = sum(x.numel() * 4 for xs in kept.values() for x in xs)
    return {"wall_s": time.perf_counter() - t, "peak_rss_mb": peak_rss_mb(), "activations_held_mb": held / MB,
            "layers": len(targets)}


def run_child(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=output_file,
                        default=str(Path(__file__).parents[1] / "results" / "cluster_convert.json"))
    args = parser.parse_args()
    if args.child:
        mode, *rest = args.child
        result = child_naive(int(rest[0])) if mode == "naive" else child_convert(mode, int(rest[0]))
        print(json.dumps(result))
        return

    info = machine()
    runs = {}
    for mode in ("copy", "cluster", "naive"):
        print(f"running {mode} ...", flush=True)
        runs[mode] = run_child([mode, str(args.tokens)])
        print(f"  {mode}: {runs[mode]['wall_s']:.1f} s, peak RSS {runs[mode]['peak_rss_mb']:.0f} MB", flush=True)
    width, layers = 576, 15
    params = runs["cluster"]["parameters"]
    sizes = {
        "dense_model_mb": params["before"]["total"] * 4 / MB,
        "upcycled_model_mb": params["after"]["total"] * 4 / MB,
        "one_layer_sample_mb": args.tokens * width * 4 / MB,   # the reservoir [tokens, D] float32
        "calibration_hidden_states_mb": runs["cluster"]["calibration"]["real_tokens"] * width * 4 / MB,
        "all_layers_samples_mb": layers * args.tokens * width * 4 / MB,
    }
    results = {
        "benchmark": "cluster conversion of SmolLM2-135M: every other block, 8 experts, top-2, float32",
        "calibration_tokens_per_layer": args.tokens, "machine": info, "sizes": sizes, "runs": runs,
        "cluster_over_copy": {"wall": runs["cluster"]["wall_s"] / runs["copy"]["wall_s"],
                              "extra_peak_rss_mb": runs["cluster"]["peak_rss_mb"] - runs["copy"]["peak_rss_mb"]},
        "naive_capture_extra_peak_rss_mb_over_cluster": runs["naive"]["peak_rss_mb"] - runs["cluster"]["peak_rss_mb"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps({k: results[k] for k in ("sizes", "cluster_over_copy",
                                              "naive_capture_extra_peak_rss_mb_over_cluster")}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
