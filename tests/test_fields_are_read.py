"""Every request field and every CLI flag vllm-omni defines is read by something outside its definition.

Why it matters: a field the schema validates and nothing reads is "accepted and dropped": the client believes
it did something (issue 25 found six). What it pins: for each field of the request models in
`entrypoints/openai/protocol/` that vllm-omni adds (vLLM's own chat fields are vLLM's to read) and each flag of
the OmniConfig / OmniFrontend groups, some module other than the one defining it reads the name: an attribute
(`x.name`), a key (`d["name"]`, `.get("name")`, `getattr(x, "name")`) or a name in a literal tuple / list / set
that code iterates (`for name in ("a", "b"): getattr(...)`); a route's own field must be read under
`entrypoints/` (names such as `user` or `level` are read elsewhere for other things). What the code reads
through a table it builds from the schema is found on the table's consumer; the rest is the allow-list, each
with its reason. It cannot see *where* a read happens (a field read for one stage kind only): the serving tests
pin that.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib
import sys

import pytest
from pydantic import BaseModel
from vllm.engine.arg_utils import EngineArgs

import vllm_omni
from vllm_omni.engine.arg_utils import OmniEngineArgs
from vllm_omni.entrypoints.cli.serve import OmniFrontendArgs
from vllm_omni.entrypoints.openai.protocol import audio, chat, common, images, omni, videos
from vllm_omni.inputs import data
from vllm_omni.inputs.data import knob_names

SOURCE = pathlib.Path(vllm_omni.__file__).parent
PROTOCOL_MODULES = (audio, chat, common, images, omni, videos)
ITERATED = (ast.For, ast.comprehension)

ALLOWED: dict[str, str] = {
    "ImageGenerationRequest.moderation": "its Literal is the whole behaviour: only `low` (no moderation runs here) "
                                         "is accepted, anything else is a 400 naming it",
    "ImageGenerationRequest.background": "its Literal is the whole behaviour: `auto` / `opaque` (what our "
                                         "pipelines draw) are accepted, `transparent` is a 400 naming it",
    "*.cfg_scale": "an alias the diffusion fields' own validator moves to `true_cfg_scale` (read there)",
    "--num-gpus": "refused unless 1 through `diffusion/data.py` NOT_IMPLEMENTED, a table keyed by the name",
}
"""`Model.field` or `--flag`: why nothing reads the name as such."""


@functools.cache
def reads_outside() -> dict[str, set[str]]:
    """name -> the source files (relative) that read it, by the rules of the module docstring."""
    found: dict[str, set[str]] = {}

    def add(name: object, where: str) -> None:
        if isinstance(name, str):
            found.setdefault(name, set()).add(where)

    for path in SOURCE.rglob("*.py"):
        where = str(path.relative_to(SOURCE))
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                add(node.attr, where)
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                add(node.slice.value, where)
            elif isinstance(node, ast.Call) and (key := _key_argument(node)) is not None:
                add(key, where)
            elif isinstance(node, ITERATED) and isinstance(node.iter, ast.Tuple | ast.List | ast.Set):
                for element in node.iter.elts:  # names, or rows of a table: ("name", "what it is"), ...
                    for item in element.elts if isinstance(element, ast.Tuple) else [element]:
                        if isinstance(item, ast.Constant):
                            add(item.value, where)
    return found


def _key_argument(node: ast.Call) -> object:
    """The constant name of `getattr(x, "name")` / `hasattr(x, "name")` / `d.get("name")` (`pop`, `setdefault`)."""
    if isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
        arg = node.args[1]
    elif isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop", "setdefault") and node.args:
        arg = node.args[0]
    else:
        return None
    return arg.value if isinstance(arg, ast.Constant) else None


def _defining_file(cls: type[BaseModel], name: str) -> str:
    """The file declaring field `name` of `cls`: a class of its MRO, or the diffusion schema for the knobs."""
    owner = next((c for c in cls.__mro__ if name in vars(c).get("__annotations__", {})), None)
    module = sys.modules[owner.__module__] if owner is not None else data
    return str(pathlib.Path(module.__file__).relative_to(SOURCE))


def request_fields() -> list[tuple[str, str, str]]:
    """(label, name, defining file) of each field our request models add to what vLLM's chat models define."""
    out = []
    for module in PROTOCOL_MODULES:
        for cls in vars(module).values():
            if not (isinstance(cls, type) and issubclass(cls, common.CheckedBody) and cls.__module__ == module.__name__
                    and cls.__name__.endswith("Request")):
                continue
            for name in cls.model_fields:
                owner = next((c for c in cls.__mro__ if name in vars(c).get("__annotations__", {})), None)
                if owner is not None and not owner.__module__.startswith("vllm_omni."):
                    continue  # vLLM's chat field: vLLM's chat code reads it
                out.append((f"{cls.__name__}.{name}", name, _defining_file(cls, name)))
    return out


def cli_flags() -> list[tuple[str, str, str]]:
    vllm_names = {f.name for f in dataclasses.fields(EngineArgs)}
    flags = [(f.name, "engine/arg_utils.py") for f in dataclasses.fields(OmniEngineArgs) if f.name not in vllm_names]
    flags += [(f.name, "entrypoints/cli/serve.py") for f in dataclasses.fields(OmniFrontendArgs)]
    return [("--" + name.replace("_", "-"), name, where) for name, where in flags]


def unread(items: list[tuple[str, str, str]], readers: str = "") -> list[str]:
    """Labels of `items` that no file under `readers` (a folder of vllm_omni; "" = all) but the defining one
    reads. The diffusion knobs travel in `OmniDiffusionSamplingParams`: any file may read those."""
    reads = reads_outside()
    knobs = set(knob_names())
    pipeline_kwargs = set(knob_names(pipeline_kwarg=True))  # passed by name to diffusers' __call__ by the adapter
    return sorted({label for label, name, defined_in in items
                   if label not in ALLOWED and f"*.{name}" not in ALLOWED and name not in pipeline_kwargs
                   and not {f for f in reads.get(name, set()) - {defined_in}
                            if name in knobs or f.startswith(readers)}})


def test_every_request_field_is_read():
    assert len(request_fields()) > 60  # the walk found the models
    assert unread(request_fields(), readers="entrypoints/") == []  # a route's own field: its serving reads it


def test_every_cli_flag_is_read():
    assert len(cli_flags()) > 30
    assert unread(cli_flags()) == []


@pytest.mark.parametrize("label", sorted(ALLOWED))
def test_allow_list_names_something_that_exists(label):
    known = {lab for lab, _, _ in request_fields() + cli_flags()} | {f"*.{n}" for _, n, _ in request_fields()}
    assert label in known, f"{label} is allow-listed but is no field or flag any more"
