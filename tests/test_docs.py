"""The published reliability figures are the recorded JSONs, rendered by the named script (never typed by hand)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_reliability_tables_match_the_recorded_json():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "reliability_report.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_docs_name_no_files_outside_the_repo():
    docs = [ROOT / "README.md", ROOT / "RELIABILITY.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/**/*.md"),
            *ROOT.glob("examples/**/*.md")]
    for doc in docs:
        text = doc.read_text()
        assert "../shared" not in text and "/work/" not in text, doc


def test_readme_is_a_front_door():
    """At most 250 lines, and its first screen links the GPU install, the four quick starts and the refusals table
    (tests/test_doc_references.py checks that each link's heading exists)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    first_screen = "\n".join(text.splitlines()[:30])
    for anchor in ("#install-on-a-gpu", "#quick-start-python-api", "#quick-start-trl-grpotrainer",
                   "#quick-start-areal", "#quick-start-server", "#what-is-refused-and-why"):
        assert f"]({anchor})" in first_screen, anchor
