"""Conversion memory and time at real sizes, and against mergekit-moe on the same checkpoint.

Checkpoints: random-init Llama-architecture models of about 135M, 0.5B, 1B and 2B parameters, bfloat16 on disk,
saved by transformers as sharded safetensors (1 GB shards) and built once in the upcycle cache. Random weights
are enough here: conversion cost depends on shapes, not values.

Runs, each as a fresh process under GNU time (its peak RSS is its own, `Maximum resident set size`):
  copy      `upcycle convert CKPT OUT --method copy --num-experts 8 --top-k 2 --every 2 --dtype bfloat16`
  cluster   the same with `--method cluster` and 16K calibration tokens (random ids, a .safetensors of inputs)
  mergekit  on the 1B checkpoint: `mergekit-moe` with 8 copies of the model and `gate_mode: random` (every block
            MoE: mergekit has no placement option), next to ours with `--every 1 --export hf
            --export-class mixtral --set streaming=true --set check.end_to_end=false`, which writes the same
            Mixtral checkpoint (mergekit checks nothing; ours still checks every layer). mergekit (0.1.5) lives
            in its own virtual environment, built in the cache on first use (`pip install torch==2.13.0
            mergekit`, minutes), never a dependency of the project.
Every output is deleted after it is measured (the 2B conversion writes about 15 GB).

Targets: data-free methods peak at most 1.5 GB + 2 x the largest MoE layer's output, flat in model size;
cluster at most the dense model + 1.5 GB + one layer's calibration sample; on the 1B Mixtral conversion no slower
and no larger in peak memory than mergekit-moe. Each row says whether it met its target.

Run: .venv/bin/python benchmarks/speed/convert_scale.py [--sizes 135m,0.5b,1b,2b] [--methods copy,cluster]
     [--no-mergekit]   -> benchmarks/results/convert_scale.json and .png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from upcycle.machine import machine
from upcycle.scripts import output_file

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GB = 10**9
# name -> (hidden, intermediate, layers, heads, kv heads, vocab)
SIZES = {"135m": (576, 1536, 30, 9, 3, 49152), "0.5b": (1024, 4096, 24, 16, 4, 49152),
         "1b": (2048, 5632, 22, 32, 4, 32000), "2b": (2048, 8192, 30, 32, 4, 32000)}
EXPERTS, TOP_K, CALIBRATION_TOKENS = 8, 2, 16384



def cache() -> Path:
    from upcycle.data.text import cache_dir

    return cache_dir()


def checkpoint(size: str) -> Path:
    """The random bf16 Llama of `size`, sharded, with calibration inputs next to it (built once)."""
    import transformers

    folder = cache() / "bench-checkpoints" / f"llama-{size}"
    if (folder / "done").exists():
        if not (folder / "tokenizer.json").exists():
            add_tokenizer(folder, SIZES[size][5])
        return folder
    D, F, L, H, KV, V = SIZES[size]
    config = transformers.LlamaConfig(hidden_size=D, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
                                      num_key_value_heads=KV, vocab_size=V, max_position_embeddings=2048,
                                      tie_word_embeddings=size == "135m", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, max_shard_size="1GB")
    from safetensors.torch import save_file

    ids = torch.randint(3, V, (CALIBRATION_TOKENS // 512, 512), generator=torch.Generator().manual_seed(1))
    save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, str(folder / "calibration.safetensors"))
    add_tokenizer(folder, V)
    (folder / "done").write_text("")
    return folder


def add_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer over the model's whole vocabulary (mergekit-moe refuses a folder without one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2").save_pretrained(
        folder)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.safetensors"))


def timed(cmd: list[str], env: dict | None = None) -> dict:
    """Run `cmd` under GNU time: wall seconds, peak RSS (bytes), exit code and the output's tail."""
    t = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    cpu = sum(float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", proc.stderr))
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_average": round(os.getloadavg()[0], 2),
            "peak_rss_bytes": int(rss.group(1)) * 1024 if rss else None,
            "exit_code": proc.returncode, "tail": (proc.stdout + proc.stderr)[-1500:] if proc.returncode else ""}


def layer_bytes(size: str) -> int:
    D, F, *_ = SIZES[size]
    return EXPERTS * 3 * F * D * 2 + EXPERTS * D * 4        # bf16 experts + float32 router


def run_upcycle(ckpt: Path, out: Path, method: str, *extra: str) -> dict:
    # the per-layer check runs; the end-to-end one (two more lazy passes over the dense model and one over the
    # output, in bfloat16, which this CPU computes slowly) is timed once at 135M instead (`end_to_end_135m`)
    cmd = [str(ROOT / ".venv" / "bin" / "upcycle"), "convert", str(ckpt), str(out), "--method", method,
           "--num-experts", str(EXPERTS), "--top-k", str(TOP_K), "--dtype", "bfloat16", "--quiet", "--overwrite",
           "--set", "check.end_to_end=false", *extra]
    if method == "cluster":
        cmd += ["--calibration", str(ckpt / "calibration.safetensors"), "--calibration-tokens",
                str(CALIBRATION_TOKENS)]
    row = timed(cmd)
    row["output_bytes"] = folder_bytes(out) if out.exists() else None
    report = out / "upcycle_report.json"
    if report.exists():
        data = json.loads(report.read_text())
        row["streamed"] = data.get("streamed")
        row["timings_s"] = data.get("timings_s")
    shutil.rmtree(out, ignore_errors=True)
    return row


def mergekit_venv() -> Path:
    venv = cache() / "mergekit-venv"
    if not (venv / "bin" / "mergekit-moe").exists():
        print("building the mergekit environment (once, several minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "torch==2.13.0", "mergekit"], check=True)
    return venv


def run_mergekit(ckpt: Path, out: Path) -> dict:
    venv = mergekit_venv()
    config = out.parent / "mergekit-moe.yaml"
    experts = "".join(f"  - source_model: {ckpt}\n    positive_prompts: [\"expert {i}\"]\n" for i in range(EXPERTS))
    config.write_text(f"base_model: {ckpt}\ngate_mode: random\ndtype: bfloat16\nexperts_per_token: {TOP_K}\n"
                      f"experts:\n{experts}")
    row = timed([str(venv / "bin" / "mergekit-moe"), str(config), str(out),
                 "--i-understand-this-is-not-useful-without-training"])
    row["output_bytes"] = folder_bytes(out) if out.exists() else None
    row["version"] = subprocess.run([str(venv / "bin" / "python"), "-c",
                                     "import importlib.metadata as m; print(m.version('mergekit'))"],
                                    capture_output=True, text=True).stdout.strip()
    shutil.rmtree(out, ignore_errors=True)
    config.unlink(missing_ok=True)
    return row


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for method, marker, color in (("copy", "o", "C0"), ("cluster", "s", "C1")):
        # the newest run of each size (a size measured again after a change keeps only its latest row)
        latest = {r["size"]: r for r in results["runs"] if r["method"] == method and r.get("peak_rss_bytes")}
        rows = sorted(latest.values(), key=lambda r: r["dense_bytes"])
        if not rows:
            continue
        x = [r["dense_bytes"] / GB for r in rows]
        ax.plot(x, [r["peak_rss_bytes"] / GB for r in rows], marker=marker, color=color, label=f"upcycle {method}")
        ax.plot(x, [r["target_peak_bytes"] / GB for r in rows], "--", color=color, lw=1, label=f"{method} target")
        bx.plot(x, [r["wall_s"] for r in rows], marker=marker, color=color, label=f"upcycle {method}")
        for r in rows:              # wall times taken beside other jobs are inflated by them: say how much load
            if r.get("load_average", 0) > 2.5:
                bx.annotate(f"load {r['load_average']:.0f}", (r["dense_bytes"] / GB, r["wall_s"]), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
        if method == "copy":
            ax.plot(x, [r["output_bytes"] / GB for r in rows], ":", color="gray", label="output size (copy)")
    for r in (r for r in results.get("mergekit", []) if r["exit_code"] == 0):
        style = "^" if r["tool"] == "mergekit-moe" else "v"
        ax.plot([r["dense_bytes"] / GB], [r["peak_rss_bytes"] / GB], style, ms=9,
                label=f"{r['tool']} (every block, Mixtral)")
        bx.plot([r["dense_bytes"] / GB], [r["wall_s"]], style, ms=9, label=r["tool"])
    ax.set(xlabel="dense checkpoint (GB, bf16)", ylabel="peak RSS (GB)", title="memory")
    bx.set(xlabel="dense checkpoint (GB, bf16)", ylabel="wall time (s)", title="time")
    ax.legend(fontsize=7)
    bx.legend(fontsize=7)
    fig.suptitle(f"upcycle convert at scale, {EXPERTS} experts top-{TOP_K}, bf16 ({results['machine']['cpu']}, "
                 f"{results['machine']['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(results: dict, path: str) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out


def median_run(rows: list[dict]) -> dict:
    """The run with the median wall time, its wall/CPU/RSS replaced by the medians over the runs."""
    import statistics

    ok = [r for r in rows if r["exit_code"] == 0] or rows
    middle = sorted(ok, key=lambda r: r["wall_s"])[len(ok) // 2]
    return {**middle, "runs": len(rows), **{k: statistics.median(r[k] for r in ok)
                                            for k in ("wall_s", "cpu_s", "peak_rss_bytes") if middle.get(k)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="135m,0.5b,1b,2b")
    parser.add_argument("--methods", default="copy,cluster")
    # the calibration replay is a forward of 16K tokens through the model in float32: minutes at 0.5B on this
    # 2-core CPU, over an hour at 2B, so cluster runs at the sizes named here
    parser.add_argument("--cluster-sizes", default="135m,0.5b")
    parser.add_argument("--no-mergekit", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each tool in the mergekit comparison")
    parser.add_argument("--out", type=output_file, default=str(RESULTS / "convert_scale.json"))
    a = parser.parse_args()
    work = cache() / "bench-outputs"
    work.mkdir(parents=True, exist_ok=True)
    results = {"machine": machine(), "setting": {"experts": EXPERTS, "top_k": TOP_K, "every": 2, "dtype": "bfloat16",
                                                 "calibration_tokens": CALIBRATION_TOKENS}, "runs": [], "mergekit": []}
    for size in a.sizes.split(","):
        ckpt = checkpoint(size)
        dense = folder_bytes(ckpt)
        for method in [m for m in a.methods.split(",") if m]:
            if method == "cluster" and size not in a.cluster_sizes.split(","):
                continue
            print(f"{size} {method} ...", flush=True)
            row = {"size": size, "method": method, "dense_bytes": dense,
                   "largest_layer_output_bytes": layer_bytes(size),
                   **run_upcycle(ckpt, work / f"{size}-{method}", method, "--every", "2")}
            sample = CALIBRATION_TOKENS * SIZES[size][0] * 4
            row["target_peak_bytes"] = (int(1.5 * GB) + 2 * row["largest_layer_output_bytes"] if method != "cluster"
                                        else dense + int(1.5 * GB) + sample)
            row["met_target"] = bool(row["peak_rss_bytes"] and row["peak_rss_bytes"] <= row["target_peak_bytes"])
            results["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tail"}), flush=True)
            save(results, a.out)            # each finished run is kept if a later one is interrupted
    if "135m" in a.sizes.split(","):      # what the default end-to-end check adds, at the smallest size
        row = run_upcycle(checkpoint("135m"), work / "135m-e2e", "copy", "--every", "2", "--set",
                          "check.end_to_end=true")
        results["end_to_end_135m"] = {k: v for k, v in row.items() if k != "tail"}
    if not a.no_mergekit:
        ckpt = checkpoint("1b")
        dense = folder_bytes(ckpt)
        # streamed straight into Mixtral's layout (mergekit checks nothing; ours still checks every layer)
        # the two tools alternate, a.repeats times each, so both see the same background load; medians reported
        pairs = []
        for _ in range(a.repeats):
            mixtral = ("--every", "1", "--export", "hf", "--export-class", "mixtral", "--set", "streaming=true")
            ours = run_upcycle(ckpt, work / "1b-mixtral", "copy", *mixtral)
            # the same conversion without the per-layer check: mergekit's work (read, copy, write) and nothing else
            bare = run_upcycle(ckpt, work / "1b-mixtral-bare", "copy", *mixtral, "--set", "check.per_layer=false")
            theirs = run_mergekit(ckpt, work / "1b-mergekit")
            pairs.append((ours, bare, theirs))
            print(json.dumps([{k: v for k, v in r.items() if k != "tail"} for r in (ours, bare, theirs)]), flush=True)
        tools = ("upcycle", "upcycle, check.per_layer=false", "mergekit-moe")
        results["mergekit"] = [{"tool": tool, "dense_bytes": dense, **median_run([p[i] for p in pairs])}
                               for i, tool in enumerate(tools)]
        results["mergekit_runs"] = [[{k: v for k, v in r.items() if k != "tail"} for r in p] for p in pairs]
        theirs = results["mergekit"][-1]
        for ours in results["mergekit"][:-1]:
            if ours["exit_code"] == 0 and theirs["exit_code"] == 0:
                results.setdefault("versus_mergekit", {})[ours["tool"]] = {
                    "time_ratio": round(ours["wall_s"] / theirs["wall_s"], 2),
                    "cpu_time_ratio": round(ours["cpu_s"] / theirs["cpu_s"], 2),
                    "peak_rss_ratio": round(ours["peak_rss_bytes"] / theirs["peak_rss_bytes"], 2)}
        print(json.dumps(results["mergekit"], indent=1), flush=True)
    out = save(results, a.out)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
