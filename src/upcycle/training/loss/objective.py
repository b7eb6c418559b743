"""The training objective: task loss + weighted router regularizers + EESD.

    L = L_task + sum_r lambda_r mean_layers L_r(routing record of the layer) + lambda_EESD L_EESD

Router losses are read from each MoE layer's `last_record` (docs/design.md principle 3: no model forward is
rewritten); coefficients come from `RegularizerConfig` (docs/methods.md §3 gives each paper's values). The stateful
parts, the EMA teacher (EESD) and the aux-free selection bias, are updated after the optimizer step
(`after_optimizer_step`). The one training step that uses this objective is `upcycle.training.step.train_step`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ...config import RegularizerConfig
from ...core.moe import moe_layers
from ...core.router import RoutingRecord
from ...core.stock_moe import StockRouting, is_stock_moe
from ...errors import UpcycleError
from . import losses
from .balance import AuxFreeBalancer
from .dpsl import dpsl
from .teacher import EMATeacher


def _groups_for(record: RoutingRecord, groups: torch.Tensor | None) -> torch.Tensor | None:
    """Token groups flattened to the layer's tokens (a layer of another tower, with another T, gets none)."""
    if groups is None:
        return None
    flat = groups.reshape(-1)
    if record.positions_T is not None:       # the layer routed the batch's real tokens alone
        return flat.to(record.positions_T.device).index_select(0, record.positions_T)
    return flat if flat.numel() == record.logits_TE.shape[0] else None


def routing_records(model: nn.Module) -> dict[str, RoutingRecord | None]:
    """The latest routing record of each of upcycle's MoE layers, by layer name."""
    return {name: layer.last_record for name, layer in moe_layers(model).items()}


# The router regularizers (docs/methods.md §4), one row each: (name = the RegularizerConfig coefficient key, the
# pure loss of one layer's routing record, its mask and token groups). A new router loss is one row here and one
# key there.
RouterLoss = Callable[[RoutingRecord, torch.Tensor | None, torch.Tensor | None, RegularizerConfig], torch.Tensor]
ROUTER_LOSSES: tuple[tuple[str, RouterLoss], ...] = (
    # balance_logits: softmax of these = the router's probabilities (sigmoid routers' normalized affinities too)
    ("load_balance", lambda r, mask, g, cfg: losses.load_balance(r.balance_logits_TE, r.topk_ids_TK, mask_T=mask,
                                                                 groups_T=g)),
    ("z_loss", lambda r, mask, g, cfg: losses.z_loss(r.logits_TE, mask_T=mask, groups_T=g)),
    ("limoe_local", lambda r, mask, g, cfg: losses.limoe_local(r.balance_logits_TE, mask_T=mask, groups_T=g)),
    ("limoe_global", lambda r, mask, g, cfg: losses.limoe_global(r.balance_logits_TE, m=cfg.limoe_m, mask_T=mask,
                                                                 groups_T=g)),
    ("dpsl", lambda r, mask, g, cfg: dpsl(r.probs_TE, cfg.dpsl_alpha, groups=g, mask=mask)),
)


def router_losses(model: nn.Module, cfg: RegularizerConfig, *, groups: torch.Tensor | None = None,
                  records: dict[str, RoutingRecord | None] | None = None) -> dict[str, torch.Tensor]:
    """Each enabled router loss (a non-zero coefficient), averaged over the MoE layers' latest routing records
    (unweighted); `records` replaces the model's own layers' (a stock MoE class's routers, `upcycle.core.stock_moe`)."""
    enabled = [(name, fn) for name, fn in ROUTER_LOSSES if getattr(cfg, name)]
    terms: dict[str, list[torch.Tensor]] = {}
    for record in (routing_records(model) if records is None else records).values():
        if record is None:
            continue
        g = _groups_for(record, groups)
        for name, fn in enabled:
            terms.setdefault(name, []).append(fn(record, record.mask_T, g, cfg))
    return {name: torch.stack(values).mean() for name, values in terms.items()}


class Objective:
    """The training objective of one model: task loss + the weighted router regularizers + EESD. Holds the
    stateful parts the config asks for (the EMA teacher, the aux-free balancer) next to the model."""

    def __init__(self, model: nn.Module, cfg: RegularizerConfig) -> None:
        self.model, self.cfg = model, cfg
        self.stock = None
        if is_stock_moe(model):
            if cfg.eesd or cfg.aux_free_rate:
                raise UpcycleError(f"EESD and aux-free balancing need upcycle's MoE layers; {type(model).__name__} "
                                   "is a stock class: train the upcycle-format folder instead, then export it")
            self.stock = StockRouting(model)
        self.teacher = (EMATeacher(model, cfg.eesd_beta, uncertain_fraction=cfg.eesd_uncertain_fraction)
                        if cfg.eesd else None)
        self.balancer = AuxFreeBalancer(model, cfg.aux_free_rate) if cfg.aux_free_rate else None

    def loss(self, task_loss: torch.Tensor, *, groups: torch.Tensor | None = None, router: bool = True,
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total loss, each term's unweighted value as a detached tensor, read by the step once it is done, so the
        backward is not held up by a copy to the host) after a forward pass; `router=False` leaves the router
        losses out (after the warm-up phase of `cfg.router_until`)."""
        records = self.records() if self.stock is not None else None
        terms = router_losses(self.model, self.cfg, groups=groups, records=records) if router else {}
        if self.teacher is not None:
            terms["eesd"] = self.teacher.loss()
        total = task_loss
        for name, value in terms.items():
            total = total + getattr(self.cfg, name) * value
        logged = {"task": task_loss.detach(), **{k: v.detach() for k, v in terms.items()}, "total": total.detach()}
        return total, logged

    def records(self) -> dict[str, RoutingRecord | None]:
        """The latest routing record of every MoE layer (upcycle's, or a stock class's routers)."""
        return dict(self.stock.records) if self.stock is not None else routing_records(self.model)

    def to(self, device: torch.device) -> Objective:
        """The teacher and the balancer's counts on `device`, where `prepare` put the model."""
        for part in (self.teacher, self.balancer):
            if part is not None:
                part.to(device)
        return self

    def after_optimizer_step(self) -> None:
        if self.teacher is not None:
            self.teacher.update()
        if self.balancer is not None:
            self.balancer.step()


