"""No import circle in core/ (quantplug), plugins/, integrations/transformers or examples/.

An import counts wherever it is written: at module level, inside a function, or under
``if TYPE_CHECKING:`` (grimp parses the source, so it sees all three). A circle is a strongly
connected component of more than one module in the package's own import graph (imports of
other packages are left out). The layer order itself is checked by import-linter
(``lint-imports``, pyproject's [tool.importlinter]).

Run as a script to print every circle: ``python tests/test_layering.py [package ...]``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp") if __name__ != "__main__" else __import__("grimp")

ROOT = Path(__file__).resolve().parent.parent

# every first-party import package: the core, each backend plugin, the transformers and vLLM
# bridges and the example third-party packages (acme_quant and the vLLM bridge are not installed in
# the main environment: their source folders are put on sys.path for grimp, which only parses them)
PACKAGES = [
    "quantplug",
    "quantplug_compressed_tensors",
    "quantplug_expert_pack",
    "quantplug_fp8",
    "quantplug_gptq_awq",
    "quantplug_modelopt",
    "quantplug_modelslim",
    "quantplug_quark",
    "quantplug_transformers",
    "quantplug_vllm",
    "quantplug_deepseek_v2",
    "acme_quant",
]
_EXTRA_PATHS = [ROOT / "examples" / "acme_quant", ROOT / "integrations" / "vllm"]


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), those of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            advanced = False
            for nxt in it:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return sorted(out, key=lambda c: (-len(c), c))


@contextlib.contextmanager
def _findable() -> Iterator[None]:
    """The uninstalled source folders on sys.path for the duration (other tests in this process
    must not find acme_quant or the vLLM bridge importable)."""
    added = [str(p) for p in _EXTRA_PATHS if str(p) not in sys.path]
    sys.path.extend(added)
    try:
        yield
    finally:
        for p in added:
            sys.path.remove(p)


def import_graph(package: str) -> dict[str, set[str]]:
    with _findable():
        g = grimp.build_graph(package, include_external_packages=False, cache_dir=None)
    return {m: set(g.find_modules_directly_imported_by(m)) for m in g.modules}


def cycles(package: str) -> list[list[str]]:
    """Every import circle in ``package``, largest first (each a sorted list of modules)."""
    return _sccs(import_graph(package))


def _importable(package: str) -> bool:
    with _findable():
        return importlib.util.find_spec(package) is not None


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle(package: str) -> None:
    if not _importable(package):
        pytest.skip(f"{package} is not installed")
    found = cycles(package)
    assert not found, f"{len(found)} import circle(s) in {package}:\n" + "\n".join(
        f"  {len(c)}: {', '.join(c)}" for c in found
    )


if __name__ == "__main__":
    status = 0
    for pkg in sys.argv[1:] or PACKAGES:
        if not _importable(pkg):
            print(f"{pkg}: not installed")
            continue
        found = cycles(pkg)
        print(f"{pkg}: {len(found)} circle(s)")
        for c in found:
            print(f"  {len(c)}: {', '.join(c)}")
        status |= bool(found)
    sys.exit(status)
