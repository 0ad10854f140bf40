"""Every command quoted in README.md, docs/*.md and docker/ refers to things that exist.

Quoted means: a line of a ```bash / ```sh fenced block, an inline `code span` that starts with a command word,
a usage line in a Dockerfile comment (`#   docker build ...`) or in a docker/*.py docstring. For each command
(continuation lines joined, split at && || ; |) the test checks:
- paths under the repository's tracked top-level folders (configs/, docker/, slurm/, launchers/, bench/, ...);
- `make TARGET`: the Makefile has the target;
- `megaopd SUB --flag` and `python -m megaopd.cli SUB --flag`: the subcommand exists and its parser has the flag;
- `python FILE.py --flag` / `-m megaopd.MODULE --flag`: the file or module exists and its source names the flag;
- `pip install '.[extra]'`: pyproject.toml has the extra; `pip install name==version`: a pin in pyproject.toml
  of the same package says the same version.
Placeholders (`...`, `CONFIG`, `STUDY.yaml`), run outputs (runs/, /shared/...) and other programs' flags are not
checked.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
import shlex
import subprocess
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from megaopd import cli

ROOT = Path(__file__).resolve().parents[1]
COMMAND_WORDS = {"megaopd", "python", "python3", "make", "torchrun", "sbatch", "srun", "bash", "docker", "enroot",
                 "pip", "tensorboard"}
SEPARATORS = {"&&", "||", ";", "|"}


@dataclass
class Quoted:
    where: str  # file:line, for the failure message
    text: str


def _starts_with_command(text: str) -> bool:
    words = [w for w in text.split() if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)]  # VAR=value prefixes
    return bool(words) and words[0] in COMMAND_WORDS


def _joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Continuation lines (ending in a backslash) joined onto their first line."""
    out: list[tuple[int, str]] = []
    continues = False
    for number, line in lines:
        text = line.rstrip()
        if continues:
            out[-1] = (out[-1][0], out[-1][1] + " " + text.strip())
        else:
            out.append((number, text))
        continues = text.endswith("\\")
        if continues:
            out[-1] = (out[-1][0], out[-1][1][:-1])
    return out


def quoted_in_markdown(path: Path) -> list[Quoted]:
    found: list[tuple[int, str]] = []
    fence: str | None = None  # the language of the fenced block we are in; None outside one
    for number, line in enumerate(path.read_text().splitlines(), 1):
        opening = re.match(r"\s*```(\w*)", line)
        if opening:
            fence = opening.group(1) or "text" if fence is None else None
        elif fence in ("bash", "sh", "shell", "console"):
            found.append((number, line))
        elif fence is None:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line)
                      if " " in span and _starts_with_command(span)]
    return [Quoted(f"{path.relative_to(ROOT)}:{n}", text) for n, text in _joined(found) if text.strip()]


def quoted_in_docker(text: str, name: str) -> list[Quoted]:
    """Usage lines: `#   command` in a Dockerfile, an indented command line in a script's docstring."""
    if name.endswith(".py"):
        text = '"""'.join(text.split('"""')[:2])  # the module docstring, not the code after it
    pattern = r"#\s{2,}(\S.*)" if name.startswith("Dockerfile") else r"\s{4}(\S.*)"
    found = [(n, m.group(1)) for n, line in enumerate(text.splitlines(), 1)
             if (m := re.fullmatch(pattern, line)) and _starts_with_command(m.group(1))]
    return [Quoted(f"docker/{name}:{n}", t) for n, t in _joined(found)]


def all_quoted() -> list[Quoted]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    docker = sorted(p for p in (ROOT / "docker").iterdir() if p.name.startswith("Dockerfile") or p.suffix == ".py")
    return ([q for p in docs for q in quoted_in_markdown(p)]
            + [q for p in docker for q in quoted_in_docker(p.read_text(), p.name)])


def segments(text: str) -> list[list[str]]:
    text = re.sub(r"(^|\s)#.*", "", text)  # a comment starts a word: `docker://host#repo:tag` is no comment
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, ""
    out: list[list[str]] = [[]]
    for token in lexer:
        if token in SEPARATORS:
            out.append([])
        else:
            out[-1].append(token)
    return [s for s in out if s]


@cache
def tracked_roots() -> frozenset[str]:
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True).stdout.split()
    return frozenset(f.split("/", 1)[0] for f in files if "/" in f)


@cache
def make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


@cache
def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@cache
def megaopd_options(sub: str) -> frozenset[str] | None:
    """The option strings of `megaopd SUB`, read from its own --help; None for an unknown subcommand."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()), \
            contextlib.suppress(SystemExit):
        cli.main([sub, "--help"])
    text = out.getvalue()
    return frozenset(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text)) if text else None


def _flags(tokens: list[str]) -> list[str]:
    return [t.split("=", 1)[0] for t in tokens if re.fullmatch(r"--[a-zA-Z][\w-]*(=.*)?", t)]


def path_problems(tokens: list[str]) -> list[str]:
    problems = []
    for token in tokens:
        for candidate in (token, token.split("=", 1)[-1]):
            if candidate.split("/", 1)[0] in tracked_roots() and "/" in candidate:
                if not any(ROOT.glob(candidate)) and not (ROOT / candidate).exists():
                    problems.append(f"{candidate} does not exist")
                break
    return problems


def megaopd_problems(args: list[str]) -> list[str]:
    if not args or args[0] in ("-h", "--help") or args[0] == "...":
        return []
    options = megaopd_options(args[0])
    if options is None:
        return [f"megaopd has no subcommand {args[0]!r}"]
    return [f"megaopd {args[0]} has no option {f}" for f in _flags(args[1:]) if f not in options]


def source_problems(kind: str, name: str, args: list[str]) -> list[str]:
    if kind == "file":
        path = ROOT / name
        if not path.exists():
            return []  # path_problems reports it
    else:
        if not re.fullmatch(r"megaopd(\.\w+)*", name):
            return []  # another package's module (sglang.launch_server), or a placeholder (megaopd...)
        try:
            spec = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            spec = None
        if spec is None or spec.origin is None:
            return [f"no module {name}"]
        path = Path(spec.origin)
    source = path.read_text()
    return [f"{name} never mentions {f}" for f in _flags(args) if not re.search(re.escape(f) + r"(?![\w-])", source)]


def pip_problems(args: list[str]) -> list[str]:
    problems = []
    extras = pyproject().get("optional-dependencies", {})
    pinned = {Requirement(r).name.lower(): Requirement(r) for group in (pyproject()["dependencies"], *extras.values())
              for r in group}
    for token in args:
        local = re.fullmatch(r"\.\[([\w,-]+)\]", token)
        if local:
            problems += [f"pyproject.toml has no extra {e!r}" for e in local.group(1).split(",") if e not in extras]
        elif re.fullmatch(r"[\w.-]+(\[[\w,-]+\])?==\S+", token):
            ours = pinned.get(Requirement(token).name.lower())
            quoted = str(Requirement(token).specifier)
            if ours is not None and str(ours.specifier).startswith("==") and str(ours.specifier) != quoted:
                problems.append(f"{token}: pyproject.toml pins {ours}")
    return problems


def command_problems(text: str) -> list[str]:
    problems = []
    try:
        parsed = segments(text)
    except ValueError as e:  # e.g. an unbalanced quote: a reader pasting it gets a shell error
        return [f"not a shell command line ({e})"]
    for tokens in parsed:
        problems += path_problems(tokens)
        for i, token in enumerate(tokens):
            after = tokens[i + 1:]
            if token == "megaopd":
                problems += megaopd_problems(after)
            elif token == "make" and after and not after[0].startswith("-"):
                problems += [f"the Makefile has no target {t!r}" for t in after if "=" not in t
                             and t not in make_targets()]
            elif token in ("python", "python3") and after and after[0].endswith(".py"):
                problems += source_problems("file", after[0], after[1:])
            elif token == "-m" and after:
                if after[0] == "megaopd.cli":
                    problems += megaopd_problems(after[1:])
                else:
                    problems += source_problems("module", after[0], after[1:])
            elif token == "pip" and after[:1] == ["install"]:
                problems += pip_problems(after[1:])
    return problems


def test_every_quoted_command_refers_to_what_exists():
    quoted = all_quoted()
    assert len(quoted) > 20, "the parser found almost no quoted commands: has the docs' layout changed?"
    problems = [f"{q.where}: {p}\n    {q.text.strip()}" for q in quoted for p in command_problems(q.text)]
    assert not problems, "quoted commands that do not hold:\n" + "\n".join(problems)


def test_a_missing_config_in_a_dockerfile_usage_line_is_caught():
    # The usage line Dockerfile.cpu carried before issue 19: the study it runs was never there.
    old = ('#   docker run --rm -v "$PWD/runs:/opt/megaopd/runs" megaopd:cpu megaopd study '
           'configs/studies/embedded_demo.yaml\n')
    (quoted,) = quoted_in_docker(old, "Dockerfile.cpu")
    assert command_problems(quoted.text) == ["configs/studies/embedded_demo.yaml does not exist"]


@pytest.mark.parametrize("command, problem", [
    ("megaopd submit configs/studies/two_domain.yaml --dryrun", "megaopd submit has no option --dryrun"),
    ("megaopd trian configs/embedded/grpo.yaml", "megaopd has no subcommand 'trian'"),
    ("python -m megaopd.cli eval --model m --dataset d", "megaopd eval has no option --dataset"),
    ("make demo && make tests", "the Makefile has no target 'tests'"),
    ("python launchers/nemo_run_study.py x.yaml --exec local", "launchers/nemo_run_study.py never mentions --exec"),
    ("torchrun --nproc-per-node 8 -m megaopd.models.megatron.lanch C", "no module megaopd.models.megatron.lanch"),
    ("pip install -e '.[megatorn]'", "pyproject.toml has no extra 'megatorn'"),
    ("pip install nemo-run==0.11.0", "nemo-run==0.11.0: pyproject.toml pins nemo-run==0.11.1"),
    ("sbatch slurm/stage.sbtach CONFIG", "slurm/stage.sbtach does not exist"),
])
def test_each_kind_of_reference_is_checked(command, problem):
    assert problem in command_problems(command)


def test_commands_that_hold_pass():
    assert command_problems("megaopd submit configs/studies/two_domain.yaml --launch l.yaml --dry-run --set a=1 "
                            "&& make demo  # a comment naming configs/nowhere.yaml") == []

