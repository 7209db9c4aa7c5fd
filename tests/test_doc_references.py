"""What the documents name exists: every repository path, ``python -m`` module, ``unsloth_rollout.*`` name,
console command, subcommand and CLI flag in README.md, docs/ and the benchmark READMEs.

Paths are looked up on disk (from the repository root; a benchmark README's own relative paths from its folder;
``tests/x.py::name`` needs ``def name`` there), a path written relative to the package (``engine/core.py``) is
refused, ``python -m`` modules must be found by ``importlib.util.find_spec``, and flags are looked up in the
command's own ``argparse`` parser, captured as the command builds it (``parse_args`` is intercepted before it
parses anything), so a renamed flag fails here the day it is renamed. AReaL's ``key=value`` overrides are looked up
in the config dataclass; pytest's ``-m`` markers in pyproject.toml; a shell script's flags in its source; links
to ``#anchors`` in the target's headings.

The checker is one function over a document's text, so the mutation check is a test too: planted bad
references must each be reported, and well-formed ones must not.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import glob
import importlib.util
import itertools
import pathlib
import re
import runpy
import shlex
import sys
import tomllib
import typing

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted({ROOT / "README.md", *ROOT.glob("docs/**/*.md"), ROOT / "benchmarks" / "README.md",
               *ROOT.glob("benchmarks/*/README.md"), ROOT / "benchmarks" / "cpu" / "captured.md"})
TOP_DIRS = (".ci", "benchmarks", "docs", "examples", "patches", "requirements", "scripts", "tests", "unsloth_rollout")
ROOT_FILES = ("README.md", "RELIABILITY.md", "pyproject.toml")
PACKAGE = ROOT / "unsloth_rollout"
# Package folders whose names are nobody else's: ``engine/x.py`` can only mean unsloth_rollout/engine/x.py.
PACKAGE_ONLY_DIRS = ("bench", "engine", "kernels", "models", "serve", "testing")
# Paths that commands write and git ignores (named in the docs as where output goes).
GENERATED = ("benchmarks/gpu/out", "benchmarks/gpu/wheels")
# Flags of other tools that the docs name on their own (not after one of this repository's commands).
EXTERNAL_FLAGS = {
    "--no-deps": "pip", "--nproc-per-node": "torchrun", "--durations": "pytest", "-m": "pytest", "-k": "pytest",
    "--enable-lora": "vLLM (the serve command accepts it too)",
}
# The package's own command lines: their flags are what a flag named on its own must be one of.
PACKAGE_CLIS = ("unsloth_rollout.serve", "unsloth_rollout.bench", "unsloth_rollout.bench.captured",
                "unsloth_rollout.bench.real_rl", "unsloth_rollout.testing.tiny", "unsloth_rollout.testing.real",
                "unsloth_rollout.trl.toy")

PATH_RE = re.compile(r"(?<![\w./~$-])((?:\.ci|\.?[\w-]+)(?:/[\w.{},*-]*)+(?:::\w+)?)")
DOTTED_RE = re.compile(r"(?<![\w.])unsloth_rollout(?:\.\w+)+")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN_RE = re.compile(r"`([^`\n]+)`")
ENV_RE = re.compile(r"^[A-Z_][A-Z0-9_]*=")
SEPARATORS = {"&&", "||", ";", "|"}


UNAVAILABLE = argparse.ArgumentParser(prog="needs an optional package that is not installed")


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


@contextlib.contextmanager
def _intercept_parse_args():
    def capture(self, *args, **kwargs):
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved


@functools.lru_cache(maxsize=None)
def command_parser(target: str) -> argparse.ArgumentParser | None:
    """The parser a module (``python -m target``) or a script path builds, captured as it would parse ``--help``;
    None when it builds none (a script without argparse is not run)."""
    script = ROOT / target if target.endswith(".py") else None
    if script is not None and "ArgumentParser" not in script.read_text():
        return None
    argv = sys.argv
    sys.argv = [target, "--help"]
    try:
        with _intercept_parse_args():
            if script is not None:
                runpy.run_path(str(script), run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=False)
    except _Captured as c:
        return c.parser
    except SystemExit:
        return None
    except ModuleNotFoundError as e:  # an optional integration (areal, trl, ...) that is not installed here
        if (e.name or "").startswith("unsloth_rollout"):
            raise
        return UNAVAILABLE
    finally:
        sys.argv = argv
    return None


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def script_flags(script: str, parser: argparse.ArgumentParser) -> set[str]:
    """A script's flags: its own parser's, and AReaL's ``--config`` when it also hands its arguments to AReaL's
    config loader (which builds a parser of its own after the script's)."""
    return option_strings(parser) | ({"--config"} if "load_expr_config" in (ROOT / script).read_text() else set())


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return {name: sub for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            for name, sub in a.choices.items()}


@functools.lru_cache(maxsize=None)
def all_package_flags() -> frozenset[str]:
    flags = set(EXTERNAL_FLAGS)
    scripts = [p.relative_to(ROOT).as_posix() for p in sorted(ROOT.glob("benchmarks/**/*.py"))]
    for target in (*PACKAGE_CLIS, *scripts):
        parser = command_parser(target)
        if parser is not None and parser is not UNAVAILABLE:
            flags |= option_strings(parser)
    return frozenset(flags)


@functools.lru_cache(maxsize=None)
def pytest_markers() -> frozenset[str]:
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    return frozenset(m.split(":")[0].strip() for m in markers)


@functools.lru_cache(maxsize=None)
def areal_config_fields():
    """``{dotted field path}`` of the AReaL GRPO config the ``unsloth_rollout.areal.grpo`` script loads."""
    from unsloth_rollout.areal.grpo import UnslothGRPOConfig

    out: set[str] = set()

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out.add(prefix + f.name)
            t = hints.get(f.name)
            for arg in (typing.get_args(t) or (t,)):
                if dataclasses.is_dataclass(arg):
                    walk(arg, prefix + f.name + ".")

    walk(UnslothGRPOConfig, "")
    return frozenset(out)


# ------------------------------------------------------------------------------------------------ paths


def _expand(pattern: str) -> list[str]:
    """Brace alternatives (``bench.{json,md}``) expanded; each must exist on its own."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def path_problem(token: str, doc: pathlib.Path) -> str | None:
    token = token.rstrip(".,;:)")
    path, _, test_name = token.partition("::")
    if "/" not in path or path.startswith(("/", "~")):
        return None
    first = path.split("/")[0]
    if first in TOP_DIRS:
        base = ROOT
    elif doc.parent != ROOT and (doc.parent / first).is_dir():
        base = doc.parent
    elif first in PACKAGE_ONLY_DIRS or (first in ("areal", "trl") and (PACKAGE / path.rstrip("/*")).exists()):
        return f"{token}: a path relative to the package; write it from the repository root (unsloth_rollout/{path})"
    else:
        return None  # not a path of this repository (another project's file, a MIME type, a ratio)
    rel = (base / path).resolve().relative_to(ROOT).as_posix() if (base / path).resolve().is_relative_to(ROOT) \
        else path
    if rel.startswith(GENERATED):
        return None
    for each in _expand(path):
        found = glob.glob(str(base / each)) if "*" in each else ([str(base / each)] if (base / each).exists() else [])
        if not found and not each.endswith("/"):  # an output prefix (``--out DIR/name`` writes name.json, .png)
            found = glob.glob(str(base / each) + ".*")
        if not found:
            return f"{token}: no such path"
    if test_name:
        if not re.search(rf"^\s*(async )?def {re.escape(test_name)}\(|^class {re.escape(test_name)}\b",
                         (base / path).read_text(), re.M):
            return f"{token}: {path} has no {test_name}"
    return None


def _github_anchors(text: str) -> set[str]:
    body = FENCE_RE.sub("", text)
    out = set()
    for m in re.finditer(r"^#+\s+(.*)$", body, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
        out.add(slug)
    return out


def link_problem(target: str, doc: pathlib.Path) -> str | None:
    if "://" in target or target.startswith("mailto:"):
        return None
    path, _, anchor = target.partition("#")
    file = (doc.parent / path) if path else doc
    if path and not file.exists():
        return f"link {target}: no such file"
    if anchor and file.suffix == ".md" and anchor not in _github_anchors(file.read_text()):
        return f"link {target}: {file.relative_to(ROOT)} has no heading #{anchor}"
    return None


# ---------------------------------------------------------------------------------------- python names


def _module_file(parts: list[str]) -> pathlib.Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _top_level_names(file: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):  # lazy exports (__getattr__)
                names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
    return names


def dotted_problem(name: str) -> str | None:
    """``unsloth_rollout.a.b.c``: the longest prefix that is a module of the package, then a name it defines."""
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        file = _module_file(parts[:k])
        if file is not None:
            break
    else:
        return f"{name}: no such module"
    if k == len(parts):
        return None
    attr = parts[k]
    if attr in _top_level_names(file):
        return None
    return f"{name}: {'.'.join(parts[:k])} defines no {attr}"


# ------------------------------------------------------------------------------------------------ commands


def _tokens(line: str) -> list[str]:
    try:
        return shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote in an inline span: fall back to words
        return line.split()


def command_lines(code: str) -> list[list[str]]:
    """Each command in a code block or span, as tokens: continuations joined, comments dropped, split at
    ``&&`` / ``||`` / ``;`` / ``|``, leading ``NAME=value`` environment settings dropped."""
    out = []
    for line in code.replace("\\\n", " ").split("\n"):
        toks = [t.strip("[]") for t in _tokens(line)]
        for sep, group in itertools.groupby(toks, lambda t: t in SEPARATORS):
            group = list(group)
            while group and ENV_RE.match(group[0]):
                group.pop(0)
            if not sep and group:
                out.append(group)
    return out


def _flag(token: str) -> str | None:
    if not token.startswith("-") or re.fullmatch(r"-[\d.e-]+", token) or token in ("-", "--"):
        return None
    return token.split("=", 1)[0]


def flags_problems(what: str, args: list[str], known: set[str]) -> list[str]:
    return [f"{what}: no flag {f}" for f in filter(None, map(_flag, args)) if f not in known]


def module_problems(module: str, args: list[str]) -> list[str]:
    if module == "pytest":
        return pytest_problems(args)
    if module.startswith("unsloth_rollout"):
        if _module_file(module.split(".")) is None:
            return [f"python -m {module}: no such module"]
    elif importlib.util.find_spec(module.split(".")[0]) is None:
        return []  # another project's module that is not installed here: nothing to check against
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError as e:  # finding it imports its package, which needs an optional integration
        if (e.name or "").startswith("unsloth_rollout"):
            raise
        return []
    if spec is None:
        return [f"python -m {module}: no such module"]
    if module == "unsloth_rollout.areal.launch":
        from unsloth_rollout.areal.launch import LAUNCHERS

        if not args or args[0] not in LAUNCHERS:
            return [f"python -m {module}: the first argument is one of {LAUNCHERS}"]
        return module_problems("unsloth_rollout.areal.grpo", args[2:])
    if not module.startswith("unsloth_rollout"):
        return []
    parser = command_parser(module)
    if parser is UNAVAILABLE:
        return []
    if parser is None:
        return [f"python -m {module}: builds no argparse parser to check {args}"] if any(map(_flag, args)) else []
    out = flags_problems(f"python -m {module}", args, option_strings(parser))
    if module == "unsloth_rollout.areal.grpo":
        fields = areal_config_fields()
        out += [f"python -m {module}: the config has no field {t.split('=')[0]}" for t in args
                if re.fullmatch(r"[a-z_][\w.]*=\S*", t) and t.split("=")[0] not in fields]
    return out


def pytest_problems(args: list[str]) -> list[str]:
    out = []
    for flag, value in zip(args, args[1:]):
        if flag == "-m":
            out += [f"pytest -m {value!r}: no marker {m}" for m in re.findall(r"[A-Za-z_]\w*", value)
                    if m not in ("and", "or", "not") and m not in pytest_markers()]
    return out


def command_problems(toks: list[str]) -> list[str]:
    head = toks[0].rsplit("/", 1)[-1]
    if head in ("python", "python3") and len(toks) > 2 and toks[1] == "-m":
        return module_problems(toks[2], toks[3:])
    if head in ("python", "python3") and len(toks) > 1 and toks[1].endswith(".py"):
        script = toks[1]
        if not (ROOT / script).exists() or not any(map(_flag, toks[2:])):
            return []  # the path rule reports a missing script
        parser = command_parser(script)
        if parser is UNAVAILABLE:
            return []
        if parser is None:
            return [f"{script}: takes no flags ({toks[2:]})"]
        return flags_problems(script, toks[2:], script_flags(script, parser))
    if head == "torchrun" and "-m" in toks:
        i = toks.index("-m")
        return module_problems(toks[i + 1], toks[i + 2:]) if i + 1 < len(toks) else []
    if head == "pytest":
        return pytest_problems(toks[1:])
    if head in ("bash", "sh") and len(toks) > 1 and toks[1].endswith(".sh") and (ROOT / toks[1]).exists():
        source = (ROOT / toks[1]).read_text()
        return [f"{toks[1]}: no flag {f}" for f in filter(None, map(_flag, toks[2:])) if f not in source]
    if head == "unsloth-rollout":
        scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
        if scripts.get("unsloth-rollout") != "unsloth_rollout.cli:main":
            return ["unsloth-rollout: pyproject.toml does not point it at unsloth_rollout.cli:main"]
        from unsloth_rollout.cli import build_parser

        subs = subcommands(build_parser())
        if len(toks) < 2 or toks[1] not in subs:
            return [f"unsloth-rollout {toks[1] if len(toks) > 1 else ''}: no such subcommand (has {sorted(subs)})"]
        return flags_problems(f"unsloth-rollout {toks[1]}", toks[2:], option_strings(subs[toks[1]]))
    return []


# ------------------------------------------------------------------------------------------------ one document


def problems(text: str, doc: pathlib.Path) -> list[str]:
    """Every reference in ``text`` (a document at ``doc``) that does not exist, one line each."""
    out = []
    for m in PATH_RE.finditer(text):
        out.append(path_problem(m.group(1), doc))
    for m in LINK_RE.finditer(text):
        out.append(link_problem(m.group(1), doc))
    for m in DOTTED_RE.finditer(text):
        out.append(dotted_problem(m.group(0)))
    blocks = [m.group(1) for m in FENCE_RE.finditer(text)]
    spans = [m.group(1) for m in SPAN_RE.finditer(FENCE_RE.sub("", text))]
    for code in blocks + spans:
        for toks in command_lines(code):
            out += command_problems(toks)
    for span in spans:  # a flag named on its own must be one of the package's commands' (or a named tool's)
        flag = _flag(span.split()[0]) if span.split() else None
        if flag is not None and flag not in all_package_flags():
            out.append(f"{span}: no command here has the flag {flag}")
    return sorted({p for p in out if p})


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_reference_in_the_document_exists(doc):
    assert problems(doc.read_text(), doc) == []


PLANTED = [
    ("`unsloth_rollout/engine/no_such_step.py`", "no such path"),
    ("see docs/no-such-page.md for more", "no such path"),
    ("the step is in `engine/core.py`", "relative to the package"),
    ("`tests/test_docs.py::test_no_such_test`", "has no test_no_such_test"),
    ("`benchmarks/cpu/bench.{json,nope}`", "no such path"),
    ("[install](#no-such-heading)", "has no heading"),
    ("[the manual](docs/no-such-manual.md)", "no such file"),
    ("`python -m unsloth_rollout.no_such_module --x 1`", "no such module"),
    ("`unsloth_rollout.serve.no_such_app(engine)`", "defines no no_such_app"),
    ("```bash\nunsloth-rollout serve ./model --backend auto\n```", "no flag --backend"),
    ("```bash\nunsloth-rollout train ./model\n```", "no such subcommand"),
    ("```bash\nHF_HUB_OFFLINE=1 python -m unsloth_rollout.bench --workloads long \\\n    --repeats 3\n```",
     "no flag --workloads"),
    ("`python -m unsloth_rollout.areal.grpo --config x.yaml rollout.backends=unsloth:d2`", "no field rollout.backends"),
    ("`pytest -m smokey tests/test_families.py`", "no marker smokey"),
    ("`--no-such-flag 3`", "has the flag --no-such-flag"),
]
WELL_FORMED = [
    "`unsloth_rollout/engine/core.py`, `tests/test_docs.py::test_docs_name_no_files_outside_the_repo`",
    "`benchmarks/cpu/bench.{json,md,png}` and [the README](README.md#install-on-cpu)",
    "TRL's `trl/generation/vllm_client.py`, Unsloth's `unsloth/models/llama.py`, image/png, 1/2",
    "`unsloth_rollout.serve.create_app(engine)`, `unsloth_rollout.testing.tiny.tiny_model_path`",
    "```bash\nPYTHONPATH=$PWD python -m unsloth_rollout.bench --workload long --backends auto \\\n"
    "    --json benchmarks/cpu/long.json && unsloth-rollout serve ./m --port 8000 --lora a=b\n```",
    "`python -m unsloth_rollout.areal.grpo --config examples/quickstart_areal.yaml rollout.backend=unsloth:d2`",
    "`python -m pytest -q -m \"not slow\"`, `--max-lora-rank`",
]


@pytest.mark.parametrize("text,expected", PLANTED, ids=[e for _, e in PLANTED])
def test_a_planted_bad_reference_is_reported(text, expected):
    found = problems(text, ROOT / "README.md")
    assert any(expected in p for p in found), found


@pytest.mark.parametrize("text", WELL_FORMED)
def test_well_formed_references_pass(text):
    assert problems(text, ROOT / "README.md") == []
