"""The checks of a conversion that need no model, made once before anything is read or written.

A config checks its own keys' ranges and choices when it is built (`upcycle.config`); what is left needs a
registry or the file system: the method and its arguments, the device, the shard size, the export class, the
probe file, and a merge's sources.
"""

from __future__ import annotations

from ..checkpoint.writer import parse_size
from ..config import MoEConfig, SourcesConfig
from ..core.devices import resolve_device
from ..errors import UpcycleError
from ..export.registry import STOCK_CLASSES
from ..files import file_problem
from ..methods import Method, get_method


def resolve_method(name: str, method_args: dict, moe: MoEConfig, *, merging: bool = False) -> tuple[Method, dict]:
    """The method and its resolved arguments, its count rule checked against the MoE's (a merge refuses a method
    that reshapes experts with its own reason, `plan.merge_layout`)."""
    method = get_method(name)
    args = method.resolve_args(method_args)
    if not merging:
        method.counts(moe.num_experts, moe.top_k, args)
    if moe.experts == "delta":
        if merging:
            raise UpcycleError("moe.experts delta: a merge's experts come from different models, so each differs "
                               "from any one base by a full-rank change; merge with full experts, then `upcycle "
                               "compress` measures what a rank keeps")
        if method.no_deltas is not None:
            raise UpcycleError(f"moe.experts delta: method {name!r} cannot be stored as delta experts: "
                               f"{method.no_deltas}")
    return method, args


def check_settings(device: str, shard_size: str, export_class: str, probe_text: str | None) -> None:
    """The device, the shard size, the export class and the probe file: usable before anything is read."""
    resolve_device(device)
    parse_size(shard_size)
    if export_class != "auto" and export_class not in STOCK_CLASSES:
        raise UpcycleError(f"export_class must be auto or one of {', '.join(STOCK_CLASSES)}, got {export_class!r}")
    if probe_text is not None and (problem := file_problem(probe_text)):
        raise UpcycleError(f"check.text {probe_text}: {problem}")


def require_calibration(method: Method, calibration) -> None:
    """A data-aware method (cluster) without calibration data is refused, whichever path converts."""
    if method.needs_calibration and not calibration:
        raise UpcycleError(f"method {method.name!r} needs calibration data: pass --calibration FILE (text, JSONL "
                           f"with a \"text\" field, or .safetensors of model inputs) representative of the data "
                           f"the model will be trained on; on the default model the embedded Wikipedia train split "
                           f"is used")


def check_sources(s: SourcesConfig, num_experts: int, method: Method, streaming: bool | str) -> None:
    """What a merge of several sources (`merge.py`) needs beyond its keys' own ranges."""
    counts = [e.count for e in s.experts]
    if sum(counts) != num_experts:
        raise UpcycleError(f"moe.num_experts must be {sum(counts)}, the experts the sources make (counts {counts}), "
                           f"got {num_experts}")
    for i, e in enumerate(s.experts):
        where = f"sources.experts[{i}] ({e.model})"
        for key in ("data", "eval_data"):
            if getattr(e, key) is not None and (problem := file_problem(getattr(e, key))):
                raise UpcycleError(f"{where}: {key} {getattr(e, key)}: {problem}")
        if s.router == "data" and e.data is None:
            raise UpcycleError(f"{where}: sources.router data needs each source's text (data: FILE)")
        if s.router == "prompts" and not e.prompts:
            raise UpcycleError(f"{where}: sources.router prompts needs each source's prompts (prompts: [...])")
        if method.needs_calibration and e.count > 1 and e.data is None:
            raise UpcycleError(f"{where}: method {method.name!r} needs the source's text (data: FILE)")
    if streaming is False:
        raise UpcycleError("a several-source merge always streams (one block of one model in memory); "
                           "streaming: false is not available for it")
