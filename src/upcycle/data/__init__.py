"""Demo data that installs offline: the embedded models and Wikipedia text, causal-LM batch packing, the digits
image-caption pairs and a tiny CLIP. Apart from the MoE code: nothing here knows about experts."""
