"""Several fine-tuned models of one base merged into one MoE, streamed (issue 16; Branch-Train-MiX, Sukhbaatar et
al. 2024, arXiv:2403.07816; mergekit-moe's recipe form).

Each routed expert is a source model's FFN (or `count` experts made from it by the conversion's `method`, copy by
default: the source's FFN as it is); everything else (attention, embeddings, norms, the dense blocks) is the
base's, or with `non_ffn: average` the mean of the sources' (BTX). Optionally the base's FFN is a shared expert.

The data flow is the streaming conversion's (`streaming.py`), with one dense block of the base in memory:
  1. every source is checked against the base from its config.json and safetensors headers (`sources.py`),
     and every text read and tokenized, before a weight is read;
  2. per source, four groups of token batches: its calibration text, its held-out text, its prompts and its
     negative prompts. The base runs to its first block once per group (`calibration._first_block_inputs`);
  3. block by block (`calibration._replay`), the base's block runs on each group's hidden states; at an MoE
     target a hook on the FFN keeps each group's FFN inputs (reservoir-sampled to `calibration.tokens`);
  4. at a target, each source's FFN tensors of that block are read (only those), turned into its experts, and
     the router is initialized from the groups (`methods.source_router`: random, prompts or data); the layer
     is installed in the block, the block written into the planned shards and released.
Memory: the base's block, the sources' FFNs of one block, the layer's stacked experts, and the groups' hidden states
at one depth (which grow with the amount of text, not with the weights).

Reported per layer: router-source agreement (the fraction of a source's held-out tokens whose top-1 expert is
one of that source's), on the base model's FFN inputs at that depth; the largest cosine between two sources'
router rows (near 1: the router cannot tell them apart, mergekit-moe's "degenerate gates"); and each expert
against its source's FFN on held-out inputs (0 for copies: the expert is the source's tensors).

`export: hf` writes the upcycle folder first, then rewrites it as the stock class a block at a time and checks
the stock model's logits against ours (`stock_stream.py`).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from tqdm.auto import tqdm

from ..config import EXPORTS, NON_FFN, ROUTER_INITS, ConvertConfig, to_dict
from ..core.architectures import TOKEN_IDS, family_of
from ..core.ffn import FFNWeights
from ..core.modes import eval_mode
from ..core.moe import MoELayer
from ..core.surgery import Target, layer_generator, tower_cfg
from ..data.assets import recorded_location
from ..data.text import read_texts, wikipedia_split
from ..errors import UpcycleError
from ..files import json_text
from ..methods import LayerLayout, Method, get_method, random_router
from ..methods.source_router import centroid_row, expert_groups, source_agreement, source_router
from ..outputs import Claim
from ..version import __version__
from .blockwise import visits
from .calibration import Reservoir, _first_block_inputs, _replay, text_batches
from .export import EXPORT_CLASSES, export_target
from .io import moe_spec, save_configs
from .lazy import checkpoint_names, materialize, materialize_trunk, release
from .loading import DTYPES, load_tokenizer, resolve_device, resolve_dtype
from .preservation import count_parameters, make_probe
from .shards import ShardedWriter, parse_size
from .skeleton import empty_model, planned_model, tensor_specs
from .sources import AveragedReader, Source, held_out_split, open_sources, source_name
from .stock_stream import check_export, export_streamed
from .streaming import COMPUTE_DTYPE, largest_block_bytes, write_queue_bytes

GROUPS = ("calibration", "held_out", "prompts", "negative_prompts")
ALL_TOKENS = 10**12        # prompts are few: every token of them


def validate_sources(cfg: ConvertConfig) -> tuple[Method, dict]:
    """Everything about a multi-source recipe that needs no model: refused before anything is read."""
    s = cfg.sources
    if not s.experts:
        raise UpcycleError("sources.experts is empty: a merge needs at least one source model")
    if s.router not in ROUTER_INITS:
        raise UpcycleError(f"sources.router must be one of {ROUTER_INITS}, got {s.router!r}")
    if s.non_ffn not in NON_FFN:
        raise UpcycleError(f"sources.non_ffn must be one of {NON_FFN}, got {s.non_ffn!r}")
    if not 0 <= s.held_out < 1:
        raise UpcycleError(f"sources.held_out must be in [0, 1), got {s.held_out}")
    if not 0 < s.router_std < float("inf"):
        raise UpcycleError(f"sources.router_std must be a positive number, got {s.router_std}")
    counts = [e.count for e in s.experts]
    if min(counts) < 1:
        raise UpcycleError(f"sources.experts[].count must be >= 1, got {counts}")
    if sum(counts) != cfg.moe.num_experts:
        raise UpcycleError(f"moe.num_experts must be {sum(counts)}, the experts the sources make (counts {counts}), "
                           f"got {cfg.moe.num_experts}")
    method = get_method(cfg.method)
    args = method.resolve_args(cfg.method_args)
    for i, e in enumerate(s.experts):
        where = f"sources.experts[{i}] ({e.model})"
        for key in ("data", "eval_data"):
            if getattr(e, key) is not None and not Path(getattr(e, key)).is_file():
                raise UpcycleError(f"{where}: {key}: no file {getattr(e, key)}")
        if s.router == "data" and e.data is None:
            raise UpcycleError(f"{where}: sources.router data needs each source's text (data: FILE)")
        if s.router == "prompts" and not e.prompts:
            raise UpcycleError(f"{where}: sources.router prompts needs each source's prompts (prompts: [...])")
        if method.needs_calibration and e.count > 1 and e.data is None:
            raise UpcycleError(f"{where}: method {method.name!r} needs the source's text (data: FILE)")
    if cfg.dtype not in DTYPES and cfg.dtype != "auto":
        raise UpcycleError(f"dtype must be auto or one of {sorted(DTYPES)}, got {cfg.dtype!r}")
    resolve_device(cfg.device)
    if cfg.export not in EXPORTS:
        raise UpcycleError(f"export must be 'upcycle' or 'hf', got {cfg.export!r}")
    if cfg.export_class not in ("auto", *EXPORT_CLASSES):
        raise UpcycleError(f"export_class must be auto or one of {sorted(EXPORT_CLASSES)}, got {cfg.export_class!r}")
    if cfg.streaming is False:
        raise UpcycleError("a several-source merge always streams (one block of one model in memory); "
                           "streaming: false is not available for it")
    if cfg.calibration.tokens < 1 or cfg.calibration.sequence_length < 1 or cfg.calibration.batch_size < 1:
        raise UpcycleError("calibration.tokens, calibration.sequence_length and calibration.batch_size must be >= 1")
    if cfg.check.text is not None and not Path(cfg.check.text).is_file():
        raise UpcycleError(f"check.text: no file {cfg.check.text}")
    parse_size(cfg.shard_size)
    return method, args


def _texts(path: str, where: str) -> list[str]:
    try:
        return read_texts(path)
    except (FileNotFoundError, ValueError) as e:
        raise UpcycleError(f"{where}: {e}") from None


def source_batches(cfg: ConvertConfig, tokenizer, index: int) -> dict[str, list[dict]]:
    """The token batches of source `index`, by group (GROUPS; a group without text is absent). The held-out
    documents are a seeded random `held_out` share of `data` unless `eval_data` is given."""
    entry, c = cfg.sources.experts[index], cfg.calibration
    where = f"sources.experts[{index}] ({entry.model})"
    docs = _texts(entry.data, where) if entry.data else []
    held = _texts(entry.eval_data, where) if entry.eval_data else []
    if docs and not entry.eval_data:
        docs, held = held_out_split(docs, cfg.sources.held_out, cfg.seed + index)
    groups = {"calibration": docs, "held_out": held, "prompts": list(entry.prompts),
              "negative_prompts": list(entry.negative_prompts)}
    out = {}
    for group, texts in groups.items():
        if texts:
            budget = c.tokens if group in ("calibration", "held_out") else ALL_TOKENS
            out[group] = text_batches(tokenizer, texts, tokens=budget, sequence_length=c.sequence_length,
                                      batch_size=c.batch_size, seed=cfg.seed)
    return out


@dataclass
class _Group:
    source: int
    kind: str
    batches: list[dict]
    states: list = dataclasses.field(default_factory=list)


def _ffn_modules(family, block) -> dict[str, torch.nn.Module]:
    """The block's FFN modules (where the FFN's input and output are) by their path inside the block."""
    wanted = {id(family.ffn_input(block)), id(family.ffn_output(block))}
    return {name: m for name, m in block.named_modules() if id(m) in wanted}


def read_ffn(family, block, prefix: str, tcfg, reader, names: dict[str, str], storage: torch.dtype,
             device: torch.device | None) -> FFNWeights:
    """A source's FFN of this block in float32 (rounded to the storage dtype first, as the output stores it):
    only the FFN's tensors are read, swapped into the (materialized) block for the family's extraction and
    swapped back."""
    saved = {}
    for path, module in _ffn_modules(family, block).items():
        state = module.state_dict()
        saved[path] = state
        loaded = {}
        for name, old in state.items():
            value = reader.get(names[f"{prefix}{path}.{name}"]).to(device or old.device)
            loaded[name] = value.to(storage).to(torch.float32) if value.is_floating_point() else value
        module.load_state_dict(loaded, strict=True, assign=True)
    try:
        return family.extract(block, tcfg).map(lambda t: t.to(torch.float32, copy=True))
    finally:
        for path, module in _ffn_modules(family, block).items():
            module.load_state_dict(saved[path], strict=True, assign=True)


def _stack(parts: list[FFNWeights]) -> FFNWeights:
    keys = parts[0].tensors()
    return dataclasses.replace(parts[0], **{k: torch.cat([p.tensors()[k] for p in parts]) for k in keys})


def _key(seed: int, *parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(":".join(str(p) for p in (seed, *parts)).encode()))


def build_layer(cfg: ConvertConfig, method: Method, args: dict, target: Target, ffns: list[FFNWeights],
                shared: FFNWeights | None, samples: dict[tuple[int, str], torch.Tensor], *, storage: torch.dtype,
                output_dropout: float) -> tuple[MoELayer, dict]:
    """The MoE layer of one target from the sources' FFNs and the groups' FFN-input samples, and its facts."""
    s = cfg.sources
    counts = [e.count for e in s.experts]
    parts, method_rows, facts = [], [], []
    for i, (entry, ffn) in enumerate(zip(s.experts, ffns, strict=True)):
        init = method(ffn, args, num_experts=entry.count, top_k=min(cfg.moe.top_k, entry.count),
                      generator=_key(cfg.seed, "source", i, target.tower, target.index),
                      normalize_topk=cfg.moe.normalize_topk, activations=samples.get((i, "calibration")))
        parts.append(init.experts)
        method_rows.append(init.router_ED)
        facts.append(init.info)
    experts = _stack(parts)
    D = experts.hidden_size
    if s.router == "random":
        router = random_router(sum(counts), D, s.router_std, layer_generator(cfg.seed, target))
        rows = None
    else:
        kind = "calibration" if s.router == "data" else "prompts"
        rows = torch.stack([centroid_row(samples[(i, kind)], samples.get((i, "negative_prompts"))
                                         if s.router == "prompts" else None) for i in range(len(counts))])
        router = source_router(rows, counts)
        # experts made from one source share its row; the method's own (small random) rows break the tie
        start = 0
        for n, extra in zip(counts, method_rows, strict=True):
            if n > 1:
                router[start:start + n] += extra.to(router.device)
            start += n
    with torch.device(experts.w_up.device):
        layer = MoELayer.from_init(experts, router, config=cfg.moe,
                                   shared=shared.map(lambda t: t.unsqueeze(0)) if shared is not None else None,
                                   dtype=storage, output_dropout=output_dropout)
    info = {"method_facts": facts if any(facts) else None}
    if rows is not None:
        cos = rows.double() @ rows.double().T
        eye = torch.eye(len(rows), dtype=cos.dtype, device=cos.device)      # the rows may be on the GPU
        info["router_rows_max_cosine"] = (float((cos - 2 * eye).max())
                                          if len(rows) > 1 else None)
    return layer, info


@torch.no_grad()
def layer_agreement(layer: MoELayer, ffns: list[FFNWeights], samples: dict[tuple[int, str], torch.Tensor],
                    names: list[str], counts: list[int]) -> dict:
    """Per source with held-out tokens: router-source agreement and the share of its tokens each source's
    experts get as top-1; and each expert against its source's FFN on those tokens (max |difference|)."""
    groups_E = expert_groups(counts)
    weights = layer.experts.weights()
    agreement, shares, expert_diff = {}, {}, {}
    start = 0
    for i, name in enumerate(names):
        x = samples.get((i, "held_out"))
        if x is not None:
            x = x.to(layer.router.weight.device)
            ids = layer.route(x).topk_ids_TK
            agreement[name] = source_agreement(ids, groups_E, i)
            top1 = groups_E.to(ids.device)[ids[:, 0]]
            shares[name] = [float((top1 == j).double().mean()) for j in range(len(names))]
            probe = x[:256].float()
            reference = ffns[i](probe)
            expert_diff[name] = max(float((weights.expert(e).map(lambda t: t.float())(probe) - reference).abs().max())
                                    for e in range(start, start + counts[i]))
        start += counts[i]
    return {"agreement": agreement, "top1_share_by_source": shares, "expert_vs_source_max_abs_diff": expert_diff}


def _probe_texts(cfg: ConvertConfig) -> tuple[list[str] | None, str]:
    if cfg.check.text is not None:
        return _texts(cfg.check.text, "check.text"), f"text file {cfg.check.text}"
    try:
        return wikipedia_split()[1], "held-out Wikipedia (embedded)"
    except (FileNotFoundError, OSError):
        return None, "random token ids"


def merge_sources(cfg: ConvertConfig, claim: Claim, *, progress: bool = True) -> dict:
    """Merge `cfg.sources.experts` on the base `cfg.model` into the claimed output (module docstring); returns
    the report."""
    t_start = time.perf_counter()
    method, args = validate_sources(cfg)
    s = cfg.sources
    base, sources = open_sources(cfg)          # configs and headers only: a mismatch is refused here
    family = family_of(base.config)
    if any(t.input != TOKEN_IDS for t in family.towers_of(base.config).values()):
        raise UpcycleError(f"several-source merges take text models; {cfg.model} ({base.config.model_type}) has an "
                           f"image tower")
    cfg = dataclasses.replace(cfg, dtype=resolve_dtype(cfg.dtype, base.config))
    storage, device = DTYPES[cfg.dtype], resolve_device(cfg.device)
    tokenizer = load_tokenizer(base.path)
    if tokenizer is None and any(e.data or e.eval_data or e.prompts for e in s.experts):
        raise UpcycleError(f"{cfg.model} has no tokenizer, so the sources' text and prompts cannot be read")
    groups = [_Group(i, kind, batches) for i in range(len(s.experts))
              for kind, batches in source_batches(cfg, tokenizer, i).items()]
    names_of = [f"{i}:{e.model}" for i, e in enumerate(s.experts)]

    def layout_of(dense: FFNWeights) -> LayerLayout:
        layout = method.layout(dense.intermediate_size, args)
        if layout != LayerLayout(dense.intermediate_size):
            raise UpcycleError(f"method {method.name!r} makes experts of another shape ({layout}); with several "
                               f"sources the method must keep the FFN's width without a shared expert or router "
                               f"bias (copy, noise, drop, cluster)")
        return LayerLayout(dense.intermediate_size, shared_width=dense.intermediate_size if s.shared_expert else None)

    planned, targets = planned_model(base.config, cfg.moe, cfg.placement, layout_of, dtype=storage)
    stock = why_not_hf = None
    if cfg.export == "hf":
        try:
            stock = export_target(planned, cfg.export_class)      # decided before a weight is read
        except UpcycleError as e:
            if cfg.export_class != "auto":
                raise
            why_not_hf = str(e)
            tqdm.write(f"[upcycle] not exported to a stock class: {e}")
    texts, text_source = _probe_texts(cfg) if stock is not None else (None, None)

    unique = {id(src.reader): src.reader for src in sources}
    reader = base.reader if s.non_ffn == "base" else AveragedReader(list(unique.values()))
    model = empty_model(base.config, COMPUTE_DTYPE)
    names, missing = checkpoint_names(model, reader)
    if missing:
        raise UpcycleError(f"{cfg.model}: the checkpoint's tensor names do not match {type(model).__name__}'s "
                           f"({len(missing)} not found, e.g. {missing[:3]})")
    timings = {"open": time.perf_counter() - t_start}
    with claim.directory() as tmp:
        folder = tmp / "upcycle-format" if stock is not None else tmp
        folder.mkdir(exist_ok=True)
        t = time.perf_counter()
        layers = _stream(cfg, method, args, model, family, targets, planned, reader, names, base, sources, groups,
                         names_of, folder, storage, device, progress, timings)
        save_configs(planned, folder, moe_spec(planned), tokenizer)
        timings["merge"] = time.perf_counter() - t
        export = {"format": "upcycle", "streamed": True}
        if why_not_hf:
            export["why_not_hf"] = why_not_hf
        if stock is not None:
            t = time.perf_counter()
            export_streamed(folder, tmp, planned, stock, tokenizer=tokenizer,
                            max_shard_bytes=parse_size(cfg.shard_size))
            reader_model, _ = planned_model(base.config, cfg.moe, cfg.placement, layout_of, dtype=COMPUTE_DTYPE)
            probe = make_probe(reader_model, tokenizer, texts, cfg.check, cfg.seed, text_source)
            # the stock model is loaded whole for this (transformers renames and fuses its tensors as it loads):
            # check.end_to_end false keeps the export within the merge's streaming memory
            check = (check_export(folder, tmp, reader_model, probe, cfg.check.export_tolerance, family.outputs)
                     if cfg.check.end_to_end is not False else
                     {"checked": False, "why_not": "check.end_to_end: false"})
            shutil.rmtree(folder)
            export = {"format": "hf", "class": stock.architecture, "model_type": stock.model_type, "streamed": True,
                      "check": check}
            timings["export"] = time.perf_counter() - t
        report = _report(cfg, base, sources, planned, targets, layers, export, timings)
        (tmp / "run_config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
        text = json_text(report, indent=2, where="upcycle_report.json")
        (tmp / "upcycle_report.json").write_text(text)    # last file written
    return report


@torch.no_grad()     # without it every block's replay stays in one autograd graph: memory grows with depth
def _stream(cfg, method, args, model, family, targets, planned, reader, names, base: Source, sources: list[Source],
            groups: list[_Group], names_of, folder: Path, storage, device, progress, timings) -> list[dict]:
    """Steps 2-4 of the module docstring: the per-block replay, the layers built and every tensor written."""
    s = cfg.sources
    counts = [e.count for e in s.experts]
    specs = tensor_specs(planned)
    planned_dtype = {name: dt for name, _, dt in specs}
    plan = visits(model, family, targets, replay=bool(groups))
    computed = [v.path for v in plan if v.needs_compute]
    writer = ShardedWriter(folder, specs, max_shard_bytes=parse_size(cfg.shard_size),
                           max_pending_bytes=write_queue_bytes(largest_block_bytes(specs, computed)))
    towers = {v.tower: model.get_submodule(v.path.rsplit(".", 1)[0]) for v in plan if v.needs_compute}
    tower = family.towers_of(model.config)
    entries = []
    t_replay = 0.0
    try:
        with eval_mode(model):
            if groups:
                t = time.perf_counter()
                materialize_trunk(model, reader, names, COMPUTE_DTYPE, storage, device)
                for group in groups:
                    group.states = _first_block_inputs(model, towers, group.batches, device=device)
                release(model)
                reader.close()
                t_replay += time.perf_counter() - t
            for visit in tqdm(plan, desc="merging blocks", unit="block", disable=not progress, leave=False):
                prefix = visit.path + "."
                if not visit.needs_compute:
                    for name in (n for n in planned_dtype if n.startswith(prefix)):
                        writer.write(name, reader.get(names[name]).to(planned_dtype[name]))
                    reader.close()
                    continue
                block = model.get_submodule(visit.path)
                materialize(block, prefix, reader, names, COMPUTE_DTYPE, storage, device)
                target = visit.target
                ffn = family.ffn_input(block) if target is not None else None
                samples = {}
                t = time.perf_counter()
                for group in groups:
                    states = group.states[visit.tower]
                    masks = [b.get("attention_mask") if tower[visit.tower].padding_mask else None
                             for b in group.batches]
                    reservoir = (Reservoir(cfg.calibration.tokens, _key(cfg.seed, "reservoir", group.source,
                                                                        group.kind, target.name))
                                 if target is not None else None)
                    _replay(block, states, masks, ffn, reservoir)
                    if reservoir is not None and reservoir.seen:
                        samples[(group.source, group.kind)] = reservoir.sample()
                t_replay += time.perf_counter() - t
                ffn = None          # the dense FFN leaves with the block once the MoE layer replaces it
                if target is not None:
                    tcfg = tower_cfg(model, family, target)
                    ffns = [read_ffn(family, block, prefix, tcfg, src.reader, names, storage, device)
                            for src in sources]
                    shared = (read_ffn(family, block, prefix, tcfg, base.reader, names, storage, device)
                              if s.shared_expert else None)
                    layer, info = build_layer(cfg, method, args, target, ffns, shared, samples, storage=storage,
                                              output_dropout=family.output_dropout(tcfg))
                    entry = {"name": target.name, "block": target.path, **info,
                             **layer_agreement(layer, ffns, samples, names_of, counts),
                             "tokens": {f"{names_of[i]}/{kind}": int(x.shape[0]) for (i, kind), x in samples.items()}}
                    entries.append(entry)
                    del ffns, shared, samples
                    family.install(block, layer)
                for name, tensor in block.state_dict().items():
                    writer.write(prefix + name, tensor.to(planned_dtype[prefix + name]))
                release(block)
                reader.close()
                for src in sources:
                    src.reader.close()
        for name in planned_dtype:
            if not any(name.startswith(p + ".") for p in (v.path for v in plan)):
                writer.write(name, reader.get(names[name]).to(planned_dtype[name]))
        writer.close()
    except BaseException:
        writer.abort()
        raise
    timings["replay"] = t_replay
    return entries


def _absolute(path: str | None) -> str | None:
    return str(Path(path).resolve()) if path else None


def _held_out_record(cfg: ConvertConfig, entry, index: int) -> dict | None:
    """Where the source's held-out documents are (`upcycle analyze` reads them back): the whole `eval_data`,
    or `held_out_split(documents of data, share, seed)`; None without text."""
    if entry.eval_data:
        return {"file": _absolute(entry.eval_data), "split": None}
    if entry.data and cfg.sources.held_out > 0:
        return {"file": _absolute(entry.data), "split": {"share": cfg.sources.held_out, "seed": cfg.seed + index}}
    return None


def _report(cfg, base, sources, planned, targets, layers, export, timings) -> dict:
    s = cfg.sources
    counts = [e.count for e in s.experts]
    groups = expert_groups(counts).tolist()
    params = count_parameters(planned)
    agreement = {}
    for name in (layers[0]["agreement"] if layers else {}):
        values = [layer["agreement"][name] for layer in layers]
        agreement[name] = {"mean": sum(values) / len(values), "min": min(values)}
    return {
        "upcycle_version": __version__, "method": f"sources ({cfg.method})", "source_model": cfg.model,
        "source_path": recorded_location(cfg.model),
        "model_type": planned.config.model_type, "model_class": type(planned).__name__,
        "num_moe_layers": len(targets), "num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
        "moe_layers": [t.name for t in targets], "moe": dataclasses.asdict(cfg.moe),
        "sources": {"router": s.router, "non_ffn": s.non_ffn, "shared_expert": s.shared_expert,
                    "experts": [{"name": source_name(e.model, i), "model": e.model, "path": src.path,
                                 "count": e.count, "data": _absolute(e.data), "eval_data": _absolute(e.eval_data),
                                 "held_out": _held_out_record(cfg, e, i), "prompts": len(e.prompts),
                                 "negative_prompts": len(e.negative_prompts)}
                                for i, (e, src) in enumerate(zip(s.experts, sources, strict=True))],
                    # expert e was made from source expert_source[e]: the routing analysis's groups
                    "expert_source": groups, "base": base.path},
        "router_source_agreement": agreement,
        "parameters": {"after": params}, "max_abs_logit_diff": None, "kl_to_dense": None,
        "preservation": {"promised": False, "passed": None,
                         "why": "experts from several models: nothing reproduces one dense model"},
        "layers": layers, "export": export, "seed": cfg.seed, "dtype": cfg.dtype, "timings": timings,
        "streamed": True}
