"""The flag tables of docs/cli.md, rendered from the serve parser (so from the config dataclasses' docstrings).

`python -m vllm_omni.entrypoints.cli.docs docs/cli.md` rewrites them in place; a test fails when the file
drifts from the parser, so the page cannot promise a flag the CLI does not have, or describe it differently.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

BEGIN = "<!-- BEGIN generated flag tables: python -m vllm_omni.entrypoints.cli.docs docs/cli.md -->"
END = "<!-- END generated flag tables -->"
GROUPS = ("OmniConfig", "OmniFrontend")


def _flag(action: argparse.Action) -> str:
    flag = max(action.option_strings, key=len)
    if action.choices is not None:
        return f"{flag} {{{','.join(str(c) for c in action.choices)}}}"
    return f"{flag} {action.metavar}" if action.metavar else flag


def _cell(text: str) -> str:
    return text.replace("%%", "%").replace("|", "\\|")


def flag_table(parser: argparse.ArgumentParser, title: str) -> str:
    # argparse has no public accessor for groups; vLLM's `--help=<group>` reads the same attribute.
    group = next(g for g in parser._action_groups if g.title == title)
    rows = [f"| Group `{title}` | Meaning | Default |", "|---|---|---|"]
    for action in sorted(group._group_actions, key=lambda a: max(a.option_strings, key=len)):
        default = "unset" if action.default is None else f"`{action.default}`"
        rows.append(f"| `{_flag(action)}` | {_cell(action.help or '')} | {default} |")
    return "\n".join(rows)


def render(parser: argparse.ArgumentParser) -> str:
    return "\n\n".join([BEGIN, *(flag_table(parser, title) for title in GROUPS), END])


def update(text: str, parser: argparse.ArgumentParser) -> str:
    """`text` with the generated block replaced by what the parser says now."""
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest:
        raise ValueError(f"no {BEGIN!r} marker in the page")
    return head + render(parser) + tail


def serve_parser() -> argparse.ArgumentParser:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_omni.entrypoints.cli.serve import make_omni_arg_parser

    return make_omni_arg_parser(FlexibleArgumentParser())


if __name__ == "__main__":
    page = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/cli.md")
    page.write_text(update(page.read_text(), serve_parser()))
