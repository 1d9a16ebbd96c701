"""IPC round trips: what crosses the engine/worker boundary comes back equal, and shared memory is released.

What it pins: arrays and tensors above the threshold go through /dev/shm and the segment is unlinked on
receipt; bf16 survives bit-exact; PIL images keep their mode; result structs decode to typed objects; a
type that cannot travel is refused; `cleanup_shm` removes what a dead sender left.
"""

from __future__ import annotations

import os

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.ipc import (
    BatchResult,
    ExecuteBatch,
    MsgCodec,
    WorkerInput,
    WorkerOutput,
    cleanup_shm,
    new_shm_prefix,
)
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.inputs.data import OmniDiffusionSamplingParams


@pytest.fixture
def prefix():
    prefix = new_shm_prefix()
    yield prefix
    cleanup_shm(prefix)


def our_segments(prefix: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def roundtrip(value, prefix: str, *, expect_shm: bool):
    codec = MsgCodec(WorkerOutput, prefix)
    data = codec.encode(BatchResult(batch_id=1, rank=0, outputs=[DiffusionOutput(output=value)]))
    assert bool(our_segments(prefix)) == expect_shm
    decoded = codec.decoder().decode(data)
    assert our_segments(prefix) == []
    assert isinstance(decoded, BatchResult) and isinstance(decoded.outputs[0], DiffusionOutput)
    return decoded.outputs[0].output


def test_large_ndarray_goes_through_shm(prefix):
    array = np.random.default_rng(0).standard_normal((600, 600)).astype(np.float32)  # 1.44 MB
    out = roundtrip({"video": array, "fps": 16}, prefix, expect_shm=True)
    assert out["fps"] == 16 and out["video"].dtype == np.float32 and np.array_equal(out["video"], array)


def test_small_ndarray_stays_inline(prefix):
    array = np.arange(12, dtype=np.int64).reshape(3, 4)
    assert np.array_equal(roundtrip([array], prefix, expect_shm=False)[0], array)


@pytest.mark.parametrize("shape, expect_shm", [((4, 8), False), ((1024, 1024), True)])
def test_bf16_tensor_restored_bit_exact(prefix, shape, expect_shm):
    tensor = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = roundtrip({"latents": tensor}, prefix, expect_shm=expect_shm)["latents"]
    assert out.dtype == torch.bfloat16 and torch.equal(out, tensor)


def test_pil_images_keep_pixels_and_mode(prefix):
    rgb = Image.fromarray(np.random.default_rng(1).integers(0, 256, (700, 700, 3), dtype=np.uint8))
    gray = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), mode="L")
    out = roundtrip([rgb, gray], prefix, expect_shm=True)
    assert [im.mode for im in out] == ["RGB", "L"]
    assert np.array_equal(np.asarray(out[0]), np.asarray(rgb)) and np.array_equal(np.asarray(out[1]), np.asarray(gray))


def test_request_with_input_image_roundtrips(prefix):
    image = Image.fromarray(np.zeros((16, 16, 3), dtype=np.uint8))
    request = OmniDiffusionRequest(
        {"prompt": "edit", "negative_prompt": "", "multi_modal_data": {"image": image}},
        OmniDiffusionSamplingParams(height=64, seed=3, quality="high", extra_args={"k": [1, 2]}),
        "r1",
    )
    codec = MsgCodec(WorkerInput, prefix)
    decoded = codec.decoder().decode(codec.encode(ExecuteBatch(batch_id=7, requests=[request])))
    (got,) = decoded.requests
    assert got.sampling_params == request.sampling_params and got.request_id == "r1"
    assert got.negative_prompt == "" and np.array_equal(np.asarray(got.multi_modal_data["image"]), np.asarray(image))


def test_unsendable_types_are_refused(prefix):
    codec = MsgCodec(WorkerOutput, prefix)
    with pytest.raises(NotImplementedError, match="object"):
        codec.encode(BatchResult(1, 0, [DiffusionOutput(output=np.array([object()], dtype=object))]))
    with pytest.raises(NotImplementedError, match="cannot send"):
        codec.encode(BatchResult(1, 0, [DiffusionOutput(output=object())]))
    with pytest.raises(msgspec.ValidationError):
        codec.decoder().decode(msgspec.msgpack.encode({"not": "a message"}))


def test_cleanup_shm_removes_only_our_prefix(prefix):
    other = new_shm_prefix()
    for name in (f"{prefix}a", f"{prefix}b", f"{other}c"):
        open(f"/dev/shm/{name}", "wb").close()
    assert sorted(cleanup_shm(prefix)) == [f"{prefix}a", f"{prefix}b"]
    assert our_segments(other) == [f"{other}c"]
    cleanup_shm(other)
