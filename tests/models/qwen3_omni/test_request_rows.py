"""The two KV-connector plugins that give the Qwen3-Omni stages request identity (no engine): from the scheduler's
view of a step (new / continued / resumed / finished requests and their KV blocks) the worker side maps each row of
the flattened batch to its request by the row's KV slot, and the thinker's capture keeps exactly the prompt rows.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_omni.models.qwen3_omni.talker_rows import TalkerRowsConnector
from vllm_omni.models.qwen3_omni.thinker_hidden import ThinkerHiddenStatesConnector

BLOCK = 4
AUDIO, IMAGE, VIDEO = 900, 901, 902


def vllm_config():
    thinker = SimpleNamespace(audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO)
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(), cache_config=SimpleNamespace(block_size=BLOCK),
                           model_config=SimpleNamespace(hf_config=SimpleNamespace(thinker_config=thinker)))


def step(new=(), cached=(), finished=(), resumed=()):
    """A scheduler output: `new` (req_id, prompt ids, blocks, extra_args), `cached` (req_id, computed, new blocks)."""
    new_reqs = [SimpleNamespace(req_id=r, prompt_token_ids=ids, block_ids=(blocks,),
                                sampling_params=SimpleNamespace(extra_args=extra)) for r, ids, blocks, extra in new]
    cached_reqs = SimpleNamespace(req_ids=[c[0] for c in cached], num_computed_tokens=[c[1] for c in cached],
                                  new_block_ids=[(c[2],) if c[2] is not None else None for c in cached],
                                  resumed_req_ids=set(resumed))
    scheduled = {r[0]: 1 for r in new} | {c[0]: 1 for c in cached}
    return SimpleNamespace(scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
                           finished_req_ids=set(finished), num_scheduled_tokens=scheduled)


def slots(*spans):
    """slot_mapping of a batch: (block, first offset, count) per request, in batch order."""
    return torch.tensor([b * BLOCK + o for b, start, n in spans for o in range(start, start + n)])


def test_talker_rows_follow_blocks_params_and_finishes() -> None:
    scheduler = TalkerRowsConnector(vllm_config(), KVConnectorRole.SCHEDULER)
    worker = TalkerRowsConnector(vllm_config(), KVConnectorRole.WORKER)
    worker.bind_connector_metadata(scheduler.build_connector_meta(step(
        new=[("a-1", [0] * 6, [3, 7], {"k": "a"}), ("b-1", [0] * 2, [5], {"k": "b"})])))
    # prefill: a = 6 rows (block 3, then 7), b = 2 rows (block 5)
    rows = worker.request_rows(torch.cat([slots((3, 0, 4), (7, 0, 2)), slots((5, 0, 2))]))
    assert [(r.req_id, r.start, r.end, r.extra_args) for r in rows] == [
        ("a-1", 0, 6, {"k": "a"}), ("b-1", 6, 8, {"k": "b"})]

    # decode, b first in the batch now; a gets a new block; a streaming chunk resumes b with new params
    worker.bind_connector_metadata(scheduler.build_connector_meta(step(
        new=[("b-1", [0] * 3, [5], {"k": "b2"})], cached=[("a-1", 8, [9])])))
    rows = worker.request_rows(torch.cat([slots((5, 2, 1)), slots((9, 0, 1))]))
    assert [(r.req_id, r.start, r.end, r.extra_args) for r in rows] == [
        ("b-1", 0, 1, {"k": "b2"}), ("a-1", 1, 2, {"k": "a"})]

    # a finishes: reported once, also on a step without a forward; a preempted b resumes on other blocks
    worker.bind_connector_metadata(scheduler.build_connector_meta(step(cached=[("b-1", 0, [2])], finished=["a-1"],
                                                                       resumed=["b-1"])))
    assert worker.drain_finished() == {"a-1"} and worker.drain_finished() == set()
    assert [(r.req_id, r.start, r.end) for r in worker.request_rows(slots((2, 0, 3)))] == [("b-1", 0, 3)]
    assert worker.request_rows(torch.tensor([-1, -1])) == []  # padding rows belong to nobody


def test_thinker_capture_keeps_prompt_rows_only() -> None:
    scheduler = ThinkerHiddenStatesConnector(vllm_config(), KVConnectorRole.SCHEDULER)
    worker = ThinkerHiddenStatesConnector(vllm_config(), KVConnectorRole.WORKER)
    prompt = [1, 2, AUDIO, AUDIO, 3, IMAGE, 4]  # 7 tokens, multimodal at 2, 3, 5
    hidden = torch.arange(7 * 2, dtype=torch.float32).view(7, 2)
    positions = torch.stack([torch.arange(7), torch.arange(7) + 10, torch.arange(7) + 20])

    # chunked prefill: positions 0..4 (blocks 6, 1), then 5..6 plus one decode row of another request
    worker.bind_connector_metadata(scheduler.build_connector_meta(step(new=[("r-12345678", prompt, [6, 1], None)])))
    worker.capture(slots((6, 0, 4), (1, 0, 1)), positions[:, :5], hidden[:5])
    worker.bind_connector_metadata(scheduler.build_connector_meta(step(cached=[("r-12345678", 5, None)])))
    other = torch.full((3, 1), 99)
    worker.capture(torch.cat([slots((8, 3, 1)), slots((1, 1, 2))]), torch.cat([other, positions[:, 5:]], dim=1),
                   torch.cat([hidden[:1] * 0, hidden[5:]]))
    # prompt done: no more capture
    meta = scheduler.build_connector_meta(step(cached=[("r-12345678", 7, None)]))
    assert meta.requests == {}

    taken = worker.take("r", keep=True)
    assert taken["positions"] == positions.tolist() and taken["multimodal_positions"] == [2, 3, 5]
    states = torch.frombuffer(bytearray(taken["hidden"]), dtype=torch.float32).view(*taken["hidden_shape"])
    torch.testing.assert_close(states, hidden[[2, 3, 5]])
    worker.bind_connector_metadata(scheduler.build_connector_meta(step(finished=["r-12345678"])))
    assert worker.take("r") is None  # a finished capture went out in-band; the worker let go of it
