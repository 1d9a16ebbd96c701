"""The catalog: what every floor reads about a model, importing no runtime.

Family specs (`spec.py`) and the one lazy registry (`registry.py`), the size rules checked before queuing
(`shapes.py`), model resolution (`resolution.py`), the tiny checkpoints (`tiny.py`) and the stage-edge
contract (`edges.py`). The model code that implements a family lives in `vllm_omni/models/<family>/`.
"""
