"""Every fenced block marked `<!-- runnable -->` in README.md and docs/ runs as written (tools/check_docs.py):
help pages and tiny offline snippets, each in a fresh directory; blocks of `vllm ...` lines only through vLLM's CLI
entry point in this process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_docs", ROOT / "tools" / "check_docs.py")
check_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_docs)

BLOCKS = [(page.relative_to(ROOT), lang, body)
          for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
          for lang, body in check_docs.runnable_blocks(page)]


def test_pages_have_marked_blocks():
    pages = {str(page) for page, _, _ in BLOCKS}
    assert {"README.md", "docs/video.md", "docs/getting_started.md"} <= pages


@pytest.mark.parametrize(("page", "lang", "body"), BLOCKS, ids=[f"{p}:{i}" for i, (p, _, _) in enumerate(BLOCKS)])
def test_block_runs(page, lang, body):
    out = check_docs.run_block(lang, body)
    assert out.returncode == 0, f"{page} {lang} block failed:\n{body}\n{(out.stdout + out.stderr)[-4000:]}"


def test_cli_block_runs_in_process_and_fails_like_the_cli():
    """A `vllm` line runs in this process and keeps the CLI's exit status and output: an unknown flag is argparse's
    exit 2 naming it; anything beyond plain `vllm` lines (a pipe) goes to bash."""
    assert check_docs.cli_lines("vllm --version\nvllm serve --omni --help=all > /dev/null\n") == [
        ["vllm", "--version"], ["vllm", "serve", "--omni", "--help=all"]]
    assert check_docs.cli_lines("vllm --version | head -1") is None
    out = check_docs.run_block("bash", "vllm --version\nvllm serve --omni --no-such-flag\n")
    assert out.returncode == 2 and "--no-such-flag" in out.stderr, out
