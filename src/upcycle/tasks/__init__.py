"""What a model trains and is evaluated on, apart from how the loop runs (`upcycle.training`): each task turns a
model and a data source into batches, a task loss and an evaluation, and `analyze` and `compare` use the same
tasks for their held-out inputs.

- causal_lm (`causal_lm.py`): next-token cross-entropy on packed documents, padding masked; held-out perplexity.
- clip (`clip.py`): CLIP's symmetric InfoNCE over image-caption pairs; zero-shot classification and retrieval.
- contrastive (`contrastive.py`): text encoders (BERT family) on query-document pairs, symmetric in-batch InfoNCE
  of mean-pooled embeddings (`embedding.py`); evaluated by retrieval (`retrieval.py`).

`kind.py` decides which task a model has, `make.py` builds it, `evaluate.py` holds the evaluations `upcycle eval`
runs.
"""
