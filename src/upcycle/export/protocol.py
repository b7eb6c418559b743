"""What a stock transformers MoE class says about itself to be an export target.

An export writes an upcycled decoder as a class transformers loads with no custom code (docs/design.md principle 7,
docs/methods.md §2.8). Most of the layout is common to every such class (`layout.py`: the dense tensors as they are,
the router as `gate.weight`, each expert's three projections under its index, the config keys both majors read);
a class says what differs: its names, the source model types whose function it computes, what it cannot express,
its config keys, and tensors it needs beside the experts. One module per class (`qwen2_moe.py`, ...), listed in
`registry.py`: a new class is one file and one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:     # annotations only: the registry loads without torch (the CLI lists the classes)
    import torch
    from torch import nn


@dataclass(frozen=True)
class StockClass:
    name: str                         # the export_class a recipe names
    architecture: str                 # the transformers class, e.g. "Qwen2MoeForCausalLM"
    config_class: str                 # its config class, e.g. "Qwen2MoeConfig"
    sources: tuple[str, ...]          # the dense model types whose function it computes
    expert_keys: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")   # an expert's gate, up, down
    shared_experts: bool = False      # the class has a shared expert in every MoE block
    every_block: bool = False         # every block must be MoE (no dense blocks between)
    always_renormalizes: bool = False  # top-k weights always renormalized (no raw-weight option)
    model_type: str = ""              # the config.json model_type written (default: `name`)
    untied_head: bool = False         # the LM head written as its own tensor even when the source ties it
    # how llama.cpp reads the class: its arch (what convert_hf_to_gguf.py and upcycle's GGUF writer write), and
    # whether that arch's graph renormalizes the top-k weights whatever the config says (qwen2moe never does)
    llama_cpp_arch: str = ""
    llama_cpp_renormalizes: bool = True

    def __post_init__(self) -> None:
        if not self.model_type:
            object.__setattr__(self, "model_type", self.name)

    def block_prefix(self, layer_name: str) -> str:
        """The MoE block's key prefix for our layer at `layer_name` (model.layers.3.mlp)."""
        return layer_name

    def layer_problems(self, layer) -> list[str]:
        """What this class cannot express about one MoE layer, beyond what no stock class can (`layout.py`)."""
        problems = []
        if layer.shared_experts is not None and not self.shared_experts:
            problems.append(f"shared experts ({self.name} has none)")
        if self.always_renormalizes and not layer.normalize_topk:
            problems.append(f"raw top-k weights ({self.name} always renormalizes)")
        return problems

    def config_keys(self, model: nn.Module, moe_blocks: dict[int, nn.Module], source: dict) -> dict:
        """The class's own config keys (on top of the common ones), from the upcycled model."""
        return {}

    def block_tensors(self, model: nn.Module, layer_name: str, layer) -> tuple[dict[str, torch.Tensor], list[dict]]:
        """Tensors an MoE block needs beside the router and the experts, and the scales folded into them."""
        return {}, []

    def model_tensors(self, model: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
        """Tensors outside the MoE blocks the class needs and the source lacks (zeros), under `prefix`."""
        return {}


def export_entry(stock: StockClass | None, why_not_hf: str | None = None, *, runtimes_note: str | None = None,
                 **facts) -> dict:
    """A conversion report's `export` entry, the one place it is made: the upcycle format (with why no stock class
    fitted, when `export: hf` found none) or the stock class written, and what the writing path adds (whether it
    streamed, the files, how the stock folder was checked). `runtimes_note` (`layout.runtimes_note`): what a
    recommended runtime reads otherwise than transformers, said on stderr too."""
    if stock is None:
        return {"format": "upcycle", **facts} | ({"why_not_hf": why_not_hf} if why_not_hf else {})
    if runtimes_note:
        import sys

        from tqdm.auto import tqdm

        tqdm.write(f"[upcycle] note: {runtimes_note}", file=sys.stderr)
    return {"format": "hf", "class": stock.architecture, "model_type": stock.model_type, **facts} | \
        ({"runtimes_note": runtimes_note} if runtimes_note else {})
