"""A core or worker started from the forkserver (`vllm_omni/diffusion/process_start.py`) runs as a spawned one
would: in the starter's environment and on its stdout/stderr at the time it starts, not those the server had when
it started. Why: the server starts with the first process a stage needs; a later one started from a changed
environment (a test's capture, a caller's settings) got the old one."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from vllm_omni.diffusion.process_start import child_process, start_context


def report(path: str) -> None:
    Path(path).write_text(os.environ.get("OMNI_PROBE", "unset"))
    print("probe on stdout", flush=True)
    print("probe on stderr", file=sys.stderr, flush=True)


def test_a_forkserver_child_gets_the_environment_and_stdio_of_the_moment(tmp_path, capfd, monkeypatch):
    context = start_context()
    assert context.get_start_method() == "forkserver"
    first = child_process(context, report, (str(tmp_path / "first"),), "probe-first")
    first.start()  # the server is running from here on, with this environment
    first.join(120)
    monkeypatch.setenv("OMNI_PROBE", "set later")
    capfd.readouterr()
    probe = child_process(context, report, (str(tmp_path / "later"),), "probe-later")
    probe.start()
    probe.join(60)
    assert probe.exitcode == 0 and first.exitcode == 0
    assert (tmp_path / "later").read_text() == "set later"
    out = capfd.readouterr()
    assert "probe on stdout" in out.out and "probe on stderr" in out.err
