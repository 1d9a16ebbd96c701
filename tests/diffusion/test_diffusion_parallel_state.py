"""A single diffusion rank still gets a torch.distributed group and vLLM's model-parallel groups.

What it pins: after `init_diffusion_distributed` vLLM's ColumnParallelLinear/RowParallelLinear build and
run at TP=1 under the returned config, and the groups tear down cleanly.
"""

from __future__ import annotations

import torch

from vllm_omni.diffusion.data import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.parallel_state import destroy_diffusion_distributed, init_diffusion_distributed


def test_single_rank_groups_and_vllm_linear_layers():
    from vllm.config import set_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    config = init_diffusion_distributed(rank=0, world_size=1, parallel_config=DiffusionParallelConfig(),
                                        device=torch.device("cpu"))
    try:
        assert torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
        assert get_tensor_model_parallel_world_size() == 1 and get_tp_group().rank_in_group == 0
        with set_current_vllm_config(config):
            up = ColumnParallelLinear(32, 64, bias=False, params_dtype=torch.float32)
            down = RowParallelLinear(64, 32, bias=False, params_dtype=torch.float32)
            weights = []
            for layer in (up, down):
                torch.nn.init.normal_(layer.weight)
                weights.append(layer.weight.detach().clone())
                layer.quant_method.process_weights_after_loading(layer)  # the loader's job (CPU GEMM setup)
            x = torch.randn(2, 32)
            y, _ = down(up(x)[0])
        assert torch.allclose(y, x @ weights[0].t() @ weights[1].t(), atol=1e-3)
    finally:
        destroy_diffusion_distributed()
    assert not torch.distributed.is_initialized()
