"""The connector interface and the payload it carries."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch


@dataclass
class StagePayload:
    """What one stage hands to the next for one request: small metadata plus (possibly large) tensors."""

    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class PayloadHandle(msgspec.Struct, kw_only=True, gc=False):
    """A small, picklable reference to a payload held by a connector; the receiver passes it to `get`."""

    key: str
    request_id: str
    metadata: dict[str, Any] = {}
    tensor_specs: list[tuple[str, str, str, tuple[int, ...]]] = []
    """(name, segment name, dtype, shape) for tensors held outside the handle (shm connector)."""
    ref: Any = None
    """The payload's `ObjectRef` in Ray's object store (ray connector)."""
    producer: str | None = None
    """The process that put the payload and holds it until its readers took it (ray connector: its Ray worker
    id), so that a `get` there counts readers while one elsewhere fetches."""


class OmniConnector(abc.ABC):
    """`put` stores a payload for `num_readers` consumers and returns a handle; each consumer calls `get` once.

    The payload is freed after the last `get`, on `drop_request` (abort / failure) or on `close`, whichever
    comes first, so nothing outlives the request.
    """

    @abc.abstractmethod
    def put(self, request_id: str, src_stage: int, dst_stage: int, payload: StagePayload,
            num_readers: int = 1, chunk: int | None = None) -> PayloadHandle:
        """`chunk`: the index of this payload on a streamed edge, where several are in flight at once."""

    @abc.abstractmethod
    def get(self, handle: PayloadHandle) -> StagePayload: ...

    @abc.abstractmethod
    def drop_request(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @staticmethod
    def make_key(request_id: str, src_stage: int, dst_stage: int, chunk: int | None = None) -> str:
        key = f"{request_id}:{src_stage}->{dst_stage}"
        return key if chunk is None else f"{key}#{chunk}"

