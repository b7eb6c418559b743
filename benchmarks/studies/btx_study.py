"""Several fine-tunes of SmolLM2-135M merged into one MoE, three router initializations, next to mergekit-moe
(Branch-Train-MiX style upcycling).

Sources, all offline: English Wikipedia prose (the embedded sample), Python source (this interpreter's standard
library, files split into chunks) and arithmetic (generated "Question: What is a op b? Answer: c." lines). Each
has a train and a held-out file. Stages (each reused when its output exists; `--fresh` starts over):
  1. fine-tunes: `upcycle train default ft-SOURCE --data SOURCE_train.txt` (short: the CPU is small and shared)
  2. merges, every block MoE, one expert per source, top-2, float32, each timed under GNU time (wall, peak RSS):
       ours, router random | prompts | data:  upcycle convert default OUT --config RECIPE --every 1 --top-k 2
       ours, router data, as stock Mixtral:    the same with --export hf --export-class mixtral (and once more
                                               with --set check.end_to_end=false: no check of the stock model)
       ours, router data, two sources:         wikipedia and python only (memory against the sources' number)
       mergekit-moe 0.1.5, gate_mode hidden:   the same sources and prompts, Mixtral, on the CPU
  3. a short joint fine-tune on the three train files mixed: `upcycle train MERGED joint-X --data mixed.txt`
  4. every model on every source's held-out rows: perplexity and, for MoE models, router-source agreement
     (the share of a source's tokens whose top-1 expert, in each MoE layer, is that source's expert; averaged
     over layers), measured on the merged model's own routing (not the base's FFN inputs the report uses).
Writes benchmarks/results/btx_study.json and .png.

    .venv/bin/python benchmarks/studies/btx_study.py [--out out/btx] [--ft-steps 30] [--joint-steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

from upcycle.machine import machine
from upcycle.scripts import note, output_folder

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"

PY = sys.executable
SOURCES = ("wikipedia", "python", "arithmetic")
PROMPTS = {   # mergekit-moe's positive_prompts, the same for both tools
    "wikipedia": ["The history of the town dates back to the", "She was born in 1952 and studied law at the",
                  "The species is found in the forests of"],
    "python": ["def __init__(self, *args, **kwargs):\n        self._lock = threading.Lock()",
               "import os\nimport sys\nfrom collections import namedtuple",
               "    if not isinstance(value, str):\n        raise TypeError("],
    "arithmetic": ["Question: What is 37 + 48? Answer: 85.", "Question: What is 12 * 9? Answer: 108.",
                   "Question: What is 96 - 58? Answer: 38."]}
SEQ, ROWS = 64, 8                    # held-out rows of SEQ tokens per source (ROWS x SEQ tokens)



def timed(cmd: list[str]) -> dict:
    """Run `cmd` under GNU time: wall seconds, peak RSS (bytes), exit code and the output's tail on failure."""
    t = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-v", *map(str, cmd)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    wall = time.perf_counter() - t
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    # CPU seconds too: the machine is shared, and other work may even pause ours (wall time then overstates)
    cpu = sum(float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", proc.stderr))
    row = {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
           "peak_rss_bytes": int(rss.group(1)) * 1024 if rss else None, "exit_code": proc.returncode,
           "load_average": round(os.getloadavg()[0], 2)}
    if proc.returncode:
        row["tail"] = (proc.stdout + proc.stderr)[-2000:]
        print(row["tail"], file=sys.stderr)
    return row


# ---------------------------------------------------------------- data

def _arithmetic(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        lines = []
        for _ in range(12):
            a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-*")
            value = {"+": a + b, "-": a - b, "*": a * b}[op]
            lines.append(f"Question: What is {a} {op} {b}? Answer: {value}.")
        docs.append("\n".join(lines))
    return docs


def _python(held: bool) -> list[str]:
    """Chunks of 40 lines of the standard library's top-level .py files; every 10th file is held out."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    docs = []
    for i, file in enumerate(files):
        if (i % 10 == 9) != held:
            continue
        lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
        docs += ["\n".join(lines[j:j + 40]) for j in range(0, len(lines), 40) if lines[j:j + 40]]
    return [d for d in docs if d.strip()]


def write_data(folder: Path) -> dict[str, tuple[Path, Path]]:
    from upcycle.data.text import wikipedia_split

    folder.mkdir(parents=True, exist_ok=True)
    wiki_train, wiki_held = wikipedia_split()
    docs = {"wikipedia": (wiki_train[:600], wiki_held[:60]), "python": (_python(False), _python(True)),
            "arithmetic": (_arithmetic(600, 0), _arithmetic(60, 1))}
    files = {}
    for name, (train, held) in docs.items():
        files[name] = (folder / f"{name}_train.txt", folder / f"{name}_held.txt")
        for path, texts in zip(files[name], (train, held), strict=True):
            path.write_text("\n\n".join(t.replace("\n\n", "\n") for t in texts))
    mixed = [t for name in SOURCES for t in docs[name][0]]
    random.Random(0).shuffle(mixed)
    (folder / "mixed_train.txt").write_text("\n\n".join(t.replace("\n\n", "\n") for t in mixed))
    note(folder)
    return files


# ---------------------------------------------------------------- runs

def fine_tune(model: str, out: Path, data: Path, steps: int, lr: float) -> dict:
    if (out / "model" / "config.json").exists():
        if (out / "timing.json").exists():
            return json.loads((out / "timing.json").read_text())
        # a run finished outside this process (the study restarted while it trained): its own step times
        log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines() if line.strip()]
        return {"wall_s": None, "train_step_s": round(sum(r.get("seconds", 0.0) for r in log), 1), "exit_code": 0}
    row = timed([PY, "-m", "upcycle.cli", "train", model, out, "--data", data, "--steps", steps, "--batch-size", 4,
                 "--sequence-length", SEQ, "--lr", lr, "--warmup", 0.1, "--set", "eval_tokens=256", "--overwrite",
                 "--quiet"])
    if row["exit_code"] == 0:
        (out / "timing.json").write_text(json.dumps(row))
        note(out if not (out / ".upcycle-output.json").is_file() else out / "timing.json")
    return row


def recipe(path: Path, fts: dict[str, Path], files, router: str, sources=SOURCES) -> Path:
    experts = [{"model": str(fts[s] / "model"), "data": str(files[s][0]), "eval_data": str(files[s][1]),
                "prompts": PROMPTS[s]} for s in sources]
    path.write_text(json.dumps({"sources": {"router": router, "experts": experts},
                                "calibration": {"tokens": 1024, "sequence_length": SEQ}}))   # JSON is YAML
    note(path)
    return path


def merge_ours(out: Path, config: Path, *extra) -> dict:
    if (out / "upcycle_report.json").exists():
        return json.loads((out / "timing.json").read_text())
    row = timed([PY, "-m", "upcycle.cli", "convert", "default", out, "--config", config, "--every", 1, "--top-k", 2,
                 "--quiet", "--overwrite", *extra])
    if row["exit_code"] == 0:
        (out / "timing.json").write_text(json.dumps(row))
        note(out if not (out / ".upcycle-output.json").is_file() else out / "timing.json")
    return row


def merge_mergekit(out: Path, fts: dict[str, Path]) -> dict:
    from upcycle.data.assets import default_model_path

    if (out / "config.json").exists() and (out / "timing.json").exists():
        return json.loads((out / "timing.json").read_text())
    venv = Path.home() / ".cache" / "upcycle" / "mergekit-venv"
    config = out.parent / "mergekit-moe.yaml"
    experts = "".join(f"  - source_model: {fts[s] / 'model'}\n    positive_prompts: {json.dumps(PROMPTS[s])}\n"
                      for s in SOURCES)
    config.write_text(f"base_model: {default_model_path()}\ngate_mode: hidden\ndtype: float32\n"
                      f"experts_per_token: 2\nexperts:\n{experts}")
    note(config)
    row = timed([venv / "bin" / "mergekit-moe", config, out, "--device", "cpu"])
    row["version"] = subprocess.run([str(venv / "bin" / "python"), "-c",
                                     "import importlib.metadata as m; print(m.version('mergekit'))"],
                                    capture_output=True, text=True).stdout.strip()
    if row["exit_code"] == 0:
        (out / "timing.json").write_text(json.dumps(row))
        note(out if not (out / ".upcycle-output.json").is_file() else out / "timing.json")
    return row


# ---------------------------------------------------------------- measurement

def held_rows(tokenizer, path: Path) -> torch.Tensor:
    """The first ROWS rows of SEQ tokens of the held-out documents, joined by EOS (no padding)."""
    from upcycle.data.text import read_texts

    ids = []
    for text in read_texts(path):
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(ids) >= ROWS * SEQ:
            break
    return torch.tensor(ids[: ROWS * SEQ]).view(ROWS, SEQ)


@torch.no_grad()
def measure(path: Path, rows: dict[str, torch.Tensor], expert_source: list[int] | None) -> dict:
    """Per source: held-out perplexity and (MoE models) mean over layers of router-source agreement."""
    from upcycle.checkpoint.loading import load_model
    from upcycle.core.moe import moe_layers

    model = load_model(str(path))[0].eval()
    layers = list(moe_layers(model).values())
    stock = not layers and hasattr(model.config, "num_local_experts")
    out = {}
    for s, (name, ids_NS) in enumerate(rows.items()):
        nll, agree = [], []
        for i in range(0, len(ids_NS), 4):
            batch = ids_NS[i:i + 4]
            result = model(input_ids=batch, labels=batch, **({"output_router_logits": True} if stock else {}))
            nll.append(float(result.loss) * batch[:, 1:].numel())
            if layers:
                tops = [layer.last_record.topk_ids_TK[:, 0] for layer in layers]
            elif stock:
                tops = [logits.argmax(-1) for logits in result.router_logits]
            else:
                tops = []
            if tops:
                groups = torch.tensor(expert_source)
                agree.append(torch.stack([(groups[t] == s).double().mean() for t in tops]))
        row = {"perplexity": float(torch.tensor(sum(nll) / (ids_NS[:, 1:].numel())).exp())}
        if agree:
            per_layer = torch.stack(agree).mean(0)
            row |= {"agreement": float(per_layer.mean()), "agreement_min_layer": float(per_layer.min())}
        out[name] = row
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in results["models"] if m != "base"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.2))
    width = 0.8 / len(SOURCES)
    for k, source in enumerate(SOURCES):
        xs = [i + k * width for i in range(len(models))]
        ax.bar(xs, [results["models"][m]["held_out"][source]["perplexity"] for m in models], width, label=source)
        agreements = [results["models"][m]["held_out"][source].get("agreement", float("nan")) for m in models]
        bx.bar(xs, agreements, width, label=source)
    for axis in (ax, bx):
        axis.set_xticks([i + width for i in range(len(models))], models, rotation=35, ha="right", fontsize=7)
        axis.legend(fontsize=7)
    ax.set(ylabel="held-out perplexity", yscale="log", title="perplexity per source")
    bx.set(ylabel="router-source agreement (mean over layers)", ylim=(0, 1),
           title="top-1 expert = the source's expert")
    bx.axhline(1 / len(SOURCES), color="gray", lw=0.8, ls=":")
    fig.suptitle(f"SmolLM2-135M fine-tunes merged into a 3-expert top-2 MoE ({results['machine']['cpu']}, "
                 f"{results['machine']['cores']} cores)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict) -> str:
    """The table of docs/merging.md: per model, perplexity and agreement per source (markdown)."""
    head = "| model | " + " | ".join(f"{s} ppl | {s} agree" for s in SOURCES) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(SOURCES)]
    for name, row in results["models"].items():
        cells = []
        for s in SOURCES:
            r = row["held_out"][s]
            cells += [f"{r['perplexity']:.2f}", f"{r['agreement']:.2f}" if "agreement" in r else ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| merge | wall s | CPU s | peak RSS GB | load average |", "|---|---:|---:|---:|---:|"]
    for name, row in results["stages"].get("merges", {}).items():
        lines.append(f"| {name} | {row['wall_s']} | {row['cpu_s']} | {row['peak_rss_bytes'] / 1e9:.2f} | "
                     f"{row['load_average']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=output_folder, default=str(ROOT / "out" / "btx"))
    parser.add_argument("--ft-steps", type=int, default=30)
    parser.add_argument("--joint-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--fresh", action="store_true")
    parser.add_argument("--table", action="store_true", help="print docs/merging.md's table of the saved results")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads((RESULTS / "btx_study.json").read_text())))
        return
    from upcycle.scripts import claim_work, clear

    out = claim_work(Path(args.out))
    if args.fresh:
        clear(out, out)
        out = claim_work(out)
    result_file = RESULTS / "btx_study.json"
    results = {"machine": machine(), "settings": {"ft_steps": args.ft_steps, "joint_steps": args.joint_steps,
                                                  "lr": args.lr, "batch_size": 4, "sequence_length": SEQ,
                                                  "held_out_tokens_per_source": ROWS * SEQ, "experts": 3, "top_k": 2},
               "stages": {}, "models": {}}

    def save() -> None:
        result_file.write_text(json.dumps(results, indent=2))

    t = time.perf_counter()
    files = write_data(out / "data")
    fts = {s: out / f"ft-{s}" for s in SOURCES}
    results["stages"]["fine_tunes"] = {s: fine_tune("default", fts[s], files[s][0], args.ft_steps, args.lr)
                                       for s in SOURCES}
    results["stages"]["fine_tune_s"] = round(time.perf_counter() - t, 1)
    save()
    t = time.perf_counter()
    merges = {}
    for router in ("random", "prompts", "data"):
        merges[f"ours-{router}"] = merge_ours(out / f"merge-{router}", recipe(out / f"{router}.yaml", fts, files,
                                                                             router))
        save()
    merges["ours-data-mixtral"] = merge_ours(out / "merge-data-mixtral", out / "data.yaml", "--export", "hf",
                                             "--export-class", "mixtral")
    # the export's check loads the stock model whole (transformers fuses its experts as it loads): without it
    merges["ours-data-mixtral-unchecked"] = merge_ours(out / "merge-data-mixtral-unchecked", out / "data.yaml",
                                                       "--export", "hf", "--export-class", "mixtral",
                                                       "--set", "check.end_to_end=false")
    # memory against the number of sources: two sources instead of three, the same settings
    merges["ours-data-2-sources"] = merge_ours(out / "merge-data-2", recipe(out / "data-2.yaml", fts, files, "data",
                                                                             SOURCES[:2]))
    merges["mergekit-hidden"] = merge_mergekit(out / "merge-mergekit", fts)
    results["stages"]["merges"] = merges
    results["stages"]["merge_s"] = round(time.perf_counter() - t, 1)
    save()
    t = time.perf_counter()
    joints = {}
    for name, folder in (("ours-data", "merge-data"), ("ours-random", "merge-random"),
                         ("mergekit-hidden", "merge-mergekit")):
        joints[name] = fine_tune(str(out / folder), out / f"joint-{name}", out / "data" / "mixed_train.txt",
                                 args.joint_steps, args.lr / 2)
        save()
    results["stages"]["joint_fine_tunes"] = joints
    results["stages"]["joint_s"] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    from upcycle.checkpoint.loading import load_tokenizer
    from upcycle.data.assets import default_model_path

    tokenizer = load_tokenizer(default_model_path())
    rows = {s: held_rows(tokenizer, files[s][1]) for s in SOURCES}
    models = {"base": (default_model_path(), None), **{f"ft-{s}": (fts[s] / "model", None) for s in SOURCES}}
    for name in ("random", "prompts", "data"):
        models[f"ours-{name}"] = (out / f"merge-{name}", [0, 1, 2])
    models["mergekit-hidden"] = (out / "merge-mergekit", [0, 1, 2])
    for name in joints:
        models[f"{name} + joint"] = (out / f"joint-{name}" / "model", [0, 1, 2])
    for name, (path, groups) in models.items():
        if Path(path).exists():
            results["models"][name] = {"held_out": measure(Path(path), rows, groups)}
            print(name, json.dumps(results["models"][name]), flush=True)
            save()
    for name in ("random", "prompts", "data"):
        report = json.loads((out / f"merge-{name}" / "upcycle_report.json").read_text())
        results["models"][f"ours-{name}"]["report_agreement_on_base_inputs"] = report["router_source_agreement"]
    results["stages"]["measure_s"] = round(time.perf_counter() - t, 1)
    save()
    plot(results, RESULTS / "btx_study.png")
    print(f"wrote {result_file}")


if __name__ == "__main__":
    main()
