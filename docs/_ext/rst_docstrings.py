"""A Griffe extension for the API reference: the package's docstrings are prose with a few reST habits, rendered
here as Markdown without parsing sections out of them (``docstring_style: null`` in ``mkdocs.yml``).

* ``:class:`Foo``` and the other Python roles become code that links to the object when the reference documents
  it (an optional cross-reference: a target the site does not show is left as plain code, never a warning);
  ``~`` shows the last component only, as in Sphinx.
* A paragraph ending in ``::`` and a ``.. code-block:: lang`` directive become fenced code blocks.

It changes only what the site renders: the package's files are not touched.
"""

from __future__ import annotations

import html
import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`(?P<text>[^`]+)`")
DIRECTIVE = re.compile(r"^(?P<indent>\s*)\.\. (?:code-block|code|sourcecode)::\s*(?P<lang>\S*)\s*$")


def _target(obj: griffe.Object | griffe.Alias, name: str) -> str | None:
    """The full path of ``name`` as seen from ``obj``'s scope, or None."""
    if name.startswith("celery_workflow"):
        return name
    if name.startswith("."):  # relative to the package of obj's module
        module = obj if obj.is_module else obj.module
        package = module.path if module.is_package else module.path.rpartition(".")[0]
        return f"{package}.{name.lstrip('.')}"
    head, _, rest = name.partition(".")
    try:
        resolved = obj.resolve(head)
    except Exception:  # not a name in scope (a builtin, a third-party name): no link
        return None
    return f"{resolved}.{rest}" if rest else resolved


def convert_roles(text: str, obj: griffe.Object | griffe.Alias) -> str:
    def replace(match: re.Match[str]) -> str:
        content = match["text"]
        titled = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", content)
        if titled:
            title, name = titled["title"], titled["target"]
        else:
            name = content.lstrip("~")
            title = name.rpartition(".")[2] if content.startswith("~") else name.lstrip(".")
        code = f"<code>{html.escape(title)}</code>"
        target = _target(obj, name)
        if target is None:
            return code
        return f'<autoref identifier="{html.escape(target)}" optional>{code}</autoref>'

    return ROLE.sub(replace, text)


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def convert_blocks(text: str) -> str:
    """reST literal blocks (``::`` paragraphs, ``.. code-block::``) to Markdown fences."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = DIRECTIVE.match(line)
        literal = not directive and line.rstrip().endswith("::")
        if not (directive or literal):
            out.append(line)
            i += 1
            continue
        base = _indent_of(line)
        if directive:
            lang = directive["lang"]
        else:
            lang = "text"
            stripped = line.rstrip()[:-2].rstrip()
            if stripped:  # "text::" reads "text:"; a lone "::" disappears
                out.append(stripped + ("" if stripped.endswith(":") else ":"))
        i += 1
        body: list[str] = []
        while i < len(lines) and (not lines[i].strip() or _indent_of(lines[i]) > base):
            body.append(lines[i])
            i += 1
        while body and not body[-1].strip():
            body.pop()
        code = textwrap.dedent("\n".join(body)).strip("\n")
        if not code:  # a "::" with no indented block after it
            continue
        pad = " " * base
        out.extend(["", f"{pad}```{lang}", *(pad + c if c else c for c in code.splitlines()), f"{pad}```", ""])
    return "\n".join(out)


class RstDocstrings(griffe.Extension):
    """Rewrite each docstring once the package is loaded (so names resolve across its modules)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: set[str] = set()
        self._walk(pkg, seen)

    def _walk(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = convert_roles(convert_blocks(obj.docstring.value), obj)
        for member in obj.members.values():
            if not member.is_alias and isinstance(member, griffe.Object):
                self._walk(member, seen)
