"""Servers on `FakeOmni` (no model) for the reliability contract tests, and the repro file's image fixtures."""

from __future__ import annotations

import io

import pytest
from fastapi.testclient import TestClient
from PIL import Image
from vllm.utils.argparse_utils import FlexibleArgumentParser

from tests.entrypoints.openai.fake_engine import FakeOmni
from vllm_omni.entrypoints.cli.serve import make_omni_arg_parser
from vllm_omni.entrypoints.openai.api_server import build_app


@pytest.fixture(scope="module")
def parser():
    return make_omni_arg_parser(FlexibleArgumentParser())


def make_client(parser, engine: FakeOmni, *extra: str) -> TestClient:
    args = parser.parse_args(["fake-model", *extra])
    args.model = args.model_tag
    return TestClient(build_app(args, engine), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def img(parser):
    """Like IMG, but taking input images too (tiny/qwen-image-edit), so the input checks are reached: a
    text-to-image model refuses input images before any of them (tests/entrypoints/openai capability tests)."""
    engine = FakeOmni(stage_types=["diffusion"], output_modalities={"image"}, input_modalities={"text", "image"})
    return make_client(parser, engine)


@pytest.fixture(scope="module")
def ar(parser):
    """Like AR (tiny/qwen2): one AR stage."""
    return make_client(parser, FakeOmni(stage_types=["llm"], output_modalities={"text"}))


@pytest.fixture(scope="module")
def vid(parser):
    """Like VID, taking an input image too (tiny/wan2.1-i2v), so `input_reference` checks are reached."""
    return make_client(parser, FakeOmni(stage_types=["diffusion"], output_modalities={"video"},
                                        input_modalities={"text", "image"}))


def png(size: tuple[int, int], mode: str = "1") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def bomb_error() -> bytes:
    """200 Mpx: PIL itself raises DecompressionBombError on open."""
    return png((20000, 10000))


@pytest.fixture(scope="session")
def bomb_warn() -> bytes:
    """144 Mpx: PIL only warns; a 17.5 KB upload that decodes to 432 MB of RGB."""
    return png((12000, 12000))


def assert_client_error(resp, param: str, status: int = 400) -> dict:
    """A 4xx with an OpenAI-shaped body whose `param` names the field."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and err["type"] and err["message"], err
    assert err["param"] == param, err
    return err
