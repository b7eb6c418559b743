"""Which task a model trains and is evaluated on, decided once for `upcycle train` and `upcycle eval`: the
contrastive pair task for text encoders (the BERT family), CLIP's for CLIP models (its architecture row names it),
next-token prediction for causal LMs; anything else is refused rather than trained on a task that means nothing
for it."""

from __future__ import annotations

from torch import nn

from ..core.architectures import find_family
from ..errors import UpcycleError

_UNSET = object()


def model_task(model: nn.Module, requested: str | None = None) -> str:
    """"contrastive", "clip" or "causal_lm" for this model; `requested` (the config's `task`) must fit it. The
    model's family is looked up once, here, and handed to each question below."""
    family = find_family(model.config)      # None for stock MoE checkpoints: decoders
    if uses_contrastive(model, requested, family=family):
        return "contrastive"
    return task_of(model, requested, family=family)


def is_causal_lm(model: nn.Module, *, family=_UNSET) -> bool:
    """Whether the model predicts the next token: a class of transformers' causal-LM table, and for families that
    attend both ways (BERT's LM-head class; `bidirectional` in the architecture table) only when configured as a
    decoder, since otherwise `labels = input_ids` would be an identity task. `family`: the model's row, when the
    caller has it (None: none)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    if type(model).__name__ not in names:
        return False
    family = find_family(model.config) if family is _UNSET else family
    return family is None or not family.bidirectional or bool(getattr(model.config, "is_decoder", False))


def task_of(model: nn.Module, requested: str | None = None, *, family=_UNSET) -> str:
    """The task a model trains on: the one its architecture row names for its type (CLIP models: contrastive),
    else next tokens for causal LMs; anything else (a BERT encoder, a masked-LM head) is refused rather than
    trained on a task that means nothing for it."""
    family = find_family(model.config) if family is _UNSET else family
    kind = family.task_of(model.config) if family is not None else None
    if kind is None and is_causal_lm(model, family=family):
        kind = "causal_lm"
    if kind is None:
        raise UpcycleError(f"{type(model).__name__} ({model.config.model_type}) is not a causal language model or "
                           f"CLIP: `upcycle train` and `upcycle eval` know next-token prediction and CLIP's "
                           f"contrastive task; masked-LM training and pseudo-perplexity are not implemented, and "
                           f"next-token training of an encoder that sees the whole sequence would be meaningless")
    if requested is not None and requested != kind:
        raise UpcycleError(f"task {requested!r} does not fit a {type(model).__name__} (its task is {kind!r})")
    return kind


def is_encoder(model: nn.Module, *, family=_UNSET) -> bool:
    """A model that attends both ways and predicts no next token (BERT's family, any head but a decoder's)."""
    family = find_family(model.config) if family is _UNSET else family
    return family is not None and family.bidirectional and not is_causal_lm(model, family=family)


def uses_contrastive(model: nn.Module, requested: str | None, *, family=_UNSET) -> bool:
    """Whether the model trains (and evaluates) on this task: asked for, or not asked for and an encoder (the
    only task upcycle has for encoders). Asked for on a model that is not an encoder, it is refused."""
    family = find_family(model.config) if family is _UNSET else family
    if requested == "contrastive":
        if not is_encoder(model, family=family):
            raise UpcycleError(f"task 'contrastive' trains a text encoder (the BERT family); {type(model).__name__} "
                               f"({model.config.model_type}) is not one" +
                               (" (CLIP's own contrastive task is 'clip')" if family is not None
                                and family.name == "clip" else ""))
        return True
    return requested is None and is_encoder(model, family=family)
