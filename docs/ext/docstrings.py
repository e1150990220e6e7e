"""A griffe extension for the API reference: fwdtrace's docstrings, written for ``help()`` and
doctest, read as Markdown.

Doctest examples (``>>>`` lines, their continuations and expected output) become fenced
``pycon`` blocks, which Markdown would otherwise read as paragraphs and reference links; Sphinx
roles (``:func:`x```) become plain code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:func|meth|class|attr|mod|data|obj|exc):`~?([^`]+)`")


def markdown(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].lstrip()
        if stripped.startswith(">>>"):
            indent = lines[i][: len(lines[i]) - len(stripped)]
            out.append(f"{indent}```pycon")
            while i < len(lines) and lines[i].strip():
                out.append(lines[i])
                i += 1
            out.append(f"{indent}```")
            continue
        out.append(_ROLE.sub(r"`\1`", lines[i]))
        i += 1
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
