"""Pieces every omni request model shares: unknown fields set aside, the protocol-layer value checks and the
diffusion extra-body fields (derived from `OmniDiffusionSamplingParams`, the one schema of diffusion knobs)."""

from __future__ import annotations

import json
import math
import re
import typing
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)

from vllm_omni.errors import OmniClientError
from vllm_omni.inputs.data import SEED_RANGE, OmniDiffusionSamplingParams, knob_names, knob_range

ImageResponseFormat = Literal["b64_json", "url"]
MAX_JSON_DEPTH = 64
"""Deeper request bodies are refused: no route needs them, and walking them costs stack."""
_SIZE = re.compile(r"([0-9]{1,6})x([0-9]{1,6})", re.ASCII)


def split_unknown_fields(data: Any, *model_classes: type[BaseModel]) -> tuple[Any, list[str]]:
    """(`data` without the keys none of `model_classes` knows, those keys sorted)."""
    if not isinstance(data, dict):
        return data, []
    known: set[str] = set()
    for model_cls in model_classes:
        for name, info in model_cls.model_fields.items():
            known.add(name)
            if info.alias:
                known.add(info.alias)
    unknown = sorted(set(data) - known)
    return ({k: v for k, v in data.items() if k in known} if unknown else data), unknown


def check_json_values(data: Any, int_range: tuple[int, int] = SEED_RANGE) -> None:
    """What no field may carry, whatever its declared type (free-form dicts included): text that is not valid
    UTF-8 (lone surrogates), NaN / Infinity, integers outside `int_range` (int64/uint64: what msgspec carries),
    nesting deeper than MAX_JSON_DEPTH. The error names the first offending path."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise OmniClientError(f"request body is nested deeper than {MAX_JSON_DEPTH} levels", param=path or None)
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, float) and not math.isfinite(value):
            raise OmniClientError(f"{path or 'value'} must be a finite number, got {value!r}", param=path or None)
        elif isinstance(value, int) and not isinstance(value, bool) and not int_range[0] <= value <= int_range[1]:
            raise OmniClientError(f"{path or 'value'} is out of the 64-bit integer range", param=path or None)
        elif isinstance(value, dict):
            for key, item in value.items():
                key_path = f"{path}.{key}" if path else str(key)
                _check_text(str(key), key_path)
                stack.append((item, key_path, depth + 1))
        elif isinstance(value, list | tuple):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise OmniClientError(f"{path or 'text'} is not valid UTF-8 text (unpaired surrogate at position "
                              f"{exc.start})", param=path or None) from exc


def field_path(value: Any, loc: tuple[Any, ...]) -> str:
    """`loc` of a pydantic error as a path into the request's own `value` (`.image_url.url`, `[2]`): the union
    member names pydantic puts in `loc` are not in the request and are left out."""
    path = ""
    for k, key in enumerate(loc):
        if isinstance(key, int) and isinstance(value, list) and 0 <= key < len(value):
            path, value = f"{path}[{key}]", value[key]
        elif isinstance(key, str) and isinstance(value, dict) and (key in value or k == len(loc) - 1):
            path, value = f"{path}.{key}", value.get(key)
    return path


def tagged_error(errors: list[Any]) -> Any:
    """Of a union's errors, the first of a member that the value's own `type` / `role` tag selects (the errors
    of the members whose tag differs say only that)."""
    untagged = [e["loc"][:-1] for e in errors if e["type"] == "literal_error" and e["loc"][-1] in ("type", "role")]
    return next((e for e in errors if not any(e["loc"][:len(t)] == t for t in untagged)), errors[0])


def named_field(message: str, fields: typing.Iterable[str]) -> str | None:
    """The field of `fields` that an error message names first, for the errors that name it in words only: a
    compound name anywhere (`thinking_token_budget is set but ...`, "one kind of structured outputs"), a one-word
    name as the subject (vLLM's `min_p must be in [0, 1], got 1.5`) or quoted; a one-word name used as a plain
    word (`model`) does not count."""
    hits = []
    for name in fields:
        for words in {name, name.replace("_", " ")}:
            w = re.escape(words)
            pattern = rf"(?<![\w.]){w}(?!\w)" if "_" in name else \
                rf"^{w}(?!\w)|(?<![\w.]){w}\s+(?:must|cannot|should)\b|[`'\"]{w}[`'\"]"
            if m := re.search(pattern, message, re.IGNORECASE if "_" in name else 0):
                hits.append((m.start(), name))
    return min(hits)[1] if hits else None


def first_invalid_field(data: Any, *model_classes: type[BaseModel]) -> OmniClientError | None:
    """The first field of `data` whose value its own annotation refuses, as a client error naming it: for when a
    validator that assumes a field's shape (vLLM's `mode="before"` ones) raised TypeError / AttributeError
    instead of a validation error. Only on that error path: it builds one TypeAdapter per field."""
    if not isinstance(data, dict):
        return OmniClientError("the request body must be a JSON object")
    for model_cls in model_classes:
        for name, value in data.items():
            info = model_cls.model_fields.get(name)
            if info is None:
                continue
            try:
                TypeAdapter(info.annotation).validate_python(value)
            except ValidationError as exc:
                error = tagged_error(exc.errors())
                where = f"{name}{field_path(value, error['loc'])}"
                return OmniClientError(f"{where}: {error['msg']}", param=where)
    return None


class CheckedBody(BaseModel):
    """Base of every omni request model: the protocol-layer value checks run before field validation, and
    fields no model of the route knows are set aside (vLLM's policy: the route ignores them with a warning,
    or refuses them under --strict-request-fields; see `api_router.check_ignored_fields`)."""

    _ignored_fields: list[str] = PrivateAttr(default_factory=list)
    known_models: ClassVar[tuple[type[BaseModel], ...]] = ()
    """Models whose fields this one also accepts (a batch chat takes every single-chat field)."""

    @model_validator(mode="wrap")
    @classmethod
    def _set_aside_unknown_fields(cls, data: Any, handler: Any) -> Any:
        check_json_values(data)
        data, unknown = split_unknown_fields(data, cls, *cls.known_models)
        try:
            model = handler(data)
        except (TypeError, AttributeError) as exc:  # a parent's validator read a field of another shape
            raise first_invalid_field(data, cls) or OmniClientError(f"invalid request: {exc}") from exc
        except ValidationError as exc:  # a model-level check (vLLM's) names its field in words only
            error = exc.errors()[0]
            if error["loc"] or error["type"] != "value_error" or not (param := named_field(error["msg"], data)):
                raise
            raise OmniClientError(error["msg"].removeprefix("Value error, "), param=param) from None
        model._ignored_fields = unknown
        return model

    @property
    def ignored_fields(self) -> list[str]:
        """The body's fields that no model of the route knows (not validated, not used)."""
        return list(self._ignored_fields)


def diffusion_knob_fields(exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    """`create_model` field definitions of the schema's HTTP knobs: optional, with the schema's ranges."""
    hints = typing.get_type_hints(OmniDiffusionSamplingParams)
    out: dict[str, Any] = {}
    for name in knob_names(http=True):
        if name in exclude:
            continue
        low, high = knob_range(name)
        out[name] = (hints[name] | None, Field(default=None, ge=low, le=high))
    return out


_DiffusionKnobs = create_model("DiffusionKnobs", __base__=CheckedBody, **diffusion_knob_fields())


class DiffusionFields(_DiffusionKnobs):
    """Diffusion knobs accepted as top-level (extra body) fields on chat and image routes: every `http` knob of
    `OmniDiffusionSamplingParams`, plus `size` and `cfg_scale`. Values are checked again by the schema, which
    names the field on error."""

    model_config = ConfigDict(extra="forbid")

    size: str | None = None
    """"WIDTHxHEIGHT" (e.g. "512x512") or "auto"."""
    cfg_scale: float | None = None
    """Alias of `true_cfg_scale`."""

    @model_validator(mode="after")
    def _resolve_aliases(self) -> DiffusionFields:
        if self.cfg_scale is not None:
            if self.true_cfg_scale is not None and self.true_cfg_scale != self.cfg_scale:
                raise OmniClientError("give either cfg_scale or true_cfg_scale, not both", param="cfg_scale")
            self.true_cfg_scale = self.cfg_scale
            self.cfg_scale = None
        return self


DIFFUSION_FIELD_NAMES: frozenset[str] = frozenset(DiffusionFields.model_fields)


def parse_size(size: str | None, param: str = "size") -> tuple[int | None, int | None]:
    """"WxH" -> (width, height); None/"auto" -> (None, None). ASCII digits only (`str.isdigit` accepts "²")."""
    if size is None or size == "auto":
        return None, None
    match = _SIZE.fullmatch(size.lower().replace(" ", ""))
    if match is None:
        raise OmniClientError(f"{param} must look like '512x512' (WIDTHxHEIGHT) or 'auto', got {size[:32]!r}",
                              param=param)
    width, height = int(match[1]), int(match[2])
    if width <= 0 or height <= 0:
        raise OmniClientError(f"{param} must have positive width and height, got {size!r}", param=param)
    return width, height


def coerce_form(fields: dict[str, str], model_cls: type[BaseModel]) -> dict[str, object]:
    """Multipart values arrive as strings: those of int / float / bool fields of `model_cls` are parsed, and those
    of object / list fields (`lora`, `cache_config`) read as JSON, so the model's own checks apply (the field types
    are the only table)."""
    out: dict[str, object] = {}
    for key, value in fields.items():
        info = model_cls.model_fields.get(key)
        kinds = {a for a in typing.get_args(info.annotation) or (info.annotation,)} if info else set()
        if any(typing.get_origin(kind) in (dict, list) or kind in (dict, list) for kind in kinds):
            try:
                out[key] = json.loads(value)
            except ValueError:
                raise OmniClientError(f"{key} must be JSON in a multipart form, got {value[:32]!r}",
                                      param=key) from None
            continue
        try:
            if bool in kinds:
                out[key] = _parse_bool(key, value)
            elif int in kinds:
                out[key] = int(value)
            elif float in kinds:
                out[key] = float(value)
            else:
                out[key] = value
        except ValueError as exc:
            raise OmniClientError(f"{key} must be a number, got {value[:32]!r}", param=key) from exc
    return out


def _parse_bool(key: str, value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0"):
        raise OmniClientError(f"{key} must be true or false, got {value[:32]!r}", param=key)
    return value.lower() in ("true", "1")
