"""`upcycle prune` and `upcycle grow`: an upcycle folder (a conversion's, or a training run's `model/`) with the
expert count of every MoE layer changed, written as a new upcycle folder, and what it did in `resize_report.json`.

    check     the folder is an upcycle folder; the count is possible for every layer (from its upcycle_config.json,
              before a weight loads); the calibration file is readable
    claim     OUT (never an input; replaced only when upcycle wrote it)
    load      the model and its tokenizer; the calibration text tokenized into the budget (`--calibration`, default
              the embedded Wikipedia train split), and a held-out probe (the embedded held-out split, else seeded
              random token ids: the report says which)
    change    `expert_count.prune_model` / `grow_model`, layer by layer
    measure   the KL of the new model to the source on the probe (growth under a fixed top-k is not
              function-preserving either, and the report says so rather than promising it)
    write     the upcycle folder, then resize_report.json

Stock MoE folders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) and a streamed, larger-than-memory pass are not taken yet:
they are refused with that said.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from ..checkpoint.loading import load_model
from ..checkpoint.upcycle_format import MOE_CONFIG, save_folder_files
from ..config import CalibrationConfig, CheckConfig
from ..conversion.calibration import text_batches
from ..data.model_names import model_inputs
from ..data.token_ids import embedding_rows
from ..errors import UpcycleError
from ..files import file_problem, json_text, read_json_file
from ..outputs.claims import Input, claim_output, inputs
from ..probe import compare, make_probe, probe_output
from .expert_count import GROW_BY, PRUNE_BY, ExpertCount, grow_model, prune_model

REPORT = "resize_report.json"


def check_folder(model: str, request: ExpertCount, *, grow: bool) -> dict:
    """The folder's MoE layers as its upcycle_config.json lists them, once the request fits every one (no weight
    is read)."""
    folder = Path(model)
    if not (folder.is_dir() and (folder / MOE_CONFIG).is_file()):
        stock = folder.is_dir() and (folder / "config.json").is_file()
        raise UpcycleError(f"{model} is not an upcycle folder (no {MOE_CONFIG}): {'grow' if grow else 'prune'} takes "
                           f"a conversion's folder or a training run's model/" +
                           ("; a stock MoE class's folder or a dense model is not taken yet" if stock else ""))
    spec = read_json_file(folder / MOE_CONFIG, MOE_CONFIG)
    layers = {str(layer.get("block", i)): layer for i, layer in enumerate(spec.get("layers") or [])
              if isinstance(layer, dict)}
    choices = GROW_BY if grow else PRUNE_BY
    if request.by not in choices:
        raise UpcycleError(f"--by must be one of {', '.join(choices)}, got {request.by!r}")
    if request.num_experts < 1:
        raise UpcycleError(f"--num-experts must be >= 1, got {request.num_experts}")
    for name, layer in layers.items():
        E, k, N = layer.get("num_experts"), layer.get("top_k"), request.num_experts
        if not isinstance(E, int) or not isinstance(k, int):
            continue            # the loaded model's own check (expert_count.check_request) says it then
        if grow and N < E:
            raise UpcycleError(f"{name} has {E} experts: growing to {N} would remove some (use prune)")
        if not grow and N > E:
            raise UpcycleError(f"{name} has {E} experts: pruning to {N} would add some (use grow)")
        if not grow and N < k:
            raise UpcycleError(f"{name} routes each token to top-{k}: it keeps at least {k} experts, not {N}")
    return layers


def resize(model: str, out: str | Path, request: ExpertCount, *, grow: bool, calibration: str | None = None,
           tokens: int = 4096, overwrite: bool = False, progress: bool = True) -> dict:
    """Prune (or grow) the upcycle folder `model` into OUT as the module docstring says; returns the report."""
    check_folder(model, request, grow=grow)
    if calibration is not None and (problem := file_problem(calibration)):
        raise UpcycleError(f"--calibration {calibration}: {problem}")
    budget = CalibrationConfig(data=calibration, tokens=tokens, sequence_length=256, batch_size=8)
    kind = "grow" if grow else "prune"
    given = [*(Input(what, path) for what, path in model_inputs(model)), *inputs(("calibration data", calibration))]
    with claim_output(out, kind=kind, given=given, overwrite=overwrite) as claim:
        loaded, tokenizer = load_model(model)
        loaded.eval()
        texts, source = _calibration_texts(calibration)
        if tokenizer is None:
            raise UpcycleError(f"{model} has no tokenizer: its calibration text cannot be tokenized")
        batches = text_batches(tokenizer, texts, budget, seed=request.seed,
                               embedding_rows=embedding_rows(loaded.config), where=f"calibration text ({source})")
        probe_texts, probe_source = _held_out()
        probe = make_probe(loaded, tokenizer, probe_texts, CheckConfig(), request.seed,
                           text_source=probe_source or "random token ids")
        before = probe_output(loaded, probe)
        layers = (grow_model if grow else prune_model)(loaded, request, batches)
        measured = compare(before, probe_output(loaded, probe))
        report = {"kind": kind, "source": str(model), "request": asdict(request), "calibration": {
                      "source": source, "tokens": sum(int(b["attention_mask"].sum()) for b in batches)},
                  "probe": {"source": probe.source, "rows": measured["compared_rows"]},
                  "kl_to_source": measured["kl_to_dense"], "max_abs_logit_diff": measured["max_abs_logit_diff"],
                  "function_preserving": False if grow or any(layer["removed"] for layer in layers.values())
                  else True, "layers": layers}
        with claim.directory() as tmp:
            save_folder_files(loaded, tmp, tokenizer=tokenizer)
            (tmp / REPORT).write_text(json_text(report, indent=1, where=REPORT) + "\n")
    if progress:
        print(json.dumps({k: report[k] for k in ("kind", "kl_to_source", "max_abs_logit_diff")}))
    return report


def _calibration_texts(calibration: str | None) -> tuple[list[str], str]:
    from ..data.text import read_texts, wikipedia_split

    if calibration is not None:
        try:
            return read_texts(calibration), f"text file {calibration}"
        except (FileNotFoundError, ValueError) as e:
            raise UpcycleError(f"--calibration: {e}") from None
    try:
        return wikipedia_split()[0], "Wikipedia train split (embedded)"
    except (FileNotFoundError, OSError) as e:
        raise UpcycleError(f"no calibration text: the embedded corpus is missing ({e}); pass --calibration FILE") \
            from None


def _held_out() -> tuple[list[str] | None, str | None]:
    from ..data.text import wikipedia_split

    try:
        return wikipedia_split()[1], "held-out Wikipedia (embedded)"
    except (FileNotFoundError, OSError):
        return None, None
