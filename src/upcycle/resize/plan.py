"""`upcycle prune --dry-run` and `upcycle grow --dry-run`: what a prune or a grow would write, from the folder's
config and checkpoint headers alone (no weight is read, nothing is written, OUT is not claimed).

Per MoE layer the expert count before and after; for the whole folder the parameters and the bytes on disk before
and after, where every tensor a resize indexes by expert (an upcycle layer's experts, router rows and biases and
selection bias; a stock block's router rows and stacked experts: what `streamed.write_resized` and
`expert_count._select_stock` change; per-expert tensors as transformers 5 saves Mixtral) scales by N / E and every
other tensor stays. The figures are exact for the tensors written (tested against the folders the
commands then write); the files add their headers and the tokenizer. The peak memory is estimated from the same
sizes: the process itself (as `convert --dry-run` counts it), then in memory the larger of the model before and after
plus one rebuilt layer, streamed one layer twice over; a run whose estimate exceeds the machine's memory is refused
before anything is built (`check_fits`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from ..checkpoint.reader import CheckpointReader
from ..checkpoint.upcycle_format import MOE_CONFIG
from ..config import CalibrationConfig
from ..core.grouped_ffn import CPU_MEMORY
from ..core.moe import moe_layers
from ..errors import UpcycleError
from ..files import read_json_file
from ..machine import PROCESS_BYTES
from ..outputs.claims import Input
from ..outputs.job import NEW_OUTPUT, Claiming
from .expert_count import ExpertCount


@dataclass(frozen=True)
class ResizePlan:
    """What a prune or a grow of `model` would write."""

    model: str
    kind: str                                   # "prune" or "grow"
    request: ExpertCount
    layers: dict[str, tuple[int, int]]          # MoE layer -> (experts now, experts after)
    parameters: tuple[int, int]                 # before, after
    bytes_on_disk: tuple[int, int]              # before, after
    streaming: bool
    peak_bytes: int                             # the run's estimated peak memory (`plan_resize`)
    budget: CalibrationConfig | None = None     # the calibration text and its budget (`run.make_resize_plan`)
    given: list[Input] = field(default_factory=list)     # what OUT must never be
    claiming: ClassVar[Claiming] = NEW_OUTPUT

    def summary(self) -> dict:
        """The decisions as plain values."""
        return {"kind": self.kind, "model": self.model, "request": asdict(self.request),
                "layers": {name: list(counts) for name, counts in self.layers.items()},
                "parameters": list(self.parameters), "bytes_on_disk": list(self.bytes_on_disk),
                "streaming": self.streaming, "estimated_peak_bytes": self.peak_bytes}

    def describe(self) -> str:
        (p0, p1), (b0, b1) = self.parameters, self.bytes_on_disk
        counts = sorted({f"{e} -> {n}" for e, n in self.layers.values()})
        how = (f"--add {self.request.add}" if self.request.add is not None else
               f"--by {self.request.by}" + (f", --perturb {self.request.perturb}" if self.kind == "grow" else ""))
        route = "a block at a time (--streaming)" if self.streaming else "in memory (the whole model loaded)"
        return "\n".join([
            f"{self.kind} plan for {self.model} ({how}), nothing written",
            f"  MoE layers           {len(self.layers)}, experts {', '.join(counts)}",
            f"  parameters           {p0 / 1e9:.3f} B -> {p1 / 1e9:.3f} B",
            f"  weights on disk      {b0 / 1e9:.3f} GB -> {b1 / 1e9:.3f} GB",
            f"  estimated peak       {self.peak_bytes / 1e9:.3f} GB of memory (this machine: "
            f"{CPU_MEMORY / 1e9:.1f} GB)",
            f"  runs                 {route}"])


def plan_resize(model: str, request: ExpertCount, *, grow: bool, streaming: bool) -> ResizePlan:
    """The plan of a checked request (`run.check` first): the folder's MoE layers from a skeleton built of its
    config on the meta device (an upcycle folder) or from its tensor names and config (a stock one), sizes from
    its safetensors headers."""
    folder = Path(model)
    reader = CheckpointReader(folder, check_values=False)
    names = reader.names()
    owner = _upcycle_owner(folder) if (folder / MOE_CONFIG).is_file() else _stock_owner(folder, reader)
    layers: dict[str, tuple[int, int]] = {}
    owned: dict[str, tuple[int, int]] = {}          # layer -> parameters, bytes of the tensors its experts own
    before, after = [0, 0], [0, 0]                  # parameters, bytes
    for name in names:
        count = _numel(reader.shape(name))
        nbytes = count * reader.dtype(name).itemsize
        before[0], before[1] = before[0] + count, before[1] + nbytes
        group = owner(name)
        if group is None:
            after[0], after[1] = after[0] + count, after[1] + nbytes
            continue
        layer, E = group
        layers[layer] = (E, E + 1 if request.add is not None else request.num_experts)
        owned[layer] = (owned.get(layer, (0, 0))[0] + count, owned.get(layer, (0, 0))[1] + nbytes)
    # what a layer's experts own (rows [E, ...], or E per-expert tensors of one size) scales by N / E, exactly
    largest = 0
    for layer, (count, nbytes) in owned.items():
        E, N = layers[layer]
        after[0] += count * N // E
        after[1] += nbytes * N // E
        largest = max(largest, nbytes * max(E, N) // E)
    # in memory the model is loaded whole and each layer rebuilt beside it; streamed, a layer as read and as
    # written (its experts together when perturbed)
    held = 2 * largest if streaming else max(before[1], after[1]) + largest
    return ResizePlan(model, "grow" if grow else "prune", request, layers, (before[0], after[0]),
                      (before[1], after[1]), streaming, PROCESS_BYTES + held)


def check_fits(plan: ResizePlan) -> None:
    """Refuse a prune or a grow whose estimated peak exceeds this machine's memory, before anything is built."""
    if plan.peak_bytes > CPU_MEMORY:
        counts = sorted({n for _, n in plan.layers.values()})
        raise UpcycleError(f"{plan.kind} to {', '.join(map(str, counts))} experts needs an estimated "
                           f"{plan.peak_bytes / 1e9:.1f} GB at its peak, more than this machine's "
                           f"{CPU_MEMORY / 1e9:.1f} GB of memory (the plan without OUT: --dry-run)")


def _upcycle_owner(folder: Path) -> Callable[[str], tuple[str, int] | None]:
    """Tensor name -> (its MoE layer, the layer's expert count) for every tensor a resize indexes by expert: an
    upcycle MoE layer's own tensors (its shared experts left out); None for the rest."""
    from .streamed import open_folder

    skeleton = open_folder(folder).model
    owned = {f"{name}.{key}": (name, layer.num_experts) for name, layer in moe_layers(skeleton).items()
             for key in layer.state_dict(keep_vars=True) if not key.startswith("shared_experts.")}
    return owned.get


PER_EXPERT = re.compile(r"^(?P<layer>.+)\.experts\.\d+\.")           # transformers 5 saves Mixtral's experts so
STACKED = re.compile(r"^(?P<layer>.+)\.(?:experts\.[^.]+|gate\.(?:weight|bias)|experts\.[^.]+\.(?:weight|bias))$")


def _stock_owner(folder: Path, reader: CheckpointReader) -> Callable[[str], tuple[str, int] | None]:
    """The same for a stock MoE folder, from its tensor names as saved: a block's router rows (`gate.weight`,
    [E, D]) and stacked experts ([E, ...]), or its per-expert tensors (`experts.<i>.`, as transformers 5 writes
    Mixtral); a shared expert and its gate are no expert's."""
    config = read_json_file(folder / "config.json", "config.json")
    E = next((config[k] for k in ("num_local_experts", "num_experts") if isinstance(config.get(k), int)), None)
    if E is None:
        raise UpcycleError(f"{folder}: config.json names no expert count (num_local_experts or num_experts)")

    def owner(name: str) -> tuple[str, int] | None:
        if match := PER_EXPERT.match(name):
            return match["layer"], E
        if (match := STACKED.match(name)) and reader.shape(name)[:1] == (E,):
            return match["layer"], E
        return None
    return owner


def _numel(shape) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count
