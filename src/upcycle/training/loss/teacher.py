"""The EMA teacher of Expert-Ensemble Self-Distillation (EESD; Cluster-aware Upcycling, docs/methods.md §4.6).

The teacher is a float32 exponential moving average of every MoE layer (router, routed and shared experts):
theta_ema <- beta theta_ema + (1 - beta) theta, applied after each optimizer step as one fused
`torch._foreach_lerp_` over all parameters. For each MoE layer, on the same input x the student layer sees,
the teacher runs all experts densely under no-grad: y_ens(x) = sum_i g_i^ema(x) E_i^ema(x) (+ its shared
experts, so that a student with top-k = E matches it exactly), with the EMA router's full softmax. Each layer's
loss `losses.eesd` = (1/T) sum_x ||sg(y_ens(x)) - y_moe(x)||^2 over real tokens; `loss()` averages the layers.

Under FSDP (`upcycle.training.parallel.sharding`) the student's parameters are shards, and so are the teacher's:
each process keeps the float32 EMA of its own part (the update needs no communication), and a layer's teacher is
gathered whole only while it runs, one layer at a time.

Beyond the paper (cheap): `uncertain_fraction` < 1 runs the teacher only on that fraction of each layer's real
tokens with the highest routing entropy under the student's router (where a top-k choice discards the most of
the ensemble), and averages the loss over those tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ...core.hooks import HookHolder
from ...core.moe import MoELayer, moe_layers
from ...core.router import token_entropy
from ...core.routing_context import ROUTING
from ..parallel.sharding import is_dtensor, local, shard_of, whole
from .losses import eesd


def ensemble_output(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """sum_i softmax(router(x))_i E_i(x) (+ shared experts): the layer's dense all-expert ensemble."""
    probs_TE = layer.router.dense_weights(x_TD)     # full softmax (or normalized sigmoid affinities), float32
    x = x_TD.to(layer.experts.dtype)
    y_TD = layer.experts.forward_dense(x, probs_TE)      # combine weights stay float32 (the kernel's rule)
    if layer.shared_experts is not None:
        y_TD = y_TD + layer.shared_experts.forward_dense(x)
    return y_TD


class EMATeacher(HookHolder):
    """EMA copies of a model's MoE layers; while `enabled`, each student MoE layer's training forward leaves the
    teacher's target in `self.pending`, from which `loss()` computes the EESD losses, averages and clears them."""

    def __init__(self, model: nn.Module, beta: float = 0.999, *, uncertain_fraction: float = 1.0) -> None:
        if not 0 <= beta < 1:
            raise ValueError(f"EESD: beta must be in [0, 1), got {beta}")
        if not 0 < uncertain_fraction <= 1:
            raise ValueError(f"EESD: uncertain_fraction must be in (0, 1], got {uncertain_fraction}")
        self.beta, self.uncertain_fraction = beta, uncertain_fraction
        self.students = moe_layers(model)
        if not self.students:
            raise ValueError("EESD: the model has no MoE layers")
        self.sharded = any(is_dtensor(p) for p in model.parameters())
        self.specs = {name: layer.spec() for name, layer in self.students.items()}
        self.teachers: dict[str, MoELayer] = {}
        for name, layer in self.students.items():
            if self.sharded:
                teacher = _sharded_copy(layer, self.specs[name])
            else:
                with torch.device(layer.router.weight.device):     # made there (a .to() would copy it again)
                    teacher = MoELayer.from_spec(self.specs[name], dtype=torch.float32)
                teacher.load_state_dict(layer.state_dict())
            teacher.requires_grad_(False).eval()
            teacher.record_routing = False
            self.teachers[name] = teacher
        self._student_params = [p for layer in self.students.values() for p in layer.parameters()]
        self._teacher_params = [p for layer in self.teachers.values() for p in layer.parameters()]
        self.enabled = True
        # per layer, what each training forward left for its loss: (student output, its real positions, the rows
        # distilled, the padding mask, the teacher's target, the token weight)
        self.pending: dict[str, list[tuple]] = {}
        self.tokens_distilled = 0
        self._handles = [layer.register_forward_hook(self._hook(name)) for name, layer in self.students.items()]

    @torch.no_grad()
    def update(self) -> None:
        """theta_ema <- beta theta_ema + (1 - beta) theta, for every MoE parameter at once."""
        src = [local(p.detach()) if p.dtype == torch.float32 else local(p.detach()).float()
               for p in self._student_params]
        torch._foreach_lerp_([local(p) for p in self._teacher_params], src, 1.0 - self.beta)

    def _whole(self, name: str) -> MoELayer:
        """Layer `name`'s teacher, gathered whole if it is sharded (every process must call it, in step)."""
        teacher = self.teachers[name]
        if not self.sharded:
            return teacher
        with torch.device("meta"):
            layer = MoELayer.from_spec(self.specs[name], dtype=torch.float32)
        layer.load_state_dict({k: whole(v) for k, v in teacher.state_dict().items()}, assign=True)
        layer.requires_grad_(False).eval()
        layer.record_routing = False
        return layer

    def _select(self, layer: MoELayer, T: int) -> torch.Tensor | None:
        """Indices of the tokens the teacher runs on (None: all tokens, padding weighted out of the loss, so that
        no data-dependent shape needs a host sync; the uncertain-token choice reads its count once)."""
        record = layer.last_record
        real_T = record.mask_T if record is not None and record.mask_T is not None else None
        if self.uncertain_fraction >= 1:
            return None
        probs_TE = record.probs_TE.detach()
        entropy_T = token_entropy(probs_TE)
        if real_T is not None:
            entropy_T = entropy_T.masked_fill(~real_T, -math.inf)
        n_real = int(real_T.sum()) if real_T is not None else T
        keep = max(1, math.ceil(self.uncertain_fraction * n_real))
        return entropy_T.topk(keep).indices

    def _hook(self, name: str):
        def distill(layer: MoELayer, args, output):
            # a recomputation (activation checkpointing) repeats a forward whose teacher pass was already taken
            if not self.enabled or not layer.training or ROUTING.recomputing:
                return
            record = layer.last_record
            positions_T = record.positions_T if record is not None else None
            mask_T = record.mask_T if record is not None else None
            with torch.no_grad():
                x_TD = args[0].reshape(-1, args[0].shape[-1])
                if positions_T is not None:          # the layer ran the real tokens alone
                    x_TD = x_TD.index_select(0, positions_T)
                rows = self._select(layer, x_TD.shape[0])
                if rows is not None:
                    x_TD, mask_T = x_TD[rows], None
                target_TD = ensemble_output(self._whole(name), x_TD)
            # the student's side of the loss is computed in `loss()`, after the forward: inside a checkpointed
            # block, an op recorded here would have to be recomputed too
            weight = x_TD.shape[0] if mask_T is None else mask_T.sum()
            self.pending.setdefault(name, []).append((output, positions_T, rows, mask_T, target_TD, weight))
            self.tokens_distilled += x_TD.shape[0]
        return distill

    @staticmethod
    def _student_loss(output, positions_T, rows, mask_T, target_TD) -> torch.Tensor:
        y_TD = output.reshape(-1, output.shape[-1])
        if positions_T is not None:
            y_TD = y_TD.index_select(0, positions_T)
        if rows is not None:
            y_TD = y_TD[rows]
        return eesd(y_TD, target_TD, mask_T=mask_T)

    def loss(self) -> torch.Tensor:
        """Mean over MoE layers of the EESD losses of the forwards since the last call (then cleared); a layer's
        loss over several forwards is their token-weighted mean."""
        if not self.pending:
            return torch.zeros((), device=self._teacher_params[0].device)
        per_layer = []
        for parts in self.pending.values():
            losses = [self._student_loss(*part[:5]) for part in parts]
            if len(parts) == 1:
                per_layer.append(losses[0])
                continue
            # an int weight becomes a filled tensor, not a copy from the host (which would wait for the device)
            weights = torch.stack([w.float() if torch.is_tensor(w) else torch.full((), float(w), device=loss.device)
                                   for loss, (*_, w) in zip(losses, parts, strict=True)])
            per_layer.append((torch.stack(losses) * weights).sum() / weights.sum().clamp_min(1))
        total = torch.stack(per_layer).mean()
        self.pending = {}
        return total

    def to(self, device: torch.device) -> EMATeacher:
        """Move the teacher where the student went (Accelerate's `prepare` moves the model after this was built)."""
        for teacher in self.teachers.values():
            teacher.to(device)       # in place: `_teacher_params` stay the teacher's parameters
        return self

    def state_dict(self) -> dict:
        return {"beta": self.beta, "uncertain_fraction": self.uncertain_fraction,
                "teachers": {name: t.state_dict() for name, t in self.teachers.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Load whole tensors (a checkpoint's); a sharded teacher keeps its own part of each."""
        for name, teacher in self.teachers.items():
            if not self.sharded:
                teacher.load_state_dict(state["teachers"][name])
                continue
            given, targets = state["teachers"][name], teacher.state_dict(keep_vars=True)
            if set(given) != set(targets):
                raise RuntimeError(f"EESD teacher {name}: the state has {sorted(set(given) ^ set(targets))[:3]} "
                                   "that the layer does not, or lacks them")
            with torch.no_grad():
                for key, t in targets.items():
                    local(t).copy_(shard_of(given[key], t))


def _sharded_copy(layer: MoELayer, spec: dict) -> MoELayer:
    """A float32 copy of a sharded student layer, sharded the same way: each process copies its own part."""
    with torch.device("meta"):
        teacher = MoELayer.from_spec(spec, dtype=torch.float32)
    for name, p in layer.named_parameters():
        owner, _, leaf = name.rpartition(".")
        teacher.get_submodule(owner)._parameters[leaf] = nn.Parameter(p.detach().to(torch.float32, copy=True),
                                                                       requires_grad=False)
    for name, b in layer.named_buffers():
        owner, _, leaf = name.rpartition(".")
        module = teacher.get_submodule(owner)
        module._buffers[leaf] = b.detach().to(module._buffers[leaf].dtype, copy=True)
    return teacher
