"""Run the manual's shell blocks as written: every ```bash block of README.md and docs/*.md that the page marks
`<!-- docs-check: run -->` (on the line before the fence), in page order, from the repository root, with bash's
`-e -u -o pipefail`; blocks marked `<!-- docs-check: skip: WHY -->` (a GPU, several machines, the test suite
itself, hours) are listed with their reason. Every bash block carries one of the two marks (tests/test_docs.py).

    .venv/bin/python scripts/docs_check.py            # after `make setup`; README first, then docs/ by name
    .venv/bin/python scripts/docs_check.py docs/plan.md --timeout 600

Exit status 1 when a block fails, naming the page and line.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = re.compile(r"^<!-- docs-check: (run|skip: (?P<why>.+?)) -->\s*$")
FENCE = re.compile(r"^```(bash|sh|shell)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int            # of the fence's first command
    text: str
    mark: str | None     # "run", "skip", or None (unmarked)
    why: str = ""


def blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        if FENCE.match(lines[index]):
            mark = MARK.match(lines[index - 1]) if index else None
            end = next(i for i in range(index + 1, len(lines)) if lines[i].startswith("```"))
            kind = None if mark is None else ("run" if mark.group(1) == "run" else "skip")
            found.append(Block(page, index + 2, "\n".join(lines[index + 1:end]), kind,
                               (mark.group("why") or "") if mark else ""))
            index = end
        index += 1
    return found


def pages(root: Path = REPO) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def run_block(block: Block, cwd: Path, timeout: float) -> tuple[bool, float, str]:
    started = time.perf_counter()
    try:
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text], cwd=cwd, capture_output=True, text=True,
                              timeout=timeout)
        ok, output = done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        ok, output = False, f"timed out after {timeout:g} s"
    return ok, time.perf_counter() - started, output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", type=Path, help="pages to check (default: README.md, then docs/*.md)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per block")
    parser.add_argument("--root", type=Path, default=REPO, help="the checkout to run in")
    ns = parser.parse_args(argv)
    failed = 0
    for page in ns.pages or pages(ns.root):
        for block in blocks(page):
            where = f"{page.relative_to(ns.root) if page.is_relative_to(ns.root) else page}:{block.line}"
            if block.mark != "run":
                print(f"skip  {where}  ({block.why or 'not marked'})", flush=True)
                continue
            ok, seconds, output = run_block(block, ns.root, ns.timeout)
            print(f"{'pass' if ok else 'FAIL'}  {where}  {seconds:,.0f} s", flush=True)
            if not ok:
                failed += 1
                print("\n".join("    " + line for line in output.splitlines()), flush=True)
    print(f"{failed} block(s) failed" if failed else "every block marked run passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
