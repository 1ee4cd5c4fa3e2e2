"""Write (or check) the golden vector files in docs/vectors from the reference.

python tools/golden.py           # regenerate every file (saved caches in persistence/ too)
python tools/golden.py --check   # exit 1 if a committed file differs
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvspec.conformance.persistence_vectors import GOLDEN_FILES, golden_bytes, golden_path
from kvspec.conformance.vectors import BUILDERS, render, vector_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("names", nargs="*", help=f"files to handle: {', '.join(BUILDERS)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(BUILDERS))
    if unknown:
        parser.error(f"unknown vector files {unknown}; expected some of {sorted(BUILDERS)}")
    files = [(vector_path(n), render(BUILDERS[n]()).encode()) for n in args.names or BUILDERS]
    if not args.names:
        files += [(golden_path(name), golden_bytes(name)) for name in GOLDEN_FILES]
    stale = []
    for path, data in files:
        if args.check:
            if not path.exists() or path.read_bytes() != data:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            print(f"wrote {path} ({len(data)} bytes)")
    if stale:
        print("stale vector files (run tools/golden.py): " + ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
