"""A stand-in for ``tree --charset=ASCII --noreport -a -v -F -f -l -L N ROOT``, the only form
debug-gym's ``listdir`` uses: full paths, ``/`` after directories, ``*`` after executables.

``venv.write_tree_shim`` copies this file, with a ``python3`` shebang, to ``tree`` in the venv's
shim directory; it runs under whatever ``python3`` debug-gym's terminal finds first, so it uses
the standard library only.
"""

from __future__ import annotations  # any python3 >= 3.7 runs it

import os
import re
import sys


def main(argv: list[str]) -> int:
    depth, root = 1, "."
    it = iter(argv)
    for a in it:
        if a == "-L":
            depth = int(next(it))
        elif not a.startswith("-"):
            root = a
    if not os.path.isdir(root):
        print(f"{root} [error opening dir]")
        return 2
    print(root)
    walk(root, "", 1, depth)
    return 0


def key(name: str) -> list[int | str]:
    """Natural order (``tree -v``): digit runs compare as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def walk(path: str, prefix: str, level: int, depth: int) -> None:
    names = sorted(os.listdir(path), key=key)
    for i, name in enumerate(names):
        last = i == len(names) - 1
        full = os.path.join(path, name)
        mark = "/" if os.path.isdir(full) else ("*" if os.access(full, os.X_OK) else "")
        print(f"{prefix}{'`-- ' if last else '|-- '}{full}{mark}")
        if mark == "/" and level < depth:
            walk(full, prefix + ("    " if last else "|   "), level + 1, depth)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
