"""Per-request LoRA on the native DiTs: deltas added beside the base linears, never merged into their weights,
so the rows of one transformer forward each run their own adapters (or none).

An adapter file is read and converted by the family's diffusers LoRA loader (`lora_state_dict`: kohya, civitai
and other published layouts become diffusers/PEFT keys), then each `transformer.<module>.lora_A/B` pair is
placed on the parallel linear that computes that module (the family's `lora_target`; q/k/v land on slices of a
fused projection) and sharded as that linear is: A is cut along the input of a row-parallel linear (its
rank-sized product is all-reduced), B along the output of a column-parallel one. The alpha/rank scaling is
folded into A at load.

One forward: `LoRAManager.forward_rows` tells the hooks which rows use which resident adapter at which scale;
each hooked linear then adds `scale * (x[rows] @ A.T) @ B.T` on each contiguous segment of rows sharing an
adapter and scale, in place on views of the activation (vLLM's punica SGMV does the same per segment; its torch
ops expand per token, which at DiT sequence lengths would materialize tokens x rank x hidden). At most
`max_loras` adapters are resident (LRU); a forward that needs more raises `LoRACapacityError` and its states then
step apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.lora import LoRARef
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

RowAdapters = Sequence[tuple[Hashable, float]]
"""The (adapter key, scale) pairs of one transformer row."""


class LoRACapacityError(RuntimeError):
    """One forward needs more adapters than `--max-loras` keeps resident."""


@dataclass(frozen=True)
class _Segment:
    """Batch rows [start, stop) run adapter `key` at `scale` (a request's rows, or its CFG rows, are contiguous)."""

    key: Hashable
    start: int
    stop: int
    scale: float


@dataclass
class _Delta:
    a: torch.Tensor
    """(rank, in_local): this rank's input columns of every slice's A, alpha/rank folded in, slices stacked."""
    b: torch.Tensor
    """(out_local, rank): this rank's output rows; slice s fills its rows and its own rank columns only."""


@dataclass
class _Rows:
    """The current forward's adapter segments, shared by every hook of one manager."""

    segments: list[_Segment] = field(default_factory=list)


class _LoRAHook:
    """Forward hook of one linear: adds the delta of each adapter of the forward on that adapter's rows."""

    def __init__(self, layer: nn.Module, rows: _Rows) -> None:
        self.rows = rows
        self.deltas: dict[Hashable, _Delta] = {}
        self.reduce = (
            isinstance(layer, RowParallelLinear)
            and layer.input_is_parallel
            and layer.tp_size > 1
            and layer.reduce_results
        )

    def __call__(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> Any:
        x = inputs[0]
        out = output[0] if isinstance(output, tuple) else output
        for segment in self.rows.segments:
            delta = self.deltas.get(segment.key)
            if delta is None:
                continue
            # Row slices are views: the delta reads and adds in place, no gather or scatter of activations.
            h = F.linear(x[segment.start : segment.stop], delta.a)
            if self.reduce:  # x is this rank's input columns: the rank-sized product is partial
                h = tensor_model_parallel_all_reduce(h)
            rows = out[segment.start : segment.stop]
            if rows.is_contiguous():
                # One GEMM that accumulates into the output (read once, written once): the delta is memory-bound,
                # and a separate product plus add_ moved the output's bytes twice more.
                rows.view(-1, rows.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), delta.b.t(), alpha=segment.scale)
            else:
                rows.add_(F.linear(h, delta.b), alpha=segment.scale)
        return output


def has_lora(layer: nn.Module) -> bool:
    """Whether `layer` carries LoRA hooks (then fused paths that bypass its forward must not run)."""
    return isinstance(getattr(layer, "lora_hook", None), _LoRAHook)


@dataclass
class _Adapter:
    key: Hashable
    layers: list[tuple[_LoRAHook, _Delta]]


class LoRAManager:
    """The adapters resident on one pipeline's transformers (LRU of `max_loras`) and the hooks that apply them.

    `transformers`: slot name -> DiT (`transformer`, Wan2.2's `transformer_2`), each with `lora_target(module)`
    mapping a diffusers module name to (our module name, shard id or None). `loader`: the family's diffusers
    LoRA loader mixin, whose `lora_state_dict` reads and converts a file.
    """

    def __init__(
        self, transformers: dict[str, nn.Module], loader: type, max_loras: int, max_lora_rank: int, device: torch.device
    ) -> None:
        self.transformers = transformers
        self.loader = loader
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.device = device
        self._rows = _Rows()
        self._resident: OrderedDict[Hashable, _Adapter] = OrderedDict()

    # ---- residency ---------------------------------------------------------------------------------------

    def load(self, ref: LoRARef) -> Hashable:
        """Make `ref`'s adapter resident (most recently used); its key. A file that cannot be read, whose keys
        are not this model's, or whose rank is above `max_lora_rank` is an OmniClientError naming `lora`."""
        if ref.path is None:
            raise OmniClientError(
                f"unknown LoRA adapter {ref.name!r}: register it with --lora-modules or "
                '/v1/load_lora_adapter, or give its "path"',
                param="lora",
            )
        key = ref.path
        if key in self._resident:
            self._resident.move_to_end(key)
            return key
        deltas = self._read(ref)
        while len(self._resident) >= self.max_loras:
            self._evict(next(iter(self._resident)))
        layers = []
        for (slot, target), delta in deltas.items():
            hook = self._hook(self.transformers[slot].get_submodule(target))
            hook.deltas[key] = delta
            layers.append((hook, delta))
        self._resident[key] = _Adapter(key, layers)
        logger.info("LoRA adapter %s resident (%d layers)", ref.name, len(layers))
        return key

    def unload(self, path: str) -> bool:
        """Drop a resident adapter (its weights leave the device); whether it was resident."""
        if path not in self._resident:
            return False
        self._evict(path)
        return True

    def _evict(self, key: Hashable) -> None:
        for hook, _ in self._resident.pop(key).layers:
            hook.deltas.pop(key, None)

    def _hook(self, layer: nn.Module) -> _LoRAHook:
        if not has_lora(layer):
            layer.lora_hook = _LoRAHook(layer, self._rows)
            # First among the layer's output hooks: the delta belongs to the layer's own output, before a
            # sequence-parallel plan's hook gathers or splits it.
            layer.register_forward_hook(layer.lora_hook, prepend=True)
        return layer.lora_hook

    # ---- one forward -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def forward_rows(self, rows: Sequence[RowAdapters]) -> Iterator[None]:
        """Within: transformer row i runs the adapters `rows[i]` (keys from `load`) at their scales."""
        segments: list[_Segment] = []
        open_: dict[tuple[Hashable, float], int] = {}  # (key, scale) -> index of its segment ending at row i
        for i, adapters in enumerate(rows):
            extended = {}
            for key, scale in adapters:
                j = open_.get((key, scale))
                if j is not None and segments[j].stop == i:
                    segments[j] = dataclasses.replace(segments[j], stop=i + 1)
                else:
                    segments.append(_Segment(key, i, i + 1, scale))
                    j = len(segments) - 1
                extended[(key, scale)] = j
            open_ = extended
        keys = {segment.key for segment in segments}
        if len(keys) > self.max_loras or not keys <= self._resident.keys():
            raise LoRACapacityError(
                f"this forward needs {len(keys)} adapters, {self.max_loras} stay resident (--max-loras)"
            )
        self._rows.segments = segments
        try:
            yield
        finally:
            self._rows.segments = []

    # ---- reading a file ------------------------------------------------------------------------------------

    def _read(self, ref: LoRARef) -> dict[tuple[str, str], _Delta]:
        """The adapter's deltas by (transformer slot, our module), sharded for this rank."""
        kwargs = {"return_lora_metadata": True}
        if "return_alphas" in inspect.signature(self.loader.lora_state_dict).parameters:
            kwargs["return_alphas"] = True  # FLUX: `.alpha` tensors of diffusers-format files come apart
        try:
            *state_dict_and_alphas, metadata = self.loader.lora_state_dict(ref.path, **kwargs)
            state_dict, alphas = (*state_dict_and_alphas, None)[:2]
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise OmniClientError(
                f"lora {ref.name!r}: cannot read {ref.path!r} as a LoRA file: {exc}", param="lora"
            ) from None
        configs = {slot: _adapter_config(metadata, slot) for slot in self.transformers}
        if any(c.get("use_dora") for c in configs.values()) or any(
            "lora_magnitude_vector" in k or k.endswith(".lora_B.bias") for k in state_dict
        ):
            raise OmniClientError(f"lora {ref.name!r}: DoRA and LoRA biases are not supported", param="lora")
        modules: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        unmatched = []
        for name, tensor in state_dict.items():
            slot, _, rest = name.partition(".")
            module, _, kind = rest.rpartition(".lora_")
            if slot not in self.transformers or kind not in ("A.weight", "B.weight"):
                unmatched.append(name)
                continue
            modules.setdefault((slot, module), {})[kind[0]] = tensor
        pieces: dict[tuple[str, str], list[tuple[Any, torch.Tensor, torch.Tensor]]] = {}
        for (slot, module), pair in modules.items():
            transformer = self.transformers[slot]
            try:
                target = _target_layer(transformer, module)
            except ValueError as exc:
                raise OmniClientError(f"lora {ref.name!r}: {exc}", param="lora") from None
            if target is None or len(pair) != 2:
                unmatched.append(f"{slot}.{module}")
                continue
            a, b = pair["A"], pair["B"]
            rank = a.shape[0]
            if rank > self.max_lora_rank:
                raise OmniClientError(
                    f"lora {ref.name!r}: rank {rank} (at {module}) is above this server's "
                    f"--max-lora-rank {self.max_lora_rank}",
                    param="lora",
                )
            target_name, shard, layer = target
            if a.shape[1] != _in_features(layer) or b.shape[1] != rank:
                unmatched.append(f"{slot}.{module} (shape {tuple(b.shape)} x {tuple(a.shape)})")
                continue
            config = configs[slot]
            alpha = (alphas or {}).get(f"{slot}.{module}.alpha")
            alpha = float(alpha) if alpha is not None else _alpha(config, module, rank)
            scaling = alpha / (rank**0.5 if config.get("use_rslora") else rank)
            a = getattr(transformer, "lora_down_columns", lambda _t, w: w)(target_name, a)
            pieces.setdefault((slot, target_name), []).append((shard, a * scaling, b))
        if unmatched:
            shown = ", ".join(unmatched[:5]) + (" ..." if len(unmatched) > 5 else "")
            raise OmniClientError(
                f"lora {ref.name!r}: {len(unmatched)} tensor(s) match no LoRA-capable layer of this model: {shown}",
                param="lora",
            )
        if not pieces:
            raise OmniClientError(f"lora {ref.name!r}: {ref.path!r} holds no transformer LoRA weights", param="lora")
        return {
            (slot, target): self._delta(self.transformers[slot].get_submodule(target), parts)
            for (slot, target), parts in pieces.items()
        }

    def _delta(self, layer: nn.Module, parts: list[tuple[Any, torch.Tensor, torch.Tensor]]) -> _Delta:
        rank = sum(a.shape[0] for _, a, _ in parts)
        dtype = layer.weight.dtype  # fp32-kept modules (Wan's time embedder) stay fp32
        a_cat = torch.cat([_input_shard(layer, a) for _, a, _ in parts]).to(self.device, dtype)
        b_cat = torch.zeros(_out_local(layer), rank, device=self.device, dtype=dtype)
        column = 0
        for shard, a, b in parts:
            offset, size, start = _output_slice(layer, shard)
            b_cat[offset : offset + size, column : column + a.shape[0]] = b[start : start + size]
            column += a.shape[0]
        return _Delta(a_cat.contiguous(), b_cat)


def _adapter_config(metadata: dict[str, Any] | None, slot: str) -> dict[str, Any]:
    """The PEFT `LoraConfig` fields diffusers saved for component `slot` (`lora_adapter_metadata`, keys
    prefixed by the component), if any."""
    return {k.removeprefix(f"{slot}."): v for k, v in (metadata or {}).items() if k.startswith(f"{slot}.")}


def _alpha(config: dict[str, Any], module: str, rank: int) -> float:
    """The module's lora_alpha as PEFT resolves it: its `alpha_pattern` entry, else `lora_alpha`; a file
    without a config scales by 1 (alpha = rank), the diffusers convention."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if module == pattern or module.endswith("." + pattern):
            return float(alpha)
    return float(config.get("lora_alpha", rank)) if config else float(rank)


def _target_layer(transformer: nn.Module, module: str) -> tuple[str, Any, nn.Module] | None:
    try:
        target, shard = transformer.lora_target(module)
        layer = transformer.get_submodule(target)
    except (AttributeError, KeyError):
        return None
    if not isinstance(layer, nn.Linear | LinearBase):
        return None
    return target, shard, layer


def _in_features(layer: nn.Module) -> int:
    return layer.in_features if isinstance(layer, nn.Linear) else layer.input_size


def _input_shard(layer: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """This rank's input columns of A: a row-parallel linear sees only its slice of the input."""
    if isinstance(layer, RowParallelLinear) and layer.input_is_parallel and layer.tp_size > 1:
        size = layer.input_size_per_partition
        return a[:, layer.tp_rank * size : (layer.tp_rank + 1) * size]
    return a


def _out_local(layer: nn.Module) -> int:
    if isinstance(layer, nn.Linear):
        return layer.out_features
    if isinstance(layer, ColumnParallelLinear) and not layer.gather_output:
        return layer.output_size_per_partition
    return layer.output_size


def _output_slice(layer: nn.Module, shard: Any) -> tuple[int, int, int]:
    """(offset in this rank's output, size, first row of the full B) of one slice (q / k / v of a fused QKV,
    the i-th output of a merged linear, or the whole output)."""
    if isinstance(layer, QKVParallelLinear):
        q, kv = layer.num_heads * layer.head_size, layer.num_kv_heads * layer.head_size
        if shard == "q":
            return 0, q, layer.tp_rank * q
        kv_rank = layer.tp_rank // layer.num_kv_head_replicas
        return (q if shard == "k" else q + kv), kv, kv_rank * kv
    if isinstance(layer, MergedColumnParallelLinear):
        sizes = [size // layer.tp_size for size in layer.output_sizes]
        return sum(sizes[:shard]), sizes[shard], layer.tp_rank * sizes[shard]
    size = _out_local(layer)
    sharded = isinstance(layer, ColumnParallelLinear) and not layer.gather_output
    return 0, size, layer.tp_rank * size if sharded else 0
