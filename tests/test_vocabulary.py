"""No tracked text file speaks of how the project was made, only of what it is.

A figure carries the date, the machine and the command that made it; a behaviour is stated as what the code does
and why; another project's tracker is cited as ``owner/repo#N`` (``vllm-project/vllm#12699``). What a reader cannot
use is flagged: work-session, issue and stop numbers, internal goals (a bench states measurements), "the default
since ...", "last passed at <commit>", and file names tagged with a session. Every tracked file is read (binary
files skipped; a JSON file's numbers cannot match, its keys and text fields are checked like any text).
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# An external project's tracker: ``owner/repo`` right before the number (``huggingface/trl#4159``,
# ``huggingface/transformers issue 46516``).
EXTERNAL = re.compile(r"[\w.-]+/[\w.-]+\s*$")


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: re.Pattern
    external_ok: bool = False  # a match right after ``owner/repo`` cites another project: not a hit


def _rule(name: str, pattern: str, external_ok: bool = False) -> Rule:
    return Rule(name, re.compile(pattern, re.IGNORECASE), external_ok)


RULES = (
    _rule("a work session's number", r"\bsessions?[ -]\d+"),
    _rule("a work session", r"\b(?:this|that|the previous|a previous|an earlier|a later) session\b"
                            r"|\bthe session (?:that|which) (?:built|made|wrote|added|measured|ran)\b"),
    _rule("this project's issue by number", r"\bissues?[ -]#?\d+", external_ok=True),
    _rule("this project's issue", r"\bissue's\b|\b(?:the|this|that)(?: [\w-]+)? issue (?:asks|asked|calls for)\b"),
    _rule("a work stop's number", r"\bstop \d+\b"),
    # "turn" is the product's word for a chat turn ("an image in turn 1", "the previous turn's tokens"); only
    # a turn that did work (built, measured, ...) or that time is counted from is a work session.
    _rule("a work turn", r"\b(?:since|during|until|as of) (?:this|that|the last|the previous|an earlier|a later)"
                         r" turn\b|\b(?:built|added|fixed|measured|written|changed|landed) (?:in )?(?:this|that"
                         r"|the previous|an earlier|a later) turn\b"),
    _rule("an internal goal", r"\bgoals?_\w+|\b\w+_goals?\b|\b\w+'s goals?\b"
                              r"|\bgoals?\b[^\n]{0,40}?(?:[<>≤≥]=?\s*\d|\d+(?:\.\d+)?\s*(?:x|%)|\bmet\b)"
                              r"|\d+(?:\.\d+)?\s*(?:x|%) goal\b|\b(?:against|under|over|above|below|within) the goals?\b"
                              r"|\bthe goals? (?:is|are|was|were) (?:stated|written|set)\b"),
    _rule("history", r"\bthe default since\b|\blast passed (?:at|on|in)\b|\b(?:device|machine)(?:'s)? time\b"),
)

# A tracker reference ``<prefix>#N``: only ``owner/repo#N`` says whose tracker it is.
TRACKER = re.compile(r"([\w./-]*)#\d+\b")
OWNER_REPO = re.compile(r"[\w.-]+/[\w.-]+")
# A file named for the session that made it (``long-default-xeon-s13.md``): a file is named for its content, its
# date and its machine.
SESSION_TAGGED_NAME = re.compile(r"-s\d{1,3}\.[a-z]+$|session[-_]?\d", re.IGNORECASE)

# path -> why it may say what the rules flag. This file spells the rules and plants examples of them.
ALLOWED = {
    "tests/test_vocabulary.py": "the checker itself: its patterns and planted examples",
}


def hits_in_text(text: str) -> list[tuple[int, str, str]]:
    """(line number, rule, matched text) of every place ``text`` speaks of how the project was made."""
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        for rule in RULES:
            for m in rule.pattern.finditer(line):
                if rule.external_ok and EXTERNAL.search(line[: m.start()]):
                    continue
                out.append((no, rule.name, m.group(0)))
        for m in TRACKER.finditer(line):
            if not OWNER_REPO.fullmatch(m.group(1)):
                out.append((no, "a tracker reference not written owner/repo#N", m.group(0)))
    return out


def tracked_files() -> list[str]:
    proc = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return sorted(p for p in proc.stdout.decode().split("\0") if p)


def read_text(path: Path) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    data = path.read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def vocabulary_hits(paths: list[str], root: Path = ROOT) -> list[str]:
    """``path:line: rule: 'text'`` for each hit in ``paths`` (relative to ``root``)."""
    out = []
    for rel in paths:
        if rel in ALLOWED:
            continue
        if SESSION_TAGGED_NAME.search(Path(rel).name):
            out.append(f"{rel}: a file name tagged with a work session")
        path = root / rel
        if not path.is_file():  # deleted in the work tree, not yet in the index
            continue
        text = read_text(path)
        if text is not None:
            out += [f"{rel}:{no}: {rule}: {found!r}" for no, rule, found in hits_in_text(text)]
    return out


def test_no_tracked_file_speaks_of_how_the_project_was_made():
    files = tracked_files()
    assert len(files) > 100 and "README.md" in files, "git ls-files did not list the repository"
    hits = vocabulary_hits(files)
    assert not hits, (f"{len(hits)} place(s) speak of how the project was made (state what the code does and why; "
                      "a figure's date, machine and command; owner/repo#N for another project's tracker):\n"
                      + "\n".join(hits))


@pytest.mark.parametrize("text", [
    "Measured in session 12 on the Xeon.",
    "sessions 13-20 rewrote the kernel",
    "Against issue 24's goals (>= 15x hf-sequential)",
    "agents on the unsloth backend (issue 13)",
    "Rules another part of issue 25 makes true",
    "see the closing note of issue 24",
    "The issue asks for decode attention that reads the pool",
    "the issue's criteria, per engine path",
    "built at stop 4",
    "GOAL_RATIO = 1.15",
    '"goal_ratio": 1.5,',
    "decode tok/s at 256 / at 2048 = 1.40x (goal <= 1.5x)",
    "| measurement | ms | ratio | goal <= 1.15 |",
    "the default since session 20",
    "tests last passed at c5ef197",
    "which since this session also runs the steps over GRPO prompt entries",
    "the machine of the session that built it had no device time left",
    "built after that machine's time was spent",
    "measured this turn on two cores",
    "no pixel_values per request; transformers#46516",
    "a known VLM problem: vllm#12699",
    "fixed in #31",
])
def test_the_checker_flags_history(text):
    assert hits_in_text(text), text


@pytest.mark.parametrize("text", [
    "a multi-turn agent whose every turn comes from the engine",
    "multi-turn VLM trajectories (an image in turn 1, a tool-returned image in turn 3)",
    "each turn continues the previous turn's exact tokens; then this turn",
    "a known VLM problem: vllm-project/vllm#12699, NVIDIA-NeMo/RL#793",
    "huggingface/transformers issue 46516 keeps continuous batching text-only",
    "@pytest.fixture(scope=\"session\")",
    "a session is an API key; an ended session's key is refused (401)",
    "the backward then stops 10 layers down",
    "stop strings and stop token ids end a sample",
    'color=["#d9822b", "#4c72b0"]',
    "2026-12-05, 2 Intel Xeon cores, `python -m unsloth_rollout.bench --workload long`: 1.40x",
    "decode tok/s at 256 / at 2048 = 1.40x; a step that only adds one pass over the extra KV would be 1.16x",
])
def test_the_checker_passes_the_product_s_own_words(text):
    assert not hits_in_text(text), hits_in_text(text)


@pytest.mark.parametrize("name, tagged", [
    ("long-default-xeon-s13.md", True),
    ("captured-2026-12-05-s20.json", True),
    ("notes-session-12.md", True),
    ("long-default-2026-12-04-xeon.md", False),
    ("captured-2026-12-05-xeon-units-of-4.json", False),
    ("agent_server.py", False),
])
def test_the_checker_reports_file_and_line(tmp_path, name, tagged):
    """A planted file: its name when session-tagged, each hit by line; a binary file's bytes are not read."""
    (tmp_path / name).write_text("A figure: 2026-12-05, Intel Xeon.\n\nMeasured in session 12.\n")
    (tmp_path / "plot.png").write_bytes(b"\x89PNG\0session 12\n")
    hits = vocabulary_hits([name, "plot.png"], root=tmp_path)
    assert hits == [f"{name}: a file name tagged with a work session"] * tagged + [
        f"{name}:3: a work session's number: 'session 12'"], hits
