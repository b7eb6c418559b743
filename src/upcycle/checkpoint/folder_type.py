"""The model type in an upcycle folder's config.json (format version 2; `upcycle_format.py` says why), read by the
format and by the transformers Auto classes registered for it, without importing either."""

FOLDER_MODEL_TYPE = "upcycle"
