"""Every ```python block of README.md and of the docs site runs as written.

The blocks of one page run in order, in one namespace (fresh per page), in a temporary working
directory: a page builds its own tiny model. A block preceded by the line
``<!-- docs-test: skip (reason) -->`` is not run; the reason is required. One test per page, so
pytest-xdist can spread the pages over its workers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import fwdtrace

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
_PAGE_IDS = [str(p.relative_to(ROOT)) for p in PAGES]

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$")
_SKIP = re.compile(r"^<!-- docs-test: skip(?: \((?P<reason>[^)]*)\))? -->$")


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """The page's ```python blocks as (line number, source, skip reason or None), in order.

    A skip marker without a reason, or one not directly followed by a python fence, is an error:
    a reader must learn why a block does not run.
    """
    lines = text.splitlines()
    blocks: list[tuple[int, str, str | None]] = []
    pending: tuple[int, str] | None = None  # (line of the marker, its reason)
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _SKIP.match(line.strip())
        if marker:
            reason = (marker.group("reason") or "").strip()
            if not reason:
                raise ValueError(f"line {i + 1}: a docs-test skip marker needs a reason: '{line.strip()}'")
            pending = (i + 1, reason)
            i += 1
            continue
        fence = _FENCE.match(line)
        if fence:
            indent, mark, info = fence.group("indent"), fence.group("fence"), fence.group("info").strip()
            body: list[str] = []
            j = i + 1
            while j < len(lines) and not (lines[j].strip().startswith(mark) and lines[j].strip().strip(mark[0]) == ""):
                body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
                j += 1
            language = info.split()[0] if info else ""
            if pending is not None and language != "python":
                raise ValueError(f"line {pending[0]}: a docs-test skip marker must come right before a ```python block")
            if language == "python":
                blocks.append((i + 1, "\n".join(body) + "\n", pending[1] if pending else None))
            pending = None
            i = j + 1
            continue
        if pending is not None and line.strip():
            raise ValueError(f"line {pending[0]}: a docs-test skip marker must come right before a ```python block")
        i += 1
    return blocks


@pytest.mark.parametrize("page", PAGES, ids=_PAGE_IDS)
def test_page_examples_run(page: Path, tmp_path, monkeypatch, restore_rules) -> None:
    blocks = python_blocks(page.read_text(encoding="utf-8"))
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    torch.manual_seed(0)
    for line, source, skip in blocks:
        if skip is not None:
            continue
        code = compile(source, f"{page.relative_to(ROOT)}:{line}", "exec")
        try:
            exec(code, namespace)
        except Exception as e:
            e.add_note(f"in the ```python block at {page.relative_to(ROOT)}:{line}")
            raise


def test_skip_markers_are_read() -> None:
    page = "<!-- docs-test: skip (blocks) -->\n```python\nwhile True: pass\n```\n\n```python\nx = 1\n```\n"
    assert python_blocks(page) == [(2, "while True: pass\n", "blocks"), (6, "x = 1\n", None)]
    with pytest.raises(ValueError, match="needs a reason"):
        python_blocks("<!-- docs-test: skip -->\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="right before"):
        python_blocks("<!-- docs-test: skip (why) -->\ntext\n```python\nx = 1\n```\n")
    with pytest.raises(ValueError, match="right before"):
        python_blocks("<!-- docs-test: skip (why) -->\n```bash\nls\n```\n")


CODE_WIDTH = 88  # what a code block shows at 1280 px without a horizontal scroll


def test_code_lines_fit_the_page() -> None:
    """Every line inside a fenced block of README.md and the docs is at most CODE_WIDTH characters:
    a longer one's end, often its comment, hides behind a scroll bar."""
    wide = []
    for page in PAGES:
        fence = None
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            m = _FENCE.match(line)
            if m and (fence is None or (m["fence"] == fence and not m["info"].strip())):
                fence = m["fence"] if fence is None else None
            elif fence is not None and len(line) > CODE_WIDTH:
                wide.append(f"{page.relative_to(ROOT)}:{number} ({len(line)})")
    assert wide == []


_USES = re.compile(r"^# uses (?P<names>[\w, ]+) from the examples? above$", re.M)


def free_names(source: str) -> set[str]:
    """The names a block reads but never binds (assigns, imports, defines, takes as an argument)."""
    import ast
    import builtins

    bound, loaded = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return loaded - bound - set(dir(builtins)) - {"__name__"}


def test_free_names_reads_what_a_block_takes_from_above() -> None:
    assert free_names("import torch\ny = torch.ones(1) + x\ndef f(a):\n    return a + b\n") == {"x", "b"}


@pytest.mark.parametrize("page", PAGES, ids=_PAGE_IDS)
def test_each_example_is_whole_or_says_what_it_takes_from_above(page: Path) -> None:
    """An example copied alone runs, or opens with ``# uses model, x from the example above``
    naming exactly what it takes from the blocks before it (skipped blocks included)."""
    for line, source, _ in python_blocks(page.read_text(encoding="utf-8")):
        said = _USES.search(source)
        declared = {n.strip() for n in said["names"].split(",")} if said else set()
        assert free_names(source) == declared, f"{page.name}:{line}"


def test_every_page_parses() -> None:
    for page in PAGES:
        python_blocks(page.read_text(encoding="utf-8"))


def test_readme_is_a_front_door() -> None:
    """At most 300 lines, a quickstart in the first screens, relative links that resolve, and links
    to the docs site (mkdocs.yml's site_url, which work on a package page too) that name a page of it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300
    for target in re.findall(r"\]\((?!https?://|#)([^)#\s]+)", text):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
    site = re.search(r"^site_url: (\S+)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert site is not None
    pages = re.findall(re.escape(site[1]) + r"([^)#\s]*)", text)
    assert len(pages) >= 10  # the guides are linked on the site, not as docs/*.md paths
    for page in pages:
        path = DOCS / (page.rstrip("/") + ".md" if page else "index.md")
        assert path.exists(), f"README.md links to {site[1]}{page}, which no page of docs/ becomes"
    assert "](docs/" not in text


_HASH = re.compile(r"(?<![0-9A-Za-z_./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])")


@pytest.mark.parametrize("page", PAGES, ids=_PAGE_IDS)
def test_no_history(page: Path) -> None:
    """User docs say what is, not what was: no commit hashes, no earlier runs or sessions."""
    text = page.read_text(encoding="utf-8")
    if page.name == "changelog.md":
        return  # the one page about what changed
    assert not _HASH.findall(text), f"{page.name} cites commit-like hashes: {_HASH.findall(text)[:3]}"
    for phrase in ("earlier run", "an earlier session", "this session", "not re-run since", "Honestly"):
        assert phrase not in text, f"{page.name} tells history: {phrase!r}"


def test_reference_covers_every_public_name() -> None:
    """Each name of fwdtrace.__all__ is documented on a reference page (a mkdocstrings ``:::`` entry)."""
    documented = set()
    for page in (DOCS / "reference").glob("*.md"):
        documented |= {m.rsplit(".", 1)[-1] for m in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M)}
    assert sorted(set(fwdtrace.__all__) - documented) == []


_DOTTED = re.compile(r"(?<![\w/.-])fwdtrace(?:\.[A-Za-z_]\w*)+")


def _resolve(dotted: str) -> object:
    """``fwdtrace.a.b`` as Python finds it: as attributes (what ``fwdtrace.live.reopen(...)`` calls),
    else from the longest module path (the ``fwdtrace.live.reopen.reopen`` of a reference entry)."""
    import importlib

    parts = dotted.split(".")
    try:
        obj: object = fwdtrace
        for i, name in enumerate(parts[1:], 2):
            try:
                obj = getattr(obj, name)
            except AttributeError:
                obj = importlib.import_module(".".join(parts[:i]))
        return obj
    except ImportError:
        pass
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            for name in parts[i:]:
                obj = getattr(obj, name)
            return obj
        except (ImportError, AttributeError):
            continue
    raise AttributeError(dotted)


def test_reference_covers_every_name_the_guides_call() -> None:
    """Each fwdtrace function or class a python block of the README or a guide names
    (``fwdtrace.x.y``, ``from fwdtrace.x import y``) has a reference entry, itself or its class."""
    import inspect

    documented = set()
    for page in (DOCS / "reference").glob("*.md"):
        for path in re.findall(r"^::: ([\w.]+)", page.read_text(), re.M):
            documented.add(_resolve(path) if path != "fwdtrace" else fwdtrace)
    missing = []
    for page in PAGES:
        if "reference" in page.parts:
            continue
        for _, source, _ in python_blocks(page.read_text(encoding="utf-8")):
            names = set(_DOTTED.findall(source))
            for module, imported in re.findall(r"^\s*from (fwdtrace[\w.]*) import ([\w, ]+)$", source, re.M):
                names |= {f"{module}.{n.strip()}" for n in imported.split(",")}
            for dotted in names:
                obj = _resolve(dotted)
                if inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
                    continue  # a namespace, or a constant the guide explains
                owner = inspect.getmodule(obj)
                first = getattr(owner, obj.__qualname__.split(".")[0], None)
                if not {obj, first, owner} & documented:
                    missing.append(f"{page.name}: {dotted}")
    assert sorted(set(missing)) == []


def test_nav_lists_every_page() -> None:
    """mkdocs.yml's nav names every page under docs/ (a page missing from it is unreachable)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    missing = [str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md") if str(p.relative_to(DOCS)) not in nav]
    assert missing == []


def test_graph_render_options_match_the_draw_pass() -> None:
    """Graph.render and Graph.to_dot spell out the draw pass's options, with its defaults."""
    import inspect

    from fwdtrace.passes import draw

    expected = {n: p.default for n, p in inspect.signature(draw.to_dot).parameters.items() if n != "graph"}
    for method in (fwdtrace.Graph.render, fwdtrace.Graph.to_dot):
        # render() also takes **unknown, only to answer a misspelt option with FwdtraceError (test_draw)
        got = {n: p.default for n, p in inspect.signature(method).parameters.items()
               if n not in ("self", "path") and p.kind is not p.VAR_KEYWORD}
        assert got == expected, method.__name__



def test_readme_picture_is_what_the_quickstart_prints(tmp_path, monkeypatch) -> None:
    """The printed graph at the top of the README is the quickstart's, as this version prints it."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    picture = re.search(r"```text\n>>> print\(fwdtrace\.trace\(model, [^\n]*\n(.*?)\n```", text, re.S)
    assert picture is not None, "README.md lost its printed graph"
    _, quickstart, _ = python_blocks(text)[0]
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    exec(compile(quickstart, "README.md quickstart", "exec"), namespace)
    assert str(namespace["graph"]) == picture.group(1)
