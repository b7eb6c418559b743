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
              function-preserving either, and the report says so rather than promising it), and each MoE layer's
              per-expert load on the probe before and after (`loads.py`): a grown copy no token reaches is warned
              of, in the report and on stderr
    write     the upcycle folder, then resize_report.json

A stock MoE folder (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) is pruned as that class and written as it again, loadable
without upcycle; growth takes the upcycle folder it was exported from, whose grown folder exports again (copies
need no router bias). With
`--streaming` an upcycle folder is pruned or grown a block at a time (`streamed.py`), so a model larger than memory
is resized.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from ..checkpoint.loading import TOKENIZER_FOLDER_FILES, load_model
from ..checkpoint.upcycle_format import MOE_CONFIG, save_folder_files
from ..config import CalibrationConfig, CheckConfig
from ..core.stock_moe import is_stock_moe
from ..data.model_inputs import text_batches
from ..data.model_names import model_inputs
from ..data.token_ids import embedding_rows
from ..errors import UpcycleError
from ..files import file_problem, json_text, read_json_file
from ..outputs.claims import Input, inputs
from ..outputs.job import dry_run_job, run_job
from ..probe import Probe, ProbeOutput, compare, make_probe, max_positions, probe_output, text_ids
from ..progress import Phases
from .add_expert import add_expert, check_finetune
from .expert_count import GROW_STOCK, ExpertCount, check_counts, grow_model, prune_model
from .loads import add_loads, counted_loads, silent_copies
from .plan import ResizePlan, check_fits, plan_resize

REPORT = "resize_report.json"


def refuse_delta_experts(model: str, verb: str) -> None:
    """Prune, grow and --add pick, copy or add whole experts, each one's tensors as rows of the layer's; delta
    experts (`moe.experts: delta`) share one base FFN whose rows are not experts, so their folders are refused."""
    path = Path(model) / MOE_CONFIG
    if not path.is_file():
        return
    spec = read_json_file(path, MOE_CONFIG)
    delta = [str(layer.get("block", i)) for i, layer in enumerate(spec.get("layers") or [])
             if isinstance(layer, dict) and layer.get("experts") == "delta"]
    if delta:
        raise UpcycleError(f"{model} holds delta experts (moe.experts: delta; layer {delta[0]}): {verb} works on "
                           f"full experts, whose tensors it picks, copies or adds by expert, and a delta layer's base "
                           f"is every expert's; export it (`upcycle export`, full experts) or convert with "
                           f"moe.experts full")


def check_folder(model: str, request: ExpertCount, *, grow: bool) -> dict:
    """The folder's MoE layers as its upcycle_config.json lists them, once the request fits every one (no weight
    is read)."""
    folder = Path(model)
    config = read_json_file(folder / "config.json", "config.json") if (folder / "config.json").is_file() else None
    if folder.is_dir() and (folder / MOE_CONFIG).is_file():
        spec = read_json_file(folder / MOE_CONFIG, MOE_CONFIG)
        layers = {str(layer.get("block", i)): layer for i, layer in enumerate(spec.get("layers") or [])
                  if isinstance(layer, dict)}
    elif folder.is_dir() and config is not None and is_stock_moe(config):
        if grow:
            raise UpcycleError(f"{model} is a stock MoE folder ({config.get('model_type')}): {GROW_STOCK}")
        count = next((config[k] for k in ("num_local_experts", "num_experts") if isinstance(config.get(k), int)), None)
        layers = {"every MoE block": {"num_experts": count, "top_k": config.get("num_experts_per_tok")}}
    else:
        raise UpcycleError(_not_moe(folder, grow))
    check_counts({name: (layer.get("num_experts"), layer.get("top_k")) for name, layer in layers.items()}, request,
                 grow=grow)
    return layers


CALIBRATION = CalibrationConfig(tokens=4096, sequence_length=256, batch_size=8)


def resize(model: str, out: str | Path, request: ExpertCount, *, grow: bool, budget: CalibrationConfig = CALIBRATION,
           streaming: bool = False, overwrite: bool = False, progress: bool = True) -> dict:
    """Prune (or grow) the folder `model` into OUT as the module docstring says, scoring on `budget` (its `data`:
    a text file; None, the embedded Wikipedia train split); `request.add` (a dense fine-tune of the model's base):
    grow by one expert made from it, routed by its own text (`budget.data`, needed); `streaming` (an upcycle
    folder): a block at a time (`streamed.py`). Returns the report."""
    plan = make_resize_plan(model, request, grow=grow, budget=budget, streaming=streaming)
    # a run that cannot fit the machine is refused before anything is built
    return run_job(plan, out, lambda claim: execute(plan, claim, progress), check=lambda: check_fits(plan),
                   overwrite=overwrite)


def make_resize_plan(model: str, request: ExpertCount, *, grow: bool, budget: CalibrationConfig, streaming: bool
                     ) -> ResizePlan:
    """The plan of a resize after every refusal that needs no weight (`check`): what it writes (`plan.py`), the
    calibration budget and the inputs OUT must never be."""
    given = check(model, request, grow=grow, budget=budget, streaming=streaming)
    return dataclasses.replace(plan_resize(model, request, grow=grow, streaming=streaming), budget=budget,
                               given=given)


def execute(plan: ResizePlan, claim, progress: bool = True) -> dict:
    """Carry out `plan` into the claimed OUT (module docstring: load, change, measure, write); the report."""
    phases = Phases(7 if plan.streaming else 5, progress, f"upcycle {plan.kind}")
    try:
        texts, source = _calibration_texts(plan.budget.data)
        phases(f"calibration text read: {source}")
        run = _streamed if plan.streaming else _in_memory
        report = run(plan.model, plan.request, plan.kind == "grow", plan.budget, (texts, source), claim, phases)
        phases(f"written to {claim.out}")
    finally:
        phases.close()
    return report


def _not_moe(folder: Path, grow: bool) -> str:
    """Why `folder` cannot be resized, and what to pass instead where that can be told."""
    if not folder.exists():
        return f"{folder} does not exist"
    if (folder / "model" / MOE_CONFIG).is_file():     # a training run's folder: its model is one level down
        return f"{folder} is a training run's folder: pass its model, {folder / 'model'}"
    takes = "an upcycle folder or a training run's model/" + ("" if grow else ", or a stock MoE class's folder")
    return (f"{folder} is not an MoE folder (no {MOE_CONFIG}, and no stock MoE config.json): "
            f"{'grow' if grow else 'prune'} takes {takes}")


def dry_run(model: str, request: ExpertCount, *, grow: bool, budget: CalibrationConfig, streaming: bool,
            out: str | Path | None = None, overwrite: bool = False) -> str:
    """What `resize` would write (`plan.py`), described, after every refusal it would make before reading a weight,
    in its order (the runner's dry run, `outputs.job.dry_run_job`: the memory check and OUT's as its claim makes
    them, when OUT is given; then the calibration file, read first by the run); nothing is read but configs,
    headers and the calibration file, nothing is written."""
    plan = make_resize_plan(model, request, grow=grow, budget=budget, streaming=streaming)
    text = dry_run_job(plan, out, check=lambda: check_fits(plan), overwrite=overwrite)
    if budget.data is not None:            # the run reads it first: a file it cannot read is refused here too
        _calibration_texts(budget.data)
    return text


def check(model: str, request: ExpertCount, *, grow: bool, budget: CalibrationConfig, streaming: bool) -> list[Input]:
    """Every refusal that needs no weight (module docstring); the inputs OUT must never be."""
    refuse_delta_experts(model, "grow" if grow else "prune")
    if request.add is not None:
        if not (Path(model) / MOE_CONFIG).is_file():
            if not Path(model).exists() or (Path(model) / "model" / MOE_CONFIG).is_file():
                raise UpcycleError(_not_moe(Path(model), grow=True))
            raise UpcycleError(f"{model} is not an upcycle folder: --add takes one (a conversion's or a merge's "
                               f"folder, or a training run's model/)")
        if request.perturb != "none":
            raise UpcycleError("--perturb changes grown copies; --add adds a fine-tune's expert as it is")
        if budget.data is None:
            raise UpcycleError("--add needs the fine-tune's own text (--calibration FILE): its expert's router row "
                               "is the centroid of the model's FFN inputs on that text")
        check_finetune(model, request.add)
    else:
        check_folder(model, request, grow=grow)
    if streaming and (request.add is not None or not (Path(model) / MOE_CONFIG).is_file()):
        raise UpcycleError("--streaming prunes or grows an upcycle folder a block at a time; adding and stock "
                           "folders run in memory")
    if budget.data is not None and (problem := file_problem(budget.data)):
        raise UpcycleError(f"--calibration {budget.data}: {problem}")
    given = [*(Input(what, path) for what, path in model_inputs(model)), *inputs(("calibration data", budget.data))]
    return given + [Input(f"--add {what}", path) for what, path in model_inputs(request.add)] if request.add \
        else given


def _report(model: str, request: ExpertCount, grow: bool, calibration: dict, probe: Probe,
            outputs: tuple[ProbeOutput, ProbeOutput], layers: dict) -> dict:
    measured = compare(*outputs)
    return {"kind": "grow" if grow else "prune", "source": str(model), "request": asdict(request),
            "calibration": calibration, "probe": {"source": probe.source, "rows": measured["compared_rows"]},
            "kl_to_source": measured["kl_to_dense"], "max_abs_logit_diff": measured["max_abs_logit_diff"],
            "held_out_perplexity": {"before": perplexity(probe, outputs[0]), "after": perplexity(probe, outputs[1])},
            # a prune that removes only exact copies (their share given back to the copies kept) keeps the function
            "function_preserving": not grow and all(set(layer.get("removed", [])) <= set(layer.get("copies_of", {}))
                                                    for layer in layers.values()),
            "warnings": silent_copies(layers), "layers": layers}


def _in_memory(model: str, request: ExpertCount, grow: bool, budget: CalibrationConfig, text: tuple, claim,
               phases: Phases) -> dict:
    texts, source = text
    loaded, tokenizer = load_model(model)
    loaded.eval()
    if tokenizer is None:
        raise UpcycleError(f"{model} has no tokenizer: its calibration text cannot be tokenized")
    phases("model loaded")
    batches = text_batches(tokenizer, texts, _fitted(budget, loaded.config), seed=request.seed,
                           embedding_rows=embedding_rows(loaded.config), where=f"calibration text ({source})")
    probe = held_out_probe(loaded, tokenizer, request.seed)
    # a stock class is not a row of the architecture table: its logits are what it is compared on
    outputs = (("logits", True),) if is_stock_moe(loaded) else None
    with counted_loads(loaded) as loads_before:
        before = probe_output(loaded, probe, outputs)
    if request.add is not None:
        layers = add_expert(loaded, load_model(request.add)[0].eval(), batches)
    else:
        layers = (grow_model if grow else prune_model)(loaded, request, batches)
    phases(f"{len(layers)} MoE layers scored and {'grown' if grow else 'pruned'}")
    with counted_loads(loaded) as loads_after:
        after = probe_output(loaded, probe, outputs)
    add_loads(layers, loads_before, loads_after)
    calibration = {"source": source, "tokens": sum(int(b["attention_mask"].sum()) for b in batches)}
    report = _report(model, request, grow, calibration, probe, (before, after), layers)
    phases(f"compared with the source on the probe ({_distance(report)})")
    with claim.directory() as tmp:
        if is_stock_moe(loaded):             # the stock class again, which transformers loads on its own
            loaded.save_pretrained(tmp)
        else:
            save_folder_files(loaded, tmp)
        # the tokenizer's files as they were given: saving it again would rewrite them in this transformers'
        # words (another tokenizer class, keys older readers refuse)
        for name in TOKENIZER_FOLDER_FILES:
            if (Path(model) / name).is_file():
                shutil.copyfile(Path(model) / name, tmp / name)
        (tmp / REPORT).write_text(json_text(report, indent=1, where=REPORT) + "\n")
    return report


def _streamed(model: str, request: ExpertCount, grow: bool, budget: CalibrationConfig, text: tuple, claim,
              phases: Phases) -> dict:
    from ..checkpoint.loading import load_tokenizer
    from .streamed import grow_streamed, open_folder, prune_streamed

    texts, source = text
    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise UpcycleError(f"{model} has no tokenizer: its calibration text cannot be tokenized")
    skeleton = open_folder(Path(model)).model          # the config and the shapes, no weight
    one = dataclasses.replace(_fitted(budget, skeleton.config), batch_size=2**16)   # every token in one batch
    (batch,) = text_batches(tokenizer, texts, one, seed=request.seed, embedding_rows=embedding_rows(skeleton.config),
                            where=f"calibration text ({source})")
    probe = held_out_probe(skeleton, tokenizer, request.seed)
    phases("tokenizer and config read (no weight)")
    with claim.directory() as tmp:
        resize_streamed = grow_streamed if grow else prune_streamed
        layers, before, after = resize_streamed(Path(model), tmp, request, batch, probe, phases)
        calibration = {"source": source, "tokens": int(batch["attention_mask"].sum()), "streamed": True}
        report = _report(model, request, grow, calibration, probe, (before, after), layers)
        (tmp / REPORT).write_text(json_text(report, indent=1, where=REPORT) + "\n")
    return report


def _fitted(budget: CalibrationConfig, config) -> CalibrationConfig:
    """The calibration rows no longer than the model's position table (a BERT of 64 positions reads rows of 64)."""
    limit = max_positions(config.get_text_config() if hasattr(config, "get_text_config") else config)
    return budget if limit is None or limit >= budget.sequence_length else \
        dataclasses.replace(budget, sequence_length=limit)


def _distance(report: dict) -> str:
    """The new model's distance to the source, as a phase says it: the KL, or for an output that is no
    distribution (an encoder's hidden states) the largest difference."""
    if report["kl_to_source"] is not None:
        return f"KL {report['kl_to_source']:.3g}"
    return f"largest difference {report['max_abs_logit_diff']:.3g}"


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


def held_out_probe(model, tokenizer, seed: int) -> Probe:
    """The held-out probe the new model is compared with the source on: the embedded held-out Wikipedia split as
    the model's tokenizer reads it, else seeded random token ids (`probe.source` says which)."""
    from ..data.text import wikipedia_split

    try:
        texts, source = wikipedia_split()[1], "held-out Wikipedia (embedded)"
    except (FileNotFoundError, OSError):
        texts, source = None, "random token ids"
    if not is_stock_moe(model):
        return make_probe(model, tokenizer, texts, CheckConfig(), seed, text_source=source)
    check = CheckConfig()            # a stock class: the rows make_probe makes, from the same text
    flat = text_ids(tokenizer, texts or [], check.sequences * check.tokens)
    if len(flat) >= check.sequences * check.tokens:
        ids = torch.tensor(flat[: check.sequences * check.tokens]).view(check.sequences, check.tokens)
    else:
        source = "random token ids"
        ids = torch.randint(0, embedding_rows(model.config), (check.sequences, check.tokens),
                            generator=torch.Generator().manual_seed(seed))
    return Probe({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, source)


def perplexity(probe: Probe, output: ProbeOutput) -> float | None:
    """The perplexity of the probe's rows from a causal LM's logits at every position (token t predicts t+1);
    None for a model whose output is no next-token distribution (an encoder)."""
    ids = probe.inputs.get("input_ids")
    if ids is None or output.name != "logits" or not output.is_distribution or \
            output.values_NC.shape[0] != ids.numel():
        return None
    logits = output.values_NC.view(*ids.shape, -1)
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                                            ids[:, 1:].reshape(-1))
    return math.exp(float(nll)) if float(nll) < 709 else math.inf
