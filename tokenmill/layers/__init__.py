"""Model building blocks. The names below are torch-free so the CLI can offer them without loading torch."""

# KV cache element types (see layers/kv_cache.py): "auto" = the model's dtype.
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16", "int8")
