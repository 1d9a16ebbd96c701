"""Run the documented commands marked runnable, so a page cannot keep a command that fails.

A fenced ```bash or ```python block right after a `<!-- runnable -->` line in README.md or docs/*.md is run from a
fresh temporary directory with the repo's interpreter first on PATH: a bash block line by line (`set -e`), a python
block as a script (so `if __name__ == "__main__"` guards are exercised as users run them). A bash block of `vllm ...`
lines only (help pages, `--version`) runs through vLLM's CLI entry point in this process instead: the same
`vllm.entrypoints.cli.main.main()` the `vllm` script calls, without paying a fresh interpreter's 10 s of torch and
vLLM imports per line. Mark only cheap commands: help pages, tiny offline snippets; servers that keep running do
not belong here.
    python tools/check_docs.py                # every marked block
    python tools/check_docs.py docs/video.md  # one page
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^<!-- runnable -->\n```(bash|python)\n(.*?)^```", flags=re.M | re.S)
TIMEOUT_S = 600


def runnable_blocks(page: Path) -> list[tuple[str, str]]:
    return MARK.findall(page.read_text())


def cli_lines(body: str) -> list[list[str]] | None:
    """The argv of each line when every line is `vllm ARGS` (optionally `> /dev/null`), else None."""
    argvs = []
    for line in filter(None, (raw.strip() for raw in body.splitlines())):
        words = shlex.split(line)
        if words[-2:] == [">", "/dev/null"]:
            words = words[:-2]
        if words[:1] != ["vllm"] or any(w in {">", ">>", "|", "&&", ";", "<"} for w in words):
            return None
        argvs.append(words)
    return argvs or None


def run_cli_in_process(argv: list[str]) -> subprocess.CompletedProcess:
    """`vllm ARGS` through vLLM's console-script function, with its output captured and the process's argv and
    environment (vLLM's CLI sets its multiprocessing default) put back afterwards."""
    from vllm.entrypoints.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    saved_argv, saved_env = sys.argv, dict(os.environ)
    sys.argv = argv
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            err.write(str(e.code))
    finally:
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def run_block(lang: str, body: str) -> subprocess.CompletedProcess:
    if lang == "bash" and (argvs := cli_lines(body)):
        for argv in argvs:
            done = run_cli_in_process(argv)
            if done.returncode != 0:
                return done
        return done
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as cwd:
        if lang == "python":
            script = Path(cwd) / "snippet.py"
            script.write_text(body)
            cmd = [sys.executable, str(script)]
        else:
            cmd = ["bash", "-ec", body]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def main(pages: list[str]) -> int:
    paths = [Path(p) for p in pages] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    failed = 0
    for page in paths:
        for lang, body in runnable_blocks(page):
            out = run_block(lang, body)
            status = "ok" if out.returncode == 0 else f"FAILED (exit {out.returncode})"
            print(f"[check_docs] {page.name} {lang} block: {status}")
            if out.returncode != 0:
                failed += 1
                print(body + (out.stdout + out.stderr)[-3000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
