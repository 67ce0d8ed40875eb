"""The README and docs/results.md run as written.

* Every ```python block either runs on 4 local Gloo ranks under cerar's launcher (each with a
  check of what it prints) or starts with ``# not standalone: <reason>`` (an excerpt of an
  example names it: ``# not standalone (excerpt of examples/x.py): <reason>``, and its lines
  must be in that file). Every block parses, and every ``cerar.*`` name it uses exists and takes
  the keyword arguments it is given.
* Every command shown (```bash / ``` blocks, the README's commands table, inline ``cerar ...``,
  ``make ...`` and ``python -m ...`` spans) parses with the real parser: ``cerar SUB`` with
  ``cerar.cli.build_parser`` and then the config it builds (``cerar bench``, ``cerar train``),
  ``python -m cerar.harness.launch`` with its ``main``'s parser (and the command it launches),
  ``python X.py`` with the script's own argparse parser, ``torchrun`` with torch's; ``make X``
  must be a Makefile target and ``pip install`` pins must match pyproject.toml's. Placeholders
  (``NODE0``, ``M``, ``G``, ``k``) are substituted, ``[...]`` options are tried one at a time and
  ``a|b`` alternatives each.
* Inline ``cerar.*`` names and documented signatures match the code; relative links resolve.

Only the runnable blocks start processes (marked multirank); the rest takes a few seconds.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import inspect
import io
import math
import os
import re
import runpy
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
DOCS = (README, RESULTS, ROOT / "docs" / "guide.md", ROOT / "docs" / "internals.md")
WORLD = 4  # ranks the runnable blocks run on
#: What the commands' placeholders stand for (README: "node 0's address for NODE0", M nodes of G ranks).
PLACEHOLDERS = {"M": "4", "G": "2", "k": "0"}
NODE0 = "10.0.0.1"
NOT_STANDALONE = re.compile(r"# not standalone(?: \(excerpt of (?P<source>[^)\s]+)\))?: (?P<reason>\S.*)")


# ---------------------------------------------------------------------------------------------
# Reading the documents


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    text: str
    section: str  # the heading the block sits under

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line} ({self.section})"


def _blocks(doc: Path) -> list[Block]:
    blocks, section, lang, start, body = [], "", None, 0, []
    for number, line in enumerate(doc.read_text().splitlines(), start=1):
        if lang is None and line.startswith("```"):
            lang, start, body = line[3:].strip(), number, []
        elif lang is not None and line.startswith("```"):
            blocks.append(Block(doc, start, lang, "\n".join(body) + "\n", section))
            lang = None
        elif lang is not None:
            body.append(line)
        elif line.startswith("#"):
            section = line.lstrip("#").strip()
    assert lang is None, f"{doc}: unclosed code block at line {start}"
    return blocks


def _prose(doc: Path) -> str:
    """The document without its fenced blocks."""
    return re.sub(r"^```.*?^```[^\n]*$", "", doc.read_text(), flags=re.S | re.M)


def _inline_spans(doc: Path) -> list[str]:
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", _prose(doc))]


ALL_BLOCKS = [block for doc in DOCS for block in _blocks(doc)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang == "python"]
RUNNABLE = [b for b in PYTHON_BLOCKS if not b.text.startswith("# not standalone")]


def _block_id(block: Block) -> str:
    return f"{block.doc.name}:{block.line}"


# ---------------------------------------------------------------------------------------------
# Python blocks


def test_code_blocks_have_known_languages() -> None:
    for block in ALL_BLOCKS:
        assert block.lang in ("python", "bash", "", "text"), f"{block.where}: unknown block language {block.lang!r}"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_block_id)
def test_python_block_parses_and_names_exist(block: Block) -> None:
    tree = ast.parse(block.text, filename=block.where)
    _check_cerar_names(tree, block.where)


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if b not in RUNNABLE], ids=_block_id)
def test_not_standalone_block_says_why(block: Block) -> None:
    match = NOT_STANDALONE.fullmatch(block.text.splitlines()[0])
    assert match is not None, f"{block.where}: first line must be '# not standalone[ (excerpt of FILE)]: <reason>'"
    if match["source"]:
        source = ROOT / match["source"]
        assert source.is_file(), f"{block.where}: {match['source']} does not exist"
        lines = {_code_part(line) for line in source.read_text().splitlines()}
        for line in block.text.splitlines()[1:]:
            code = _code_part(line)
            assert not code or code in lines, f"{block.where}: {code!r} is not in {match['source']}"


def _code_part(line: str) -> str:
    """A line without its trailing comment and indentation (comments may differ from the source)."""
    return line.split("  # ")[0].strip()


def test_every_runnable_block_has_a_check() -> None:
    sections = [b.section for b in RUNNABLE]
    assert sorted(sections) == sorted(BLOCK_CHECKS), (
        f"runnable python blocks under {sections}, checks for {sorted(BLOCK_CHECKS)}: a new block needs a "
        "check in BLOCK_CHECKS, or a first line '# not standalone: <reason>'"
    )


@pytest.mark.multirank
@pytest.mark.parametrize("block", RUNNABLE, ids=_block_id)
def test_python_block_runs(block: Block, tmp_path: Path) -> None:
    script = tmp_path / "block.py"
    script.write_text(block.text)
    launcher = [sys.executable, "-m", "cerar.harness.launch", "-N", str(WORLD), "--timeout", "240", "--"]
    done = subprocess.run(
        [*launcher, sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    printed = [line.split("] ", 1)[1].split() for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(printed) == WORLD, done.stdout
    BLOCK_CHECKS[block.section](block.text, printed)


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    assert match is not None, f"the block no longer matches {pattern!r}: update its check"
    return int(match.group(1).replace("_", ""))


def _check_collective(text: str, printed: list[list[str]]) -> None:
    """bytes_sent is what the schedule predicts: L = c + N - 2 rounds of ceil(d / c) float32
    values (the handshake is not counted); the error is CERAR's, and differs on every rank."""
    assert "cerar.codes.optimized(N, 2 * N)" in text, "the figures below assume c = 2N"
    values = _number(r"torch\.randn\(([\d_]+)\)", text)
    c = 2 * WORLD
    rounds = c + WORLD - 2
    errors = set()
    for bytes_sent, rounds_run, error in printed:
        assert int(rounds_run) == rounds
        assert int(bytes_sent) == rounds * math.ceil(values / c) * 4
        assert 1e-6 < float(error) < 1e-3  # approximate, within choose()'s 1e-3 budget
        errors.add(error)
    assert len(errors) == WORLD, f"every rank's result should differ from the others': {printed}"


def _check_ddp(text: str, printed: list[list[str]]) -> None:
    """Every backward pass went through CERAR (the 4 MB bucket is above min_bucket_bytes), and the
    replicas differ, slightly, by the same measured divergence on every rank."""
    steps = _number(r"for _ in range\((\d+)\)", text)
    divergences = set()
    for calls, exact_buckets, divergence in printed:
        assert int(calls) >= steps and int(exact_buckets) == 0
        assert 0 < float(divergence) < 1e-3
        divergences.add(divergence)
    assert len(divergences) == 1, printed


def _check_clusters(text: str, printed: list[list[str]]) -> None:
    """G ranks per node, M = N / G nodes; between nodes each rank sends its shard's CERAR rounds:
    c + M - 2 rounds of ceil(ceil(d / G) / c) float32 values."""
    per_node = _number(r"\bG = (\d+)", text)
    values = _number(r"torch\.randn\(([\d_]+)\)", text)
    for nodes, c, bytes_sent in printed:
        assert int(nodes) == WORLD // per_node
        shard = math.ceil(values / per_node)
        assert int(bytes_sent) == (int(c) + int(nodes) - 2) * math.ceil(shard / int(c)) * 4


def _check_group(text: str, printed: list[list[str]]) -> None:
    """DDP's bucket went through CERAR on cerar's group; the MAX and the loss under cerar.exact()
    went to the exact group: every rank holds the exact values."""
    assert "min_bytes=1 << 20" in text and "torch.nn.Linear(1024, 1024)" in text  # a 4 MB bucket: coded
    for coded, flags, loss, bytes_sent in printed:
        assert int(coded) >= 1 and int(bytes_sent) > 0
        assert int(flags) == WORLD - 1
        assert float(loss) == sum(1.0 + r for r in range(WORLD))


#: The check of each runnable block, by the heading it sits under.
BLOCK_CHECKS: dict[str, Callable[[str, list[list[str]]], None]] = {
    "The collective": _check_collective,
    "DDP": _check_ddp,
    "A process group: DDP without a hook, FSDP2's HSDP, your own `all_reduce`": _check_group,
    "Clusters of nodes": _check_clusters,
}


# ---------------------------------------------------------------------------------------------
# cerar names and signatures


def _roots() -> dict[str, Any]:
    import cerar

    return {"cerar": cerar, "Code": cerar.Code, "CommStats": cerar.CommStats}


def _chain(node: ast.AST) -> list[str] | None:
    """``cerar.ddp.CerarState`` -> ``["cerar", "ddp", "CerarState"]``; None if not rooted at a known name."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in _roots() and parts:
        return [node.id, *reversed(parts)]
    return None


def _resolve(parts: list[str], where: str) -> tuple[Any, Any]:
    """The object a chain names and the object it was looked up on."""
    parent, obj = None, _roots()[parts[0]]
    for i, part in enumerate(parts[1:], start=1):
        assert hasattr(obj, part), f"{where}: {'.'.join(parts[: i + 1])} does not exist"
        parent, obj = obj, getattr(obj, part)
    return obj, parent


def _check_cerar_names(tree: ast.AST, where: str) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (parts := _chain(node)):
            _resolve(parts, where)
        if isinstance(node, ast.Call) and (parts := _chain(node.func)):
            function, parent = _resolve(parts, where)
            if not inspect.ismodule(parent):  # a method looked up on a class: no instance to bind
                continue
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                continue
            try:
                inspect.signature(function).bind(*node.args, **{k.arg: k.value for k in node.keywords})
            except TypeError as exc:
                pytest.fail(f"{where}: {ast.unparse(node)}: {exc}")


def _check_signature(span: str, where: str) -> None:
    """``cerar.f(a, b=1, *, c=None)`` as documented equals the real signature: names, kinds, defaults."""
    name, params = span.split("(", 1)
    documented = ast.parse(f"def _({params[:-1]}): pass").body[0].args  # type: ignore[attr-defined]
    function, _ = _resolve(name.split("."), where)
    real = inspect.signature(function).parameters.values()
    positional = documented.posonlyargs + documented.args
    pos_defaults = [None] * (len(positional) - len(documented.defaults)) + documented.defaults
    shown = [(a.arg, "POSITIONAL_OR_KEYWORD", d) for a, d in zip(positional, pos_defaults, strict=True)]
    shown += [(a.arg, "KEYWORD_ONLY", d) for a, d in zip(documented.kwonlyargs, documented.kw_defaults, strict=True)]
    actual = [(p.name, p.kind.name, p.default) for p in real]
    assert [s[:2] for s in shown] == [a[:2] for a in actual], f"{where}: {span} vs {inspect.signature(function)}"
    for (arg, _, default), (_, _, value) in zip(shown, actual, strict=True):
        if default is None:
            assert value is inspect.Parameter.empty, f"{where}: {name}'s {arg} has a default, {value!r}"
        else:
            assert ast.literal_eval(default) == value, f"{where}: {name}'s {arg} defaults to {value!r}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_inline_names_and_signatures_exist(doc: Path) -> None:
    for span in _inline_spans(doc):
        if not re.match(r"(cerar|Code|CommStats)\.\w", span):
            continue
        try:
            tree = ast.parse(span, mode="eval")
        except SyntaxError:
            assert re.fullmatch(r"[\w.]+\(.*\)", span), f"{doc.name}: `{span}` is neither Python nor a signature"
            _check_signature(span, f"{doc.name}: `{span}`")
            continue
        _check_cerar_names(tree, f"{doc.name}: `{span}`")


# ---------------------------------------------------------------------------------------------
# Commands


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


@contextlib.contextmanager
def _parse_only() -> Iterator[None]:
    """``ArgumentParser.parse_args`` parses, then stops the program that called it. Parsers built
    meanwhile take no abbreviations: a shown flag must be spelt out (``--size`` for ``--sizes``
    works today and breaks when another ``--size...`` flag comes)."""
    real_parse, real_init = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.__init__

    def parse_args(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise _Parsed(real_parse(self, args, namespace))

    def init(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **{**kwargs, "allow_abbrev": False})

    with (
        mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args),
        mock.patch.object(argparse.ArgumentParser, "__init__", init),
    ):
        yield


def _parse(run: Callable[[], Any], what: str) -> argparse.Namespace:
    """Run ``run`` until its parser has parsed; an argparse error fails the test with its message."""
    err = io.StringIO()
    try:
        with _parse_only(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            run()
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit:
        pytest.fail(f"{what}: {err.getvalue().strip()}")
    pytest.fail(f"{what}: never parsed its arguments")


def _check_cerar(argv: list[str], what: str) -> None:
    from cerar.cli import COMMANDS, build_parser

    assert argv and argv[0] in COMMANDS, f"{what}: no such cerar command"
    args = _parse(lambda: build_parser(only=argv[0]).parse_args(argv), what)
    try:  # the values too: the configs check them when built, as the commands do first
        if argv[0] == "bench" and not args.cleanup:
            from cerar.cli.bench import config_from_args

            config_from_args(args)
        elif argv[0] == "train":
            from cerar.cli.train import plan_runs

            plan_runs(args)
    except (ValueError, TypeError) as exc:
        pytest.fail(f"{what}: {exc}")


def _check_script(path: str, argv: list[str], what: str) -> None:
    script = ROOT / path
    assert script.is_file(), f"{what}: {path} does not exist"
    if "argparse" not in script.read_text():
        assert not argv, f"{what}: {path} takes no arguments"
        return

    def run() -> None:
        with mock.patch.object(sys, "argv", [str(script), *argv]):
            runpy.run_path(str(script), run_name="__main__")

    _parse(run, what)


def _check_launch(argv: list[str], what: str) -> None:
    from cerar.harness import launch

    args = _parse(lambda: launch.main(argv), what)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    assert command, f"{what}: launches nothing"
    _check_command(command, what)


def _check_torchrun(argv: list[str], what: str, *, script_exists: bool = True) -> None:
    from torch.distributed.run import get_args_parser

    args = _parse(lambda: get_args_parser().parse_args(argv), what)
    if script_exists:
        assert (ROOT / args.training_script).is_file(), f"{what}: {args.training_script} does not exist"
        if args.training_script_args:
            _check_script(args.training_script, args.training_script_args, what)


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), flags=re.M))


def _pins() -> set[str]:
    """``name==version`` as pyproject.toml and the Makefile pin them."""
    pinned = re.findall(r'"([\w.-]+==[\w.]+)"', (ROOT / "pyproject.toml").read_text())
    make_pin = re.search(r"^TORCH_PIN \?= (\S+)", (ROOT / "Makefile").read_text(), flags=re.M)
    assert make_pin is not None
    return {*pinned, make_pin.group(1)}


def _check_command(argv: list[str], what: str) -> None:
    program, rest = argv[0].removeprefix(".venv/bin/"), argv[1:]
    if program == "cerar":
        _check_cerar(rest, what)
    elif program == "make":
        targets = [a for a in rest if not a.startswith("-") and "=" not in a]
        assert targets, f"{what}: no target"
        for target in targets:
            assert target in _make_targets(), f"{what}: the Makefile has no target {target!r}"
    elif program in ("python", "python3") and rest[:1] == ["-m"]:
        module, args = rest[1], rest[2:]
        if module == "cerar":
            _check_cerar(args, what)
        elif module == "cerar.harness.launch":
            _check_launch(args, what)
        elif module == "pytest":
            assert importlib.util.find_spec("pytest") is not None
            for path in (a for a in args if not a.startswith("-")):
                assert (ROOT / path.split("::")[0]).exists(), f"{what}: {path} does not exist"
        else:
            pytest.fail(f"{what}: no check for python -m {module}")
    elif program in ("python", "python3"):
        _check_script(rest[0], rest[1:], what)
    elif program == "torchrun":
        _check_torchrun(rest, what)
    elif program == "pip" and rest[:1] == ["install"]:
        for requirement in (r for r in rest[1:] if "==" in r):
            assert requirement in _pins(), f"{what}: {requirement} is not pinned so in pyproject.toml or the Makefile"
    else:
        pytest.fail(f"{what}: no check for {program!r} commands")


def _substitute(token: str) -> str:
    return PLACEHOLDERS.get(token, token.replace("NODE0", NODE0))


def _block_commands(block: Block) -> list[list[str]]:
    text = block.text.replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in text.splitlines()]
    return [[_substitute(t) for t in argv] for argv in commands if argv]


def _variants(cell: str) -> list[list[str]]:
    """``cmd a [--x 1|2] [--y]`` -> ``cmd a``, ``cmd a --x 1``, ``cmd a --x 2``, ``cmd a --y``:
    each optional group alone, each alternative of it in turn."""
    cell = cell.replace("\\|", "|")
    required = shlex.split(re.sub(r"\[[^\]]*\]", " ", cell))
    variants = [required]
    for group in re.findall(r"\[([^\]]*)\]", cell):
        tokens = shlex.split(group)
        alternatives = max(len(t.split("|")) for t in tokens)
        for i in range(alternatives):
            chosen = [t.split("|")[min(i, len(t.split("|")) - 1)] for t in tokens]
            variants.append(required + chosen)
    return [[_substitute(t) for t in argv] for argv in variants]


def _table_commands() -> list[tuple[str, list[str]]]:
    text = README.read_text()
    section = text[text.index("\n## Commands\n") :]
    section = section[: section.find("\n## ", 1)]
    cells = re.findall(r"^\| `((?:[^`]|\\`)+)` \|", section, flags=re.M)
    assert cells, "README's commands table is gone"
    return [(f"README commands table: {cell}", argv) for cell in cells for argv in _variants(cell)]


COMMAND_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("bash", "")]


@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=_block_id)
def test_block_commands_parse(block: Block) -> None:
    commands = _block_commands(block)
    assert commands, f"{block.where}: an empty command block"
    for argv in commands:
        _check_command(argv, f"{block.where}: {shlex.join(argv)}")


def test_table_commands_parse() -> None:
    for what, argv in _table_commands():
        _check_command(argv, f"{what} -> {shlex.join(argv)}")


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_inline_commands_parse(doc: Path) -> None:
    from cerar.cli import COMMANDS

    subcommands = "|".join(COMMANDS)
    for span in _inline_spans(doc):
        what = f"{doc.name}: `{span}`"
        if re.match(rf"(cerar ({subcommands})|make \w|python -m \w|python benchmarks/)", span):
            for argv in _variants(span):
                _check_command(argv, f"{what} -> {shlex.join(argv)}")
        elif span.startswith("torchrun "):  # its script may be one of the blocks, saved under a name
            _check_torchrun(_variants(span)[0][1:], what, script_exists=False)


def test_the_checks_reject_what_they_should() -> None:
    """A renamed flag, a bad value, a missing target or script fails (the parser is the real one)."""
    for argv in (
        ["cerar", "bench", "--method", "cerar"],
        ["cerar", "bench", "--methods", "cerar-fp8"],
        ["cerar", "train", "--methods", "nosuch"],
        ["cerar", "design", "--construction", "nosuch"],
        ["make", "nosuch"],
        ["python", "benchmarks/gpu_check.py", "--size", "16"],
        ["python", "benchmarks/nosuch.py"],
        ["python", "-m", "cerar.harness.launch", "--nosuch", "--", "python", "examples/torchrun_ddp.py"],
        ["torchrun", "--nosuch", "examples/torchrun_ddp.py"],
        ["pip", "install", "torch==0.1"],
    ):
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            _check_command(argv, shlex.join(argv))


# ---------------------------------------------------------------------------------------------
# Links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in _prose(doc).splitlines() if line.startswith("#")}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_relative_links_resolve(doc: Path) -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(doc)):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        assert linked.exists(), f"{doc.name}: link to {target}: no such file"
        if anchor:
            assert anchor in _anchors(linked), f"{doc.name}: link to {target}: no such heading"


#: A file of the repository named in the prose (`src/cerar/comm/runtime/engine.py`): moved code leaves
#: no stale path behind.
REPO_PATH = re.compile(r"`((?:src|benchmarks|examples|tests|docs)/[\w./-]+\.(?:py|c|md|gz|txt))`")


@pytest.mark.parametrize("doc", (README, *sorted((ROOT / "docs").glob("*.md"))), ids=lambda d: d.name)
def test_named_files_exist(doc: Path) -> None:
    missing = [p for p in REPO_PATH.findall(_prose(doc)) if not (ROOT / p).exists()]
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


#: A commit hash as a heading would carry one: 7 to 40 hex digits, at least one of them a digit
#: (so that words such as "defaced" are not taken for one).
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", flags=re.I)
#: A section's command: a ```bash block whose first line runs ``cerar`` or a script of benchmarks/.
RESULTS_COMMAND = re.compile(r"(\.venv/bin/)?(cerar |python3? benchmarks/)")


def _results_rule_breaches(text: str) -> list[str]:
    """docs/results.md is a report, one section (``##``) per experiment: each shows its command (a
    ```bash block starting with ``cerar `` or ``python benchmarks/...``) and the date it was
    measured (YYYY-MM-DD), and no heading is named by a commit (the commit goes in the text)."""
    breaches, sections, fence = [], [], None
    for line in text.splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
            if fence is not None and sections:
                sections[-1]["blocks"].append([fence])
            continue
        if fence is not None:
            if sections and sections[-1]["blocks"]:
                sections[-1]["blocks"][-1].append(line)
            continue
        if re.match(r"#{2,3} ", line) and COMMIT_HASH.search(line):
            breaches.append(f"{line!r}: a heading named by a commit")
        if line.startswith("## "):
            sections.append({"title": line[3:], "blocks": [], "text": []})
        elif sections:
            sections[-1]["text"].append(line)
    if not sections:
        breaches.append("no ## sections")
    for section in sections:
        title = section["title"]
        commands = [b[1] for b in section["blocks"] if b[0] == "bash" and len(b) > 1]
        if not any(RESULTS_COMMAND.match(first) for first in commands):
            breaches.append(f"{title}: no ```bash block starting with `cerar ` or `python benchmarks/`")
        if not re.search(r"\b20\d\d-\d\d-\d\d\b", "\n".join(section["text"])):
            breaches.append(f"{title}: no date (YYYY-MM-DD)")
    return breaches


def test_results_sections_name_command_and_date() -> None:
    """docs/results.md: every experiment has its command and the date it was measured, and no
    section is named by a commit (the rule itself: it rejects each breach)."""
    breaches = _results_rule_breaches(RESULTS.read_text())
    assert not breaches, "docs/results.md: " + "; ".join(breaches)
    good = "## Run\n\n```bash\ncerar bench\n```\n\n2026-12-05, commit 2a5ca08.\n"
    assert not _results_rule_breaches(good)
    for bad in (
        good.replace("## Run", "## Run at 2a5ca08"),
        good + "\n### Commit 647d110: four runs\n",
        good.replace("cerar bench", "make bench"),
        good.replace("```bash", "```"),
        good.replace("2026-12-05", "December"),
    ):
        assert _results_rule_breaches(bad), bad
