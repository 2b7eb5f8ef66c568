"""The commands in the README and the docs are real, and the README's links lead somewhere.

Every `cvl ...` command line in a fenced code block of README.md, docs/**/*.md, the dataset
cards (datasets/*.md) and benchmarks/README.md is parsed with click's own parser against the
`cvl.cli` group: each subcommand of the chain must exist, each option must be one of that
command's options (taking a value where it takes one), and the names given to choice options
and `--method` must exist, so renaming an option, a command, a mode or a method turns this
file red until the pages say the new name. Nothing runs.

What counts as a command, and the placeholders the pages may use:

- A line (backslash continuations joined) in a block whose info string is not `text`, where
  `cvl` (or `.venv/bin/cvl`, or `-m cvl` as in `python -m cvl`, `torchrun ... -m cvl`) starts
  a shell command: at the line's start, after `VAR=value` assignments, or after `&&`, `;`,
  `|`, `(`, `$(`. Comments (`# ...`) are dropped; a `-> ...` annotation ends the command.
  Blocks marked `text` are pictures, not commands (the README's four steps).
- `...` (or a word ending in `...`) stands for "more of the same": the words before it are
  checked, the rest is not; right after an option (`--out ...`) it is that option's value.
- Values are not converted (`--epochs N`, `--out RUN` are fine), but a value of a choice option
  (`--tune lora`) and a `--method` must be a name cvl knows, unless written as a placeholder
  (upper case such as `MODE`, alternatives `a|b`, `$VAR`, `...`).
- A subcommand written as a placeholder (upper case such as `SOURCE`, or alternatives such as
  `synthetic|p9d`) is not resolved: the command is checked up to it.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

from cvl.cli import SUBCOMMANDS, cli
from cvl.methods.registry import all_methods

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
INLINE = re.compile(r"(?<!`)`(cvl [^`]+)`(?!`)")
# Methods the pages ask the reader to write (docs/adding-a-method.md's example): not registered.
EXAMPLE_METHODS = ("fd",)
SEPARATORS = {"&&", "||", ";", "|", "(", "$("}


def doc_pages() -> list[Path]:
    """README.md, every page under docs/ (the dataset cards through their own folder, since
    docs/datasets is a link to it) and the benchmarks' README."""
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    pages += sorted(p for p in (ROOT / "docs").rglob("*.md") if "datasets" not in p.parts)
    pages += sorted((ROOT / "datasets").glob("*.md"))
    return pages


def code_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(first line number, info string, lines) of each fenced code block."""
    blocks, cur, fence, info, start = [], None, "", "", 0
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if cur is None and m:
            cur, fence, info, start = [], m.group(2), m.group(3).strip(), n + 1
        elif cur is not None and m and m.group(2).startswith(fence) and not m.group(3).strip():
            blocks.append((start, info, cur))
            cur = None
        elif cur is not None:
            cur.append(line)
    return blocks


def shell_lines(lines: list[str], start: int) -> list[tuple[int, str]]:
    """Logical lines (backslash continuations joined) with the number of their first line."""
    out, buf, first = [], "", start
    for i, line in enumerate(lines):
        if not buf:
            first = start + i
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        out.append((first, buf + line))
        buf = ""
    if buf:
        out.append((first, buf))
    return out


def cvl_argv(line: str) -> list[list[str]]:
    """The argument lists of the `cvl` commands on one shell line (words after `cvl`)."""
    line = line.split(" -> ")[0]
    try:
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lex.whitespace_split = True
        words = list(lex)
    except ValueError:  # an unbalanced quote in prose-like lines: not a command we can check
        return []
    found, at_start = [], True
    for i, w in enumerate(words):
        if w in SEPARATORS or w == "$":
            at_start = True
            continue
        if at_start and ASSIGN.match(w):
            continue
        is_cvl = at_start and (w == "cvl" or w.endswith("/bin/cvl"))
        is_module = w == "cvl" and i > 0 and words[i - 1] == "-m"
        if is_cvl or is_module:
            args = []
            for a in words[i + 1 :]:
                if a in SEPARATORS:
                    break
                args.append(a)
            found.append(args)
        at_start = False
    return found


def inline_commands(text: str) -> list[tuple[int, str]]:
    """(line number, text) of the inline code spans outside code blocks that start with `cvl `
    (the tables' and the prose's commands)."""
    found, in_code = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code:
            found += [(n, s) for s in INLINE.findall(line.replace("\\|", "|"))]
    return found


def commands() -> list[tuple[str, list[str], bool]]:
    """(where, argv, inline) of every documented `cvl` command: code blocks and inline spans."""
    found = []
    for page in doc_pages():
        text, name = page.read_text(), page.relative_to(ROOT)
        lines = [
            (ln, False)
            for s, info, block in code_blocks(text)
            if info.split()[:1] != ["text"]
            for ln in shell_lines(block, s)
        ]
        for (n, line), inline in lines + [(x, True) for x in inline_commands(text)]:
            for argv in cvl_argv(line):
                found.append((f"{name}:{n}", argv, inline))
    return found


def is_placeholder(word: str) -> bool:
    """A subcommand written as a placeholder (SOURCE, synthetic|p9d, <name>)."""
    return word.isupper() or any(c in word for c in "|<>[]{}")


def is_value_placeholder(value: str) -> bool:
    """A value written as a placeholder: MODE, a|b, $VAR, <x>, ... (free, not checked)."""
    return value.isupper() or value.endswith("...") or any(c in value for c in "|$<>{}[]")


def wrong_values(cmd: click.Command, opts: dict) -> str | None:
    """The first value a choice option (`--tune lora`) or `--method` does not accept: the
    names a page writes must be names cvl knows (a renamed method or mode fails too)."""
    for param in cmd.params:
        given = opts.get(param.name)
        if given is None or not isinstance(param, click.Option):
            continue
        values = given if isinstance(given, (list, tuple)) else [given]
        if isinstance(param.type, click.Choice):
            known = [str(c) for c in param.type.choices]
        elif param.name == "method":
            known = [*all_methods(), *EXAMPLE_METHODS]
        else:
            continue
        for v in values:
            if isinstance(v, str) and not is_value_placeholder(v) and v not in known:
                return f"{param.opts[0]} {v!r} is not one of {', '.join(known)}"
    return None


def check(argv: list[str], inline: bool = False) -> str | None:
    """None if click accepts every subcommand and option name of `argv`, else why not
    (`inline`: an inline code span, which may end in an option it names without its value)."""
    cut = next((i for i, a in enumerate(argv) if a.endswith("...")), len(argv))
    args, cmd, path = argv[:cut], cli, ["cvl"]
    dots = cut < len(argv)
    if (dots or inline) and args and args[-1].startswith("-") and "=" not in args[-1]:
        args.append("VALUE")  # `--out ...`, prose's `--config`: the value is implied
    while True:
        ctx = click.Context(cmd, info_name=path[-1], resilient_parsing=False)
        parser = cmd.make_parser(ctx)
        try:
            opts, rest, _ = parser.parse_args(args=list(args))
        except click.UsageError as e:
            return f"{' '.join(path)}: {e.format_message()}"
        wrong = wrong_values(cmd, opts)
        if wrong:
            return f"{' '.join(path)}: {wrong}"
        if not isinstance(cmd, click.Group) or not rest:
            return None
        name, args = rest[0], rest[1:]
        if is_placeholder(name):
            return None
        sub = cmd.get_command(ctx, name)
        if sub is None:
            return f"{' '.join(path)}: no subcommand {name!r}"
        cmd, path = sub, [*path, name]


def test_every_subcommand_area_is_installed():
    assert len(cli.commands) == len(SUBCOMMANDS), sorted(cli.commands)


def test_the_pages_hold_commands():
    found = commands()
    pages = {where.split(":")[0] for where, _, _ in found}
    assert len(found) > 150 and "README.md" in pages and "docs/getting-started.md" in pages
    subs = {argv[0] for _, argv, _ in found if argv}
    assert set(cli.commands) <= subs  # every subcommand is documented somewhere


def test_documented_commands_parse():
    bad = []
    for where, argv, inline in commands():
        why = check(argv, inline)
        if why is not None:
            bad.append(f"{where}: cvl {' '.join(argv)}\n    {why}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "argv, why",
    [
        (["train", "--stream", "S", "--methd", "seqft"], "--methd"),
        (["build-stream", "synthtic", "--out", "x"], "synthtic"),
        (["eval", "--run"], "--run"),  # the option takes a value
        (["analyze", "rotaton", "--run", "R"], "rotaton"),
        (["train", "--method", "er", "--out", "r"], "'er'"),  # ER is seqft + --buffer
        (["train", "--tune", "loras"], "'loras'"),
    ],
)
def test_a_wrong_name_is_caught(argv, why):
    assert why in (check(argv) or "")


def test_placeholders_and_the_extraction():
    assert check(["train", "--epochs", "N", "--tune", "MODE", "..."]) is None
    assert check(["train", "--method", "NAME", "--buffer", "reservoir|ring"]) is None
    assert check(["build-stream", "SOURCE", "--help"]) is None
    assert check(["train", "--stream", "S", "--nope..."]) is None
    assert check(["train", "--out", "..."]) is None
    assert check(["train", "--deterministic", "..."]) is None
    text = "```bash\nCVL_DEBUG=1 cvl train --stream s \\\n    --method seqft  # a comment\n```\n"
    text += "```text\ncvl train --bogus  -> runs/\n```\n"
    text += "```bash\ntorchrun --nproc_per_node 2 -m cvl eval --run r && cvl info r\n```\n"
    found = [
        argv
        for start, info, lines in code_blocks(text)
        if info != "text"
        for _, line in shell_lines(lines, start)
        for argv in cvl_argv(line)
    ]
    assert found == [
        ["train", "--stream", "s", "--method", "seqft"],
        ["eval", "--run", "r"],
        ["info", "r"],
    ]


LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchors(text: str) -> set[str]:
    """GitHub's ids of a Markdown file's headings (what `file.md#anchor` links to)."""
    ids, in_code = set(), False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and re.match(r"^#{1,6} ", line):
            title = line.lstrip("#").strip().replace("`", "").lower()
            ids.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return ids


def test_readme_links_lead_to_files_and_headings():
    readme = ROOT / "README.md"
    text = re.sub(r"```.*?```", "", readme.read_text(), flags=re.S)
    links = [u for u in LINK.findall(text) if not re.match(r"^[a-z]+:", u)]
    assert any(u.startswith("docs/") for u in links)
    missing = []
    for url in links:
        path, _, anchor = url.partition("#")
        target = (ROOT / path) if path else readme
        if not target.exists():
            missing.append(f"{url}: no file {path}")
        elif anchor and anchor not in github_anchors(target.read_text()):
            missing.append(f"{url}: no heading #{anchor} in {path or 'README.md'}")
    assert not missing, "\n".join(missing)
