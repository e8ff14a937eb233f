"""The manual's shell blocks: each marked to run or skip (with why), and the runner that runs them as written
(`make docs-check`, scripts/docs_check.py)."""

from __future__ import annotations

import sys

from launch import REPO

sys.path.insert(0, str(REPO / "scripts"))
import docs_check  # noqa: E402


def test_every_shell_block_of_the_manual_is_marked_to_run_or_to_skip_with_a_reason():
    unmarked = [f"{b.page.relative_to(REPO)}:{b.line}" for page in docs_check.pages() for b in docs_check.blocks(page)
                if b.mark is None or (b.mark == "skip" and not b.why)]
    assert not unmarked, f"add <!-- docs-check: run --> or <!-- docs-check: skip: WHY --> before: {unmarked}"
    assert sum(b.mark == "run" for page in docs_check.pages() for b in docs_check.blocks(page)) >= 20


def test_the_runner_runs_marked_blocks_in_order_and_names_a_failing_one(tmp_path, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("<!-- docs-check: run -->\n```bash\necho one > made.txt\n```\n")
    (tmp_path / "docs" / "a.md").write_text(
        "text\n<!-- docs-check: run -->\n```bash\ngrep -q one made.txt\nfalse | cat\n```\n"
        "<!-- docs-check: skip: a GPU -->\n```bash\nexit 1\n```\n")
    assert docs_check.main(["--root", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "pass  README.md:3" in out and "FAIL  docs/a.md:4" in out and "skip  docs/a.md:9  (a GPU)" in out
    (tmp_path / "docs" / "a.md").write_text("<!-- docs-check: run -->\n```bash\ngrep -q one made.txt\n```\n")
    assert docs_check.main(["--root", str(tmp_path)]) == 0
