"""The Python examples of README.rst and docs/*.rst, as the tests run them.

An example is a ``.. code-block:: python`` (or ``code``/``sourcecode``)
directive, or a literal block (``::``) whose text parses as Python; one whose
first line starts with ``>>>`` is a doctest. Every example runs in CI unless
the source marks it as a fragment, with an rst comment just before it::

    .. fragment: needs a model and its data

    .. code-block:: python

       opt.step()

The comment does not show in the rendered page; the tests list the fragments
they skipped, with their reasons.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(code-block|code|sourcecode)::\s*(\S*)\s*$")
_FRAGMENT = re.compile(r"^\s*\.\.\s+fragment\b:?\s*(.*)$")
_EXPLICIT = re.compile(r"^\s*\.\.\s")


@dataclass(frozen=True)
class Example:
    """One example: where it is, its text, and why it does not run alone (if it does not)."""

    path: str
    line: int
    code: str
    fragment: str | None

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def doctest(self) -> bool:
        return self.code.lstrip().startswith(">>>")


def sources(root: Path = ROOT) -> list[Path]:
    """README.rst and every page of docs/: pages added later are covered without a change here."""
    return [root / "README.rst", *sorted((root / "docs").glob("*.rst"))]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _body(lines: list[str], start: int, parent_indent: int) -> tuple[int, list[str]]:
    """The indented block after line ``start`` (options of a directive skipped): first line number, text."""
    i = start + 1
    # directive options (":linenos:") come first
    while i < len(lines) and lines[i].strip().startswith(":") and _indent(lines[i]) > parent_indent:
        i += 1
    while i < len(lines) and not lines[i].strip():
        i += 1
    first = i
    body = []
    while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > parent_indent):
        body.append(lines[i])
        i += 1
    while body and not body[-1].strip():
        body.pop()
    return first + 1, body


def _marker(lines: list[str], start: int) -> str | None:
    """The fragment comment just before line ``start`` (blank lines between allowed), if any."""
    i = start - 1
    while i >= 0 and not lines[i].strip():
        i -= 1
    if i >= 0:
        m = _FRAGMENT.match(lines[i])
        if m:
            return m.group(1).strip() or "marked as a fragment"
    return None


def _paragraph_start(lines: list[str], end: int) -> int:
    """The first line of the paragraph whose last line is ``end``."""
    i = end
    while i > 0 and lines[i - 1].strip() and not _EXPLICIT.match(lines[i - 1]):
        i -= 1
    return i


def _is_python(code: str) -> bool:
    try:
        ast.parse(code)
    except SyntaxError:
        return False
    return True


def examples(path: Path, root: Path = ROOT) -> list[Example]:
    """The Python examples of one rst file, in order."""
    lines = path.read_text().splitlines()
    name = str(path.relative_to(root))
    found = []
    for i, line in enumerate(lines):
        m = _DIRECTIVE.match(line)
        if m:
            if m.group(3).lower() not in ("python", "python3", "py", "pycon"):
                continue
            first, body = _body(lines, i, len(m.group(1)))
            code = textwrap.dedent("\n".join(body)) + "\n"
            found.append(Example(name, first, code, _marker(lines, i)))
            continue
        # a literal block: a paragraph ending in "::" (not a directive)
        if line.rstrip().endswith("::") and not _EXPLICIT.match(line) and line.strip():
            first, body = _body(lines, i, _indent(lines[_paragraph_start(lines, i)]))
            code = textwrap.dedent("\n".join(body)) + "\n"
            if body and (code.lstrip().startswith(">>>") or _is_python(code)):
                found.append(Example(name, first, code, _marker(lines, _paragraph_start(lines, i))))
    return found


def all_examples(root: Path = ROOT) -> list[Example]:
    return [e for path in sources(root) for e in examples(path, root)]
