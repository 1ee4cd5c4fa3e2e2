"""Measure the suite by generated faults: every operator of a few kinds in a module's code,
each swapped alone, run against named tests as tools/mutants.py runs its catalogue.

The catalogue's faults are chosen by someone who knows the code, which is their strength
and their bias; a sweep asks of every comparison, boolean, bound and off-by-one in a file
whether some test notices it changed. A fault is made of one code line that occurs once in
its file (not in a string, comment, import, signature, assertion or raise): the first match
of one operator on it, replaced (`OPERATORS`). A missed fault is a test to write, a fault
that changes nothing (an equivalent mutant: a default every caller overrides, a `strict=`
on lengths that always match) or one that only costs time; each needs a look.

    .venv/bin/python tools/mutant_sweep.py accelerated/attention_kernels.py \
        --tests conformance/test_read_launches.py conformance/test_kernels_emulated.py
    .venv/bin/python tools/mutant_sweep.py accelerated/caches/rotating.py --list

Prints a Markdown table of the missed faults and the count caught; `--json` writes every
fault's result. Exits 1 when a fault is missed or errs.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import tokenize
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from mutants import PROJECT, Mutant, run_tests

#: What a sweep swaps: a pattern and its replacement, the first match on a line.
OPERATORS: tuple[tuple[str, str], ...] = (
    (r" < ", " <= "),
    (r" <= ", " < "),
    (r" > ", " >= "),
    (r" >= ", " > "),
    (r" == ", " != "),
    (r" != ", " == "),
    (r" and ", " or "),
    (r" or ", " and "),
    (r"(?<!is )\bnot ", ""),
    (r"\bTrue\b", "False"),
    (r"\bFalse\b", "True"),
    (r"\bmin\(", "max("),
    (r"\bmax\(", "min("),
    (r" \+ 1\b", " - 1"),
    (r" - 1\b", " + 1"),
    (r" is None\b", " is not None"),
    (r" is not None\b", " is None"),
)
#: Lines that hold no behaviour a sweep should swap.
_SKIPPED_STARTS = ("import ", "from ", "def ", "class ", "@", "raise ", "assert ")


def _signature_lines(tree: ast.AST) -> set[int]:
    """Lines of function signatures (a default there is each caller's to override)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines.update(range(node.lineno, node.body[0].lineno))
    return lines


def _code_only(text: str) -> list[str]:
    """`text`'s lines with every string literal and comment blanked out (the same length, so
    a match's place is its place in the line): a sweep swaps code, not messages."""
    lines = [list(line) for line in text.splitlines(keepends=True)]
    blanked = {tokenize.STRING, tokenize.COMMENT}
    blanked |= {getattr(tokenize, name) for name in ("FSTRING_MIDDLE",) if hasattr(tokenize, name)}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in blanked:
            continue
        (first_row, first_col), (last_row, last_col) = token.start, token.end
        for row in range(first_row, last_row + 1):
            chars = lines[row - 1]
            start = first_col if row == first_row else 0
            end = last_col if row == last_row else len(chars)
            chars[start:end] = " " * (end - start)
    return ["".join(chars) for chars in lines]


def faults(path: str, tests: Sequence[str]) -> list[Mutant]:
    """Every fault of OPERATORS on `path`'s code lines, each named by its line."""
    text = (PROJECT / path).read_text()
    skipped = _signature_lines(ast.parse(text))
    made = []
    lines = text.splitlines(keepends=True)
    for number, (line, code) in enumerate(zip(lines, _code_only(text), strict=True), start=1):
        if number in skipped or not code.strip() or code.strip().startswith(_SKIPPED_STARTS):
            continue
        if text.count(line) != 1:
            continue
        for operator, (pattern, replacement) in enumerate(OPERATORS):
            found = re.search(pattern, code)
            if found is None:
                continue
            after = line[: found.start()] + replacement + line[found.end() :]
            # A name of word characters, dots and dashes: a run's copy is a directory named
            # after it, on the import path (where a colon would cut it).
            name = f"{path.replace('/', '.')}-L{number}-{operator}"
            fault = f"`{found.group().strip()}` -> `{replacement.strip() or '(none)'}`"
            made.append(Mutant(name, path, line, after, fault, tuple(tests)))
    return made


def project_path(given: str) -> str:
    """`given` (relative to the working directory or to the project) as the project's
    relative path of a Python file; ValueError for one outside it."""
    found = Path(given).resolve()
    if not found.is_file():
        found = (PROJECT / given).resolve()
    if not found.is_file() or found.suffix != ".py" or not found.is_relative_to(PROJECT):
        raise ValueError(f"{given} is not a Python file of the project ({PROJECT})")
    return found.relative_to(PROJECT).as_posix()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="modules, relative to the project")
    parser.add_argument("--tests", nargs="+", default=["conformance"], help="pytest's targets")
    parser.add_argument("--list", action="store_true", help="print the faults and exit")
    parser.add_argument("--profile", default="quick", help="hypothesis profile (default quick)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per fault")
    parser.add_argument("--json", help="write every fault and its result here")
    args = parser.parse_args(argv)
    try:
        paths = [project_path(given) for given in args.paths]
    except ValueError as error:
        parser.error(str(error))
    made = [mutant for path in paths for mutant in faults(path, args.tests)]
    if args.list:
        for mutant in made:
            print(f"{mutant.name}: {mutant.fault}: {mutant.before.strip()}")
        return 0
    results = []
    for mutant in made:
        result, seconds = run_tests(mutant, args.profile, args.timeout)
        print(f"{mutant.name}: {result} ({seconds:.0f} s)", file=sys.stderr)
        results.append((mutant, result, seconds))
    missed = [(mutant, result) for mutant, result, _ in results if result != "caught"]
    print(f"{len(results) - len(missed)} of {len(results)} caught")
    if missed:
        print("| fault | line | swap | result |\n|---|---|---|---|")
        for mutant, result in missed:
            print(f"| {mutant.name} | `{mutant.before.strip()}` | {mutant.fault} | {result} |")
    if args.json:
        rows = [{**asdict(m), "result": r, "seconds": round(s, 1)} for m, r, s in results]
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
