"""Make the file names of a PTX line table independent of where the build ran (run as a script by ninja).

``python ptx_lines.py IN OUT INCLUDE_DIR`` copies the PTX ``IN`` to ``OUT``, rewriting each ``.file`` directive
that nvcc wrote with an absolute path:
- the build folder (the current directory) is dropped: ``kernel.cu``;
- ``INCLUDE_DIR`` (flashgen's header tree) is dropped: ``flashgen/common/vec.cuh``;
- the CUDA toolkit's headers (``<toolkit>/targets/<triple>/include/...``) become ``cuda/include/...``.
Other paths are kept. ptxas copies these names into the cubin's line table (``-lineinfo``), so with them a
kernel compiles to the same bytes from any cache folder, checkout or toolkit location; profilers find the
sources relative to the cache entry and the include folder.

It runs as a plain script (the standard library only), so the build does not depend on how flashgen was
imported.
"""

from __future__ import annotations

import os
import re
import sys

_FILE = re.compile(r'^(\s*\.file\s+\d+\s+")([^"]*)(")', re.MULTILINE)
_TOOLKIT = re.compile(r"^.*/targets/[^/]+/include/")


def relocate(path: str, build_dir: str, include_dir: str) -> str:
    """The deterministic name for one ``.file`` path."""
    for prefix in (build_dir.rstrip("/") + "/", include_dir.rstrip("/") + "/"):
        if path.startswith(prefix):
            return path[len(prefix):]
    return _TOOLKIT.sub("cuda/include/", path)


def relocate_ptx(text: str, build_dir: str, include_dir: str) -> str:
    return _FILE.sub(lambda m: m.group(1) + relocate(m.group(2), build_dir, include_dir) + m.group(3), text)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: ptx_lines.py IN OUT INCLUDE_DIR", file=sys.stderr)
        return 2
    source, target, include_dir = argv
    with open(source, encoding="utf-8") as f:
        text = f.read()
    with open(target, "w", encoding="utf-8") as f:
        f.write(relocate_ptx(text, os.getcwd(), include_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
