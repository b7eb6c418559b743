"""A conversion decided as one value before any weight loads (`make_plan`), then executed by its route.

Everything `upcycle convert` decides from the config, the registries and the checkpoints' config.json and
safetensors headers is decided here, once:

    the method, its resolved arguments, and whether it promises the dense function  (`validate.py`)
    the dtype the conversion computes in (`dtype: auto` resolved from the checkpoint)
    the dense config, the MoE targets and the planned model (`planned.planned_model`, on the meta device)
    the stock class written (`export.layout.choose_export`), or why none
    the route: in memory, streamed (the checkpoint opened, headers only) or merged (every source checked
                against the base from its config and headers)
    the inputs OUT must never be (`pipeline.conversion_inputs`)

So every refusal that needs no weights (an unknown method, a bad argument, a missing model, an export class
that cannot hold the model, streaming that cannot stream, a merge source of another shape) happens in
`make_plan`, before OUT is claimed; `--dry-run` prints the plan (`summary`, and the memory estimate
`dry_run.estimate` makes of it); the routes (`routes.py`), the block sources, the layer builders and the report
take the plan, never the config: `make_plan` is where a conversion reads its config (`pipeline.convert` and
`pipeline.upcycle_model` hand it on), so the family is decided and the planned model built once per plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from ..checkpoint.agreement import check_dense_checkpoint
from ..checkpoint.loading import DTYPES, dense_config, resolve_dtype
from ..checkpoint.streamed import NotStreamable, StreamSource
from ..checkpoint.writer import parse_size
from ..config import (
    CalibrationConfig,
    CheckConfig,
    ConvertConfig,
    MoEConfig,
    PlacementConfig,
    SourcesConfig,
    to_dict,
)
from ..core.architectures import Family, family_of
from ..core.devices import resolve_device
from ..core.ffn import FFNWeights
from ..core.surgery import Target, plan_targets
from ..data.assets import DEFAULT_MODEL_NAMES
from ..data.model_names import model_inputs
from ..errors import UpcycleError
from ..export.layout import choose_export
from ..export.protocol import StockClass
from ..methods import LayerLayout, Method
from ..outputs.claims import Input, inputs
from ..outputs.job import NEW_OUTPUT, Claiming
from .inputs import promises_dense_function
from .planned import layout_function, planned_model
from .validate import check_settings, check_sources, resolve_method

IN_MEMORY, STREAMED, MERGED = "in memory", "streamed", "merged"
COMPUTE_DTYPE = torch.float32       # what a streamed conversion computes in (the storage dtype is the plan's)


@dataclass(frozen=True)
class ConversionPlan:
    """Everything a conversion decided before a weight loads (module docstring), and everything its executors read:
    the config itself is not kept (`settings` is its resolved dict, written as run_config.yaml). `stream` is the
    opened checkpoint of a streamed route, `opened` the (base, sources) of a merged one. The plan of a model given
    in memory (`make_plan(cfg, model=...)`) has no folder, planned model or output."""

    method: Method
    args: dict
    promised: bool
    route: str
    model: str                                     # the dense model as the config names it (a merge's base)
    path: str | None                               # its folder (None: a model given in memory)
    config: object                                 # its transformers config
    family: Family                                 # its row of the architecture table
    dtype: str                                     # the storage and in-memory compute dtype (`auto` resolved)
    moe: MoEConfig
    placement: PlacementConfig
    check: CheckConfig
    calibration: CalibrationConfig
    sources: SourcesConfig                         # a merge's sources (none for one model)
    seed: int
    device: str
    export: str
    shard_bytes: int                               # the largest output shard
    layout_of: Callable[[FFNWeights], LayerLayout]
    planned: nn.Module | None                      # the upcycled model on the meta device
    targets: list[Target]
    stock: StockClass | None                       # the stock class written (`export: hf`), or None
    why_not_stock: str | None                      # why none, when `export_class: auto` found none
    given: list[Input]                             # what OUT must never be
    settings: dict                                 # the resolved config, as run_config.yaml holds it
    stream: StreamSource | None = None
    opened: tuple | None = None
    kind: ClassVar[str] = "convert"                # the output's kind (`outputs.job.Plan`)
    claiming: ClassVar[Claiming] = NEW_OUTPUT

    def summary(self) -> dict:
        """The decisions as plain values (what `--dry-run` prints and the executed conversion took)."""
        return {"method": self.method.name, "method_args": self.args, "promised": self.promised,
                "dtype": self.dtype, "route": self.route, "model_type": self.config.model_type,
                "moe_layers": [t.name for t in self.targets],
                "num_experts": self.moe.num_experts, "top_k": self.moe.top_k,
                "export": self.export,
                "export_class": self.stock.name if self.stock is not None else None,
                "why_not_export_class": self.why_not_stock}

    def describe(self) -> str:
        """The decisions as lines for a person (the dry run adds the sizes and the memory estimate)."""
        model_class = type(self.planned).__name__ if self.planned is not None else self.config.model_type
        export = (self.stock.name if self.stock is not None else
                  f"upcycle format ({self.why_not_stock})" if self.why_not_stock else self.export)
        return "\n".join([
            f"{model_class} ({self.config.model_type}) -> {len(self.targets)} MoE layers, {self.moe.num_experts} "
            f"experts, top-{self.moe.top_k}, method {self.method.name}",
            f"  MoE layers: {', '.join(t.name for t in self.targets)}",
            f"  route: {self.route}; dtype {self.dtype}; "
            f"{'promises' if self.promised else 'does not promise'} the dense function; export {export}"])


def make_plan(cfg: ConvertConfig, *, writing: bool = True, build: bool = True, recipe: str | None = None,
              model: nn.Module | None = None) -> ConversionPlan:
    """The plan of converting as `cfg` says (module docstring). `writing`: OUT is given (a conversion without OUT
    converts in memory and writes nothing). `build=False` (a dry run): the embedded model's cache is not built
    and no checkpoint is opened beyond its headers. `model`: a model given in memory (`pipeline.upcycle_model`),
    converted in place in its own dtype."""
    merging = bool(cfg.sources.experts)
    method, args = resolve_method(cfg.method, cfg.method_args, cfg.moe, merging=merging)
    check_settings(cfg.device, cfg.shard_size, cfg.export_class, cfg.check.text)
    if merging:
        check_sources(cfg.sources, cfg.moe.num_experts, method, cfg.streaming)
        if not writing or model is not None:
            raise UpcycleError("a merge of several source models is streamed to a folder: give OUT")
    layout_of = merge_layout(method, args, cfg.sources.shared_expert) if merging else layout_function(method, args)
    planned, stream, opened, stock = None, None, None, (None, None)
    if model is not None:
        route, path, config = IN_MEMORY, None, model.config
        dtype = cfg.dtype if cfg.dtype != "auto" else str(next(model.parameters()).dtype).removeprefix("torch.")
        targets = plan_targets(model, cfg.placement)
    else:
        if merging:
            from .sources import open_sources

            opened = open_sources(cfg.model, cfg.sources)      # configs and headers only: a mismatch is refused here
            path, config = opened[0].path, opened[0].config
        else:
            path, config = dense_config(cfg.model, build=build)
            # integer weights (a quantized checkpoint) are refused from the headers, by the run and its dry run alike
            check_dense_checkpoint(path, config, f"model {cfg.model!r}", values=False)
        dtype = resolve_dtype(cfg.dtype, config)               # the report states the dtype used
        planned, targets = _planned(path, config, cfg.moe, cfg.placement, layout_of, dtype)
        route = MERGED if merging else IN_MEMORY
        if writing and not merging:
            route, stream = _route(cfg.streaming, cfg.export, cfg.model, (path, config, dtype, cfg.device), build)
        if writing:     # a class chosen on the weightless model: one that cannot hold it is refused before OUT
            stock = choose_export(planned, cfg.export, cfg.export_class)
    # nothing in a merge reproduces one dense model: no promise (each source's text calibrates its own experts)
    promised = not merging and promises_dense_function(method, args, cfg.moe)
    # a model given in memory is written nowhere: no input to keep OUT away from
    given = [] if model is not None else conversion_inputs(cfg.model, cfg.sources, recipe, cfg.check.text,
                                                           cfg.calibration.data)
    return ConversionPlan(
        method, args, promised, route, cfg.model, path, config, family_of(config), dtype, cfg.moe, cfg.placement,
        cfg.check, cfg.calibration, cfg.sources, cfg.seed, cfg.device, cfg.export, parse_size(cfg.shard_size),
        layout_of, planned, targets, *stock, given,
        to_dict(dataclasses.replace(cfg, dtype=dtype)), stream=stream, opened=opened)


def _planned(path: str, config, moe: MoEConfig, placement: PlacementConfig, layout_of, dtype: str
             ) -> tuple[nn.Module, list[Target]]:
    """The planned model, or one line when the config builds no model (an unknown activation, a bad size)."""
    try:
        return planned_model(config, moe, placement, layout_of, dtype=DTYPES[dtype])
    except UpcycleError:
        raise
    except Exception as e:      # noqa: BLE001  (whatever transformers raises for a config it cannot build)
        raise UpcycleError(f"{path}: config.json does not build a {config.model_type} model "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None


def _route(streaming: bool | str, export: str, name: str, checkpoint: tuple, build: bool
           ) -> tuple[str, StreamSource | None]:
    """Streamed when the checkpoint (path, config, dtype, device) can be read block by block (`stream_source`),
    else in memory."""
    if not streams_by_rule(streaming, export):
        return IN_MEMORY, None
    if not build and not Path(checkpoint[0]).is_dir() and name in DEFAULT_MODEL_NAMES:
        # the embedded model's cache, not built by a dry run, is a safetensors folder: the rule alone decides
        return STREAMED, None
    stream = stream_source(streaming == "auto", name, *checkpoint)
    return (STREAMED if stream is not None else IN_MEMORY), stream


def merge_layout(method: Method, args: dict, shared_expert: bool) -> Callable[[FFNWeights], LayerLayout]:
    """A merge's layer layout: each source's experts as wide as its FFN (a method that changes the shape is
    refused), and with `sources.shared_expert` the base's FFN as a shared expert."""
    def layout_of(dense: FFNWeights) -> LayerLayout:
        layout = method.layout(dense.intermediate_size, args)
        if layout != LayerLayout(dense.intermediate_size):
            raise UpcycleError(f"method {method.name!r} makes experts of another shape ({layout}); with several "
                               f"sources the method must keep the FFN's width without a shared expert or router "
                               f"bias (copy, noise, drop, cluster)")
        return LayerLayout(dense.intermediate_size, shared_width=dense.intermediate_size if shared_expert else None)
    return layout_of


def streams_by_rule(streaming: bool | str, export: str) -> bool:
    """Whether the config lets the conversion stream a local safetensors checkpoint: not with `streaming:
    false`, and not with `export: hf` under `streaming: auto` (in memory, the export is checked against the
    upcycled model itself; streamed, against the dense model, since the upcycled model is never whole)."""
    return streaming is not False and not (export == "hf" and streaming == "auto")


def stream_source(optional: bool, name: str, path: str, config, dtype: str, device: str) -> StreamSource | None:
    """The checkpoint opened for streaming (headers only) when the rule (`streams_by_rule`) lets it stream; when
    it cannot (a hub id, a folder without safetensors, names that do not match), None under `streaming: auto`
    (`optional`: the in-memory path runs), one line under `streaming: true`."""
    if not Path(path).is_dir():
        why = f"{name} is not a local folder"
    else:
        try:
            return StreamSource.open(path, config, COMPUTE_DTYPE, storage=DTYPES[dtype], device=resolve_device(device))
        except NotStreamable as e:
            why = str(e)
    if not optional:
        raise UpcycleError(f"streaming: true, but the conversion cannot stream: {why}")
    return None


def conversion_inputs(model: str, sources: SourcesConfig, recipe: str | None, probe_text: str | None,
                      calibration_data: str | None) -> list[Input]:
    """Every path a conversion reads, for the output checks: the model (the embedded model's cache and wheel
    too), the recipe, the probe and calibration files, and a merge's sources and their text."""
    found = [Input(what, path) for what, path in model_inputs(model)]
    for i, source in enumerate(sources.experts):
        found += [Input(f"source {i}'s {what}", path) for what, path in model_inputs(source.model)]
        found += inputs((f"source {i}'s data", source.data), (f"source {i}'s held-out data", source.eval_data))
    return found + inputs(("recipe", recipe), ("probe text", probe_text), ("calibration data", calibration_data))
