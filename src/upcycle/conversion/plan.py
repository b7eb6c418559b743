"""A conversion decided as one value before any weight loads (`make_plan`), then executed by its route.

Everything `upcycle convert` decides from the config, the registries and the checkpoints' config.json and
safetensors headers is decided here, once:

    the method, its resolved arguments, and whether it promises the dense function  (`validate.validate`)
    the dtype the conversion computes in (`dtype: auto` resolved from the checkpoint)
    the dense config, the MoE targets and the planned model (`planned.planned_model`, on the meta device)
    the stock class written (`export.layout.choose_export`), or why none
    the route: in memory, streamed (the checkpoint opened, headers only) or merged (every source checked
                against the base from its config and headers)
    the inputs OUT must never be (`pipeline.conversion_inputs`)

So every refusal that needs no weights (an unknown method, a bad argument, a missing model, an export class
that cannot hold the model, streaming that cannot stream, a merge source of another shape) happens in
`make_plan`, before OUT is claimed; `--dry-run` prints the plan (`summary`, and the memory estimate
`dry_run.estimate` makes of it); the routes (`routes.py`) take the plan, not the config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..checkpoint.agreement import check_dense_checkpoint
from ..checkpoint.loading import DTYPES, dense_config
from ..checkpoint.streamed import NotStreamable, StreamSource
from ..config import ConvertConfig
from ..core.devices import resolve_device
from ..core.ffn import FFNWeights
from ..core.surgery import Target
from ..data.assets import DEFAULT_MODEL_NAMES
from ..data.model_names import model_inputs
from ..errors import UpcycleError
from ..export.layout import choose_export
from ..export.protocol import StockClass
from ..methods import LayerLayout, Method
from ..outputs.claims import Input, inputs
from .inputs import promises_dense_function, with_resolved_dtype
from .planned import layout_function, planned_model
from .validate import validate

IN_MEMORY, STREAMED, MERGED = "in memory", "streamed", "merged"
COMPUTE_DTYPE = torch.float32       # what a streamed conversion computes in (the storage dtype is the plan's)


@dataclass(frozen=True)
class ConversionPlan:
    """Everything a conversion decided before a weight loads (module docstring). `cfg` has its dtype resolved;
    `stream` is the opened checkpoint of a streamed route, `opened` the (base, sources) of a merged one."""

    cfg: ConvertConfig
    method: Method
    args: dict
    promised: bool
    route: str
    path: str                                      # the dense model's folder (a merge's base)
    config: object                                 # its transformers config
    layout_of: Callable[[FFNWeights], LayerLayout]
    planned: nn.Module                             # the upcycled model on the meta device
    targets: list[Target]
    stock: StockClass | None                       # the stock class written (`export: hf`), or None
    why_not_stock: str | None                      # why none, when `export_class: auto` found none
    given: list[Input]                             # what OUT must never be
    stream: StreamSource | None = None
    opened: tuple | None = None

    def summary(self) -> dict:
        """The decisions as plain values (what `--dry-run` prints and the executed conversion took)."""
        return {"method": self.method.name, "method_args": self.args, "promised": self.promised,
                "dtype": self.cfg.dtype, "route": self.route, "model_type": self.config.model_type,
                "moe_layers": [t.name for t in self.targets],
                "num_experts": self.cfg.moe.num_experts, "top_k": self.cfg.moe.top_k,
                "export": self.cfg.export,
                "export_class": self.stock.name if self.stock is not None else None,
                "why_not_export_class": self.why_not_stock}


def make_plan(cfg: ConvertConfig, *, writing: bool = True, build: bool = True, recipe: str | None = None
              ) -> ConversionPlan:
    """The plan of converting as `cfg` says (module docstring). `writing`: OUT is given (a conversion without OUT
    converts in memory and writes nothing). `build=False` (a dry run): the embedded model's cache is not built
    and no checkpoint is opened beyond its headers."""
    method, args = validate(cfg)
    given = conversion_inputs(cfg, recipe)
    if cfg.sources.experts:
        if not writing:
            raise UpcycleError("a merge of several source models is streamed to a folder: give OUT")
        return _merge_plan(cfg, method, args, given)
    path, config = dense_config(cfg.model, build=build)
    # integer weights (a quantized checkpoint) are refused from the headers, by the run and its dry run alike
    check_dense_checkpoint(path, config, f"model {cfg.model!r}", values=False)
    cfg = with_resolved_dtype(cfg, config)              # the report states the dtype used
    layout_of = layout_function(method, args)
    planned, targets = _planned(path, config, cfg, layout_of)
    route, stream = _route(cfg, path, config, writing, build)
    # a class chosen on the planned (weightless) model: one that cannot hold it is refused before OUT is claimed
    stock, why_not = choose_export(planned, cfg) if writing else (None, None)
    return ConversionPlan(cfg, method, args, promises_dense_function(method, args, cfg), route, path, config,
                          layout_of, planned, targets, stock, why_not, given, stream=stream)


def _planned(path: str, config, cfg: ConvertConfig, layout_of) -> tuple[nn.Module, list[Target]]:
    """The planned model, or one line when the config builds no model (an unknown activation, a bad size)."""
    try:
        return planned_model(config, cfg.moe, cfg.placement, layout_of, dtype=DTYPES[cfg.dtype])
    except UpcycleError:
        raise
    except Exception as e:      # noqa: BLE001  (whatever transformers raises for a config it cannot build)
        raise UpcycleError(f"{path}: config.json does not build a {config.model_type} model "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None


def _route(cfg: ConvertConfig, path: str, config, writing: bool, build: bool) -> tuple[str, StreamSource | None]:
    """Streamed when the checkpoint can be read block by block (`streaming.stream_source`), else in memory."""
    if not writing:
        return IN_MEMORY, None
    if not build and not Path(path).is_dir() and cfg.model in DEFAULT_MODEL_NAMES:
        # the embedded model's cache, not built by a dry run, is a safetensors folder: the rule alone decides
        return (STREAMED if streams_by_rule(cfg) else IN_MEMORY), None
    stream = stream_source(cfg, path, config)
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


def _merge_plan(cfg: ConvertConfig, method: Method, args: dict, given: list[Input]) -> ConversionPlan:
    from ..core.architectures import TOKEN_IDS, family_of
    from .sources import open_sources

    opened = open_sources(cfg)          # configs and headers only: a mismatch is refused here
    base = opened[0]
    if any(t.input != TOKEN_IDS for t in family_of(base.config).towers_of(base.config).values()):
        raise UpcycleError(f"several-source merges take text models; {cfg.model} ({base.config.model_type}) "
                           f"has an image tower")
    cfg = with_resolved_dtype(cfg, base.config)
    layout_of = merge_layout(method, args, cfg.sources.shared_expert)
    planned, targets = _planned(base.path, base.config, cfg, layout_of)
    stock, why_not = choose_export(planned, cfg)
    # nothing here reproduces one dense model: no promise (each source's text calibrates its own experts)
    return ConversionPlan(cfg, method, args, False, MERGED, base.path, base.config, layout_of, planned, targets,
                          stock, why_not, given, opened=opened)


def streams_by_rule(cfg: ConvertConfig) -> bool:
    """Whether the config lets the conversion stream a local safetensors checkpoint: not with `streaming:
    false`, and not with `export: hf` under `streaming: auto` (in memory, the export is checked against the
    upcycled model itself; streamed, against the dense model, since the upcycled model is never whole)."""
    return cfg.streaming is not False and not (cfg.export == "hf" and cfg.streaming == "auto")


def stream_source(cfg: ConvertConfig, path: str, config) -> StreamSource | None:
    """The checkpoint opened for streaming (headers only), or None when the in-memory path runs (the rule of
    `streams_by_rule`; a hub id; a folder without safetensors; names that do not match)."""
    if cfg.streaming is False:
        return None
    why = None
    if not Path(path).is_dir():
        why = f"{cfg.model} is not a local folder"
    elif not streams_by_rule(cfg):
        return None
    else:
        try:
            return StreamSource.open(path, config, COMPUTE_DTYPE, storage=DTYPES[cfg.dtype],
                                     device=resolve_device(cfg.device))
        except NotStreamable as e:
            why = str(e)
    if cfg.streaming is True:
        raise UpcycleError(f"streaming: true, but the conversion cannot stream: {why}")
    return None


def conversion_inputs(cfg: ConvertConfig, recipe: str | None = None) -> list[Input]:
    """Every path a conversion reads, for the output checks: the model (the embedded model's cache and wheel
    too), the recipe, the probe and calibration files, and a merge's sources and their text."""
    found = [Input(what, path) for what, path in model_inputs(cfg.model)]
    for i, source in enumerate(cfg.sources.experts):
        found += [Input(f"source {i}'s {what}", path) for what, path in model_inputs(source.model)]
        found += inputs((f"source {i}'s data", source.data), (f"source {i}'s held-out data", source.eval_data))
    return found + inputs(("recipe", recipe), ("probe text", cfg.check.text),
                          ("calibration data", cfg.calibration.data))
