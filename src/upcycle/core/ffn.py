"""Canonical feed-forward weights, independent of any model class (docs/design.md principle 1).

Every architecture adapter extracts its FFN into `FFNWeights`, every method maps `FFNWeights` to expert
weights, and the MoE layer is built from them. Two FFN forms (docs/methods.md §1):

  plain MLP (CLIP, ViT, BERT, GPT-2):   FFN(x) = W_down act(W_up x + b_up) + b_down
  gated MLP (Llama, Qwen, Mistral):      FFN(x) = W_down( act(W_gate x + b_gate) * (W_up x + b_up) ) + b_down

Shape suffixes: D model width, F intermediate width, E experts. A single FFN holds `w_up_FD`-shaped tensors,
a stack of experts the same tensors with a leading E (`w_up_EFD`). Weights use `nn.Linear` layout
(out_features, in_features) whatever the source stored (GPT-2's Conv1D is transposed on extraction).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from transformers.activations import ACT2FN

TENSOR_FIELDS = ("w_up", "w_gate", "w_down", "b_up", "b_gate", "b_down")


def activation_fn(name: str):
    """The exact activation module transformers uses for `name` (so experts match the source bit for bit)."""
    if name not in ACT2FN:
        raise ValueError(f"unknown activation {name!r}; transformers knows {sorted(ACT2FN)}")
    return ACT2FN[name]


@dataclass(frozen=True)
class FFNWeights:
    """One FFN (`w_up` [F, D]) or a stack of E FFNs (`w_up` [E, F, D]); gate and biases optional."""

    w_up: torch.Tensor
    w_down: torch.Tensor
    activation: str
    w_gate: torch.Tensor | None = None
    b_up: torch.Tensor | None = None
    b_gate: torch.Tensor | None = None
    b_down: torch.Tensor | None = None

    def __post_init__(self) -> None:
        f_in, d_in = self.w_up.shape[-2:]
        d_out, f_out = self.w_down.shape[-2:]
        if (f_in, d_in) != (f_out, d_out):
            raise ValueError(f"w_up {tuple(self.w_up.shape)} and w_down {tuple(self.w_down.shape)} disagree")
        if self.w_gate is not None and self.w_gate.shape != self.w_up.shape:
            raise ValueError(f"w_gate {tuple(self.w_gate.shape)} must match w_up {tuple(self.w_up.shape)}")
        if self.b_gate is not None and self.w_gate is None:
            raise ValueError("b_gate given without w_gate")

    @property
    def gated(self) -> bool:
        return self.w_gate is not None

    @property
    def hidden_size(self) -> int:
        return self.w_up.shape[-1]

    @property
    def intermediate_size(self) -> int:
        return self.w_up.shape[-2]

    @property
    def stacked(self) -> bool:
        return self.w_up.dim() == 3

    @property
    def num_experts(self) -> int:
        return self.w_up.shape[0] if self.stacked else 1

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors that are present, by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name in TENSOR_FIELDS and getattr(self, f.name) is not None}

    def map(self, fn) -> FFNWeights:
        """Apply `fn` to every present tensor (dtype casts, device moves, clones)."""
        return replace(self, **{k: fn(v) for k, v in self.tensors().items()})

    def expand(self, num_experts: int) -> FFNWeights:
        """`num_experts` identical experts as expanded views of this single FFN: no memory of their own (stride 0
        on the expert dimension). For experts that are only read: the MoE layer copies them into its own
        parameters. A method replaces the fields it changes and keeps the rest as views, where `repeat` would
        first copy every projection E times (1.6 GB of float32 for a 2B model's layer)."""
        if self.stacked:
            raise ValueError("expand() takes a single FFN, not a stack")
        return self.map(lambda t: t.unsqueeze(0).expand(num_experts, *t.shape))

    def repeat(self, num_experts: int) -> FFNWeights:
        """Stack `num_experts` identical copies of this single FFN: the copy-upcycling starting point."""
        if self.stacked:
            raise ValueError("repeat() takes a single FFN, not a stack")
        return self.map(lambda t: t.unsqueeze(0).repeat(num_experts, *([1] * t.dim())).contiguous())

    def __call__(self, x_TD: torch.Tensor) -> torch.Tensor:
        """Reference forward of a single FFN (used by checks and tests, not by the MoE layer's hot path)."""
        if self.stacked:
            raise ValueError("call a single FFN, or index the stack first")
        act = activation_fn(self.activation)
        h_TF = torch.nn.functional.linear(x_TD, self.w_up, self.b_up)
        if self.gated:
            h_TF = act(torch.nn.functional.linear(x_TD, self.w_gate, self.b_gate)) * h_TF
        else:
            h_TF = act(h_TF)
        return torch.nn.functional.linear(h_TF, self.w_down, self.b_down)

    def expert(self, i: int) -> FFNWeights:
        """Expert `i` of a stack, as a single FFN."""
        return self.map(lambda t: t[i])

    def num_params(self) -> int:
        """Parameters of one FFN (per expert for a stack)."""
        return sum(t[0].numel() if self.stacked else t.numel() for t in self.tensors().values())
