"""Cache acceleration with request-scoped quality (docs/cache.md): policies resolved per request
(`policy.py`, no torch), per-request state kept in the request's `DenoiseState` (`state.py`), the glue native
pipelines call (`runtime.py`) and the cache-dit backend (`cachedit.py`)."""
