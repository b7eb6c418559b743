"""A model config's sizes checked before transformers builds anything from them: whole numbers no real model
exceeds (`SIZE_LIMITS`), and the numbers a layer divides by or takes a root of (a norm's epsilon, RoPE's base)
finite and positive. Read from config.json's mapping (of a dense folder, or an upcycle folder's `base_config`) or a
transformers config, in every sub-config (CLIP's text and vision configs)."""

from __future__ import annotations

import math

from ..errors import UpcycleError

# Upper bounds on a config's sizes, far above any real model (Llama 3 405B: 126 blocks, hidden 16,384, FFN 53,248,
# vocabulary 128,256): a number past them is a typo or a hostile file, refused before a tensor is planned.
SIZE_LIMITS = {"num_hidden_layers": 4096, "n_layer": 4096, "hidden_size": 2**18, "n_embd": 2**18,
               "intermediate_size": 2**20, "n_inner": 2**20, "vocab_size": 2**24, "num_attention_heads": 2**14,
               "n_head": 2**14, "num_key_value_heads": 2**14, "head_dim": 2**16,
               "max_position_embeddings": 2**26, "n_positions": 2**26, "image_size": 2**16, "patch_size": 2**16,
               "num_channels": 2**10, "projection_dim": 2**18, "type_vocab_size": 2**16}


# Numbers a layer adds under a square root or raises to a power: finite and positive (an epsilon of -1 or NaN gave
# every norm NaN, reported later as "differs by nan > allowed nan")
POSITIVE_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "rope_theta")


# special token ids: carried into every output, so one that is no id is refused rather than copied
TOKEN_KEYS = ("pad_token_id", "bos_token_id", "eos_token_id")


def check_config_sizes(config, name: str) -> None:
    """Refuse a config whose sizes no real model has (SIZE_LIMITS), or that are not positive, and a norm epsilon or
    RoPE base that is not a finite positive number (POSITIVE_NUMBERS), and a special token id below -1 or not a
    whole number (TOKEN_KEYS), in any sub-config. `config`: a transformers
    config, or config.json's mapping as read (checked before transformers builds its config, which divides by some
    of these: zero heads was a modulo by zero)."""
    def walk(cfg, where: str) -> None:
        items = cfg.items() if isinstance(cfg, dict) else vars(cfg).items()
        for key, value in items:
            if isinstance(value, dict) or (hasattr(value, "to_dict") and hasattr(value, "model_type")):
                walk(value, f"{where}{key}.")                                    # a sub-config
            elif key in SIZE_LIMITS and value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= SIZE_LIMITS[key]:
                    raise UpcycleError(f"model {name!r}: config.json's {where}{key} is {value!r}; upcycle takes "
                                       f"whole numbers from 1 to {SIZE_LIMITS[key]:,}")
            elif key in TOKEN_KEYS and value is not None:
                # an id past the vocabulary is left to the tokenizer's check (tiny test configs keep GPT-2's 50256)
                ids = value if isinstance(value, list) else [value]
                if any(isinstance(i, bool) or not isinstance(i, int) or i < -1 for i in ids):
                    raise UpcycleError(f"model {name!r}: config.json's {where}{key} is {value!r}; it is a token id, "
                                       f"0 or more (or -1 or null for none)")
            elif key in POSITIVE_NUMBERS and value is not None:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                        or value <= 0:
                    raise UpcycleError(f"model {name!r}: config.json's {where}{key} is {value!r}; it must be a "
                                       f"finite number above 0")
    walk(config, "")
