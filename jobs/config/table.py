"""`moshray config table`: the settings reference (docs/settings.md), generated from the config schema.

The table has one row per setting, in schema order: the dotted key (``section.field``, or a
top-level key), its default, and what it does: the field's docstring in
``jobs/config/sections.py`` (the string literal right under the field, read from the
source with :mod:`ast`), followed by the choices of a ``Literal`` field or of a registry
(the codecs of ``cluster/collective/codecs.py``, the clouds of ``autoscaler/clouds/``: the
names registered when the table is made). A field without a docstring is an error (:class:`TableError`, one line naming the field), so a new
setting cannot reach the page undocumented.

The command writes the table between ``<!-- settings:begin -->`` and
``<!-- settings:end -->`` in the settings page (``--file``, default ``docs/settings.md``;
the README links it); ``--check`` changes nothing and exits 1 with one line when the
page's table differs,
``--print`` prints the table. ``tests/test_readme.py`` runs the check. Pure apart from
reading the schema's source and the README.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import sys
import textwrap
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

BEGIN = "<!-- settings:begin -->"
END = "<!-- settings:end -->"
DEFAULT_FILE = "docs/settings.md"  # the settings reference the README links


class TableError(ValueError):
    """The schema or the README cannot give a table; ``str()`` is one line saying what to
    fix."""


def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass: each annotated assignment in the class body
    followed by a string literal; whitespace folded to single spaces, ``code`` as `code`."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # the ClassDef's statements
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            # reST's ``code`` becomes Markdown's `code`
            docs[stmt.target.id] = " ".join(nxt.value.value.split()).replace("``", "`")
    return docs


def format_default(value: Any) -> str:
    """A default as it is written in a TOML file: strings quoted, tuples as lists, None
    as ``none`` (the ``--set`` spelling; a file leaves the key out)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, tuple):
        return "[" + ", ".join(format_default(v) for v in value) + "]"
    return repr(value)


def _registry_choices() -> dict[str, tuple[str, ...]]:
    """Choices of settings whose values a plug-in registry holds (so no ``Literal``): the
    names registered when the table is made, built-in ones at least."""
    from moshray.autoscaler.notices.sources import source_names
    from moshray.cluster.collective.codecs import codec_names

    return {"training.compression": ("auto", *codec_names()),
            "cluster.notice_source": source_names(simulated=False, sigterm=False)}


def _choices(tp: Any) -> tuple[str, ...]:
    if get_origin(tp) is Literal:
        return tuple(str(a) for a in get_args(tp))
    for arg in get_args(tp):  # Optional[Literal[...]]
        if get_origin(arg) is Literal:
            return tuple(str(a) for a in get_args(arg))
    return ()


def rows() -> list[tuple[str, str, str]]:
    """``(key, default, what it does)`` for every setting, in schema order; the order and
    keys are those of :func:`moshray.jobs.config.sections.valid_keys`."""
    from moshray.jobs.config import sections

    out: list[tuple[str, str, str]] = []
    registry = _registry_choices()

    def add(prefix: str, cls: type, names: list[str] | None = None) -> None:
        docs, hints = field_docs(cls), get_type_hints(cls)
        for f in fields(cls):
            if names is not None and f.name not in names:
                continue
            key = f"{prefix}{f.name}"
            if f.name not in docs:
                raise TableError(f"{key} has no description: add a docstring line right "
                                 f"under the field in {cls.__module__}.{cls.__qualname__}")
            default = f.default if f.default is not MISSING else f.default_factory()
            doc = docs[f.name]
            choices = registry.get(key) or _choices(hints[f.name])
            if choices:
                doc += " One of " + ", ".join(f"`{c}`" for c in choices) + "."
            out.append((key, format_default(default), doc))

    for name, cls in sections._SECTIONS.items():
        add(f"{name}.", cls)
    add("", sections.TrainConfig, list(sections._TOP_LEVEL))
    keys = [r[0] for r in out]
    if keys != sections.valid_keys():
        raise TableError("the settings table's keys differ from valid_keys(); "
                         "update jobs/config/table.py")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The Markdown table (header, separator, one line per setting; no trailing newline)."""
    lines = ["| key | default | what it does |", "|---|---|---|"]
    for key, default, doc in rows():
        lines.append(f"| `{key}` | `{_cell(default)}` | {_cell(doc)} |")
    return "\n".join(lines)


def splice(text: str, table: str, *, name: str = "docs/settings.md") -> str:
    """``text`` with everything between the markers replaced by ``table``; TableError if
    the markers are missing, repeated or out of order."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise TableError(f"{name}: needs one {BEGIN} line and, after it, one {END} line "
                         "around the settings table")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", default=DEFAULT_FILE, metavar="FILE",
                        help="the Markdown file with the settings markers")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true",
                      help="change nothing; exit 1 if the file's table differs")
    mode.add_argument("--print", action="store_true", help="print the table only")


def main(args: argparse.Namespace) -> int:
    """Exit 0 done (or up to date), 1 ``--check`` found a difference, 2 bad input."""
    try:
        table = render()
        if args.print:
            print(table)
            return 0
        path = Path(args.file)
        try:
            text = path.read_text()
        except OSError as exc:
            raise TableError(f"{path}: cannot read it ({exc.strerror}); pass --file FILE")
        new = splice(text, table, name=str(path))
    except TableError as exc:
        print(f"moshray config table: {exc}", file=sys.stderr)
        return 2
    if args.check:
        if new != text:
            print(f"moshray config table: {path}'s settings table differs from the config "
                  "schema; run `moshray config table` to update it", file=sys.stderr)
            return 1
        return 0
    if new != text:
        path.write_text(new)
        print(f"wrote the settings table ({len(table.splitlines()) - 2} settings) into {path}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.config.table"))
