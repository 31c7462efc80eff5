"""Sphinx configuration for quantplug's documentation (Markdown pages through MyST, the API
reference through autodoc). Build: ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``
(``-W``: every warning is an error; ``-n``: every unresolved cross-reference is one)."""

from __future__ import annotations

import importlib
from typing import Any


project = "quantplug"
author = "the quantplug authors"
copyright = "the quantplug authors"

try:
    from quantplug import __version__ as release
except ImportError:  # building without quantplug installed: the API pages then fail loudly
    release = ""
version = release

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# Markdown: ``(label)=`` targets, ``{ref}`` roles, definition lists, ``:::`` fences; every
# heading down to level 3 gets an anchor, so ``page.md#section`` links are checked.
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist"]
myst_heading_anchors = 3

html_theme = "furo"
html_title = f"quantplug {release}"
html_static_path: list[str] = []

# The API reference: docstrings are reStructuredText (``:class:``, ``:meth:``, ``.. versionadded::``).
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = False
napoleon_numpy_docstring = False
add_module_names = False

# Warnings are errors (-W), and every cross-reference must resolve (-n). Names from libraries
# quantplug builds on (torch, pluggy, the standard library) appear in signatures; the build has
# no network for intersphinx, so those, and only those, are not links.
nitpicky = True
_EXTERNAL = (r"(torch|pluggy|numpy|pytest|_pytest|argparse|collections|typing|pathlib|ctypes|threading|enum|"
             r"dataclasses|re|os|abc|types|safetensors|tokenizers|transformers)(\..*)?")
nitpick_ignore_regex = [
    (r"py:.*", _EXTERNAL),
    (r"py:.*", r"(Path|Any|Mapping|Sequence|Callable|Iterator|Iterable|TypeAlias|Tensor|Module|Generator|"
               r"Pattern|NoneType|ellipsis|ModuleType|ABC|ClassVar)"),
    (r"py:.*", r"(int|str|float|bool|bytes|dict|list|tuple|set|frozenset|object|type|None|BaseException|Exception)"),
    # pieces of annotations Sphinx could not evaluate (a quoted or subscripted type split at its
    # commas): not references anyone wrote
    (r"py:class", r"'.*|.*\[.*|.*\]"),
    # private names (a leading underscore) in signatures, e.g. the kit's fixture type
    (r"py:.*", r"(.*\.)?_[A-Za-z].*"),
]
# Core types that appear in public signatures or docstrings but are not public API (not in
# quantplug.api): named, not linked. Keep this list short; each entry is a docstring to improve.
nitpick_ignore = [
    ("py:class", "quantplug.contract.scheme.PlannedModule"),
    # LinearScheme.form's signature: its return type (kernels.forms.Weights) is imported for type
    # checking only (the contract does not import the kernels), so autodoc shows the annotation as
    # written and torch's nn.Module stays unlinked as torch's names are
    ("py:class", "nn.Module"),
    ("py:class", "quantplug.layers.linear.FusedMLP"),
    ("py:class", "quantplug.plugins.PluginManager"),
    ("py:class", "DeepseekV3ForCausalLM"),            # models/deepseek.py PlanOracle docstring
    ("py:func", "fuse_projections"),                  # layers/linear.py LinearScheme.fuse docstring
    ("py:func", "group_problems"),                    # errors.py PlanError docstring
    ("py:class", "MLACache"),                         # generate.py Generation docstring
    # the DeepSeek-V3 blocks' signatures and docstrings (quantplug.api, 1.6): the cache classes are
    # documented on the Generation page, not in the API reference
    ("py:class", "quantplug.generate.MLACache"),
    ("py:class", "quantplug.generate.LatentCache"),
    ("py:meth", "TextModel.forward"),
    ("py:func", "quantplug.generate.new_mtp_cache"),
    ("py:class", "Indexer"),
    ("py:class", "quantplug.models.deepseek.Indexer"),
    # the gated activation of the blocks' signatures (MLP, Experts, MoE: act=), documented on the
    # Kimi architecture page
    ("py:class", "quantplug.layers.activation.GatedAct"),
    # the type of Experts.qp_store (quantplug.experts, internal; docs/experts.md describes it)
    ("py:class", "ExpertStore"),
    # the block library's modules (quantplug.blocks) named in the blocks' signatures: the blocks are
    # documented through quantplug.api, their caches on the Generation page, the residual scheme and
    # the lowering's step functions on the Architectures page
    ("py:class", "quantplug.blocks.cache.MLACache"),
    ("py:class", "quantplug.blocks.cache.LatentCache"),
    ("py:class", "quantplug.blocks.residual.PreNormLayer"),
    ("py:class", "quantplug.blocks.indexer.Indexer"),
    ("py:class", "Decisions"),
    ("py:class", "GatedAct"),
    ("py:func", "quantplug.lower.accelerate"),
    ("py:func", "quantplug.lower.experts_step"),
    ("py:func", "quantplug.lower.experts_one"),
    # the router declaration's home module; it is documented as quantplug.api.RouterSpec
    ("py:class", "quantplug.contract.routing.RouterSpec"),
]


def _api_names() -> set[str]:
    return set(importlib.import_module("quantplug.api").__all__)


def _candidates(node: Any) -> list[str]:
    """Where an unresolved ``py`` reference may point: the public re-export of an object named by
    its defining module (``quantplug.types.Claim`` -> ``quantplug.api.Claim``), or a member of the
    class the docstring belongs to (``:meth:`apply``` in ``LinearScheme``'s docstrings)."""
    target = node["reftarget"].lstrip("~.")
    parts = target.split(".")
    out = []
    api = _api_names()
    for i, name in enumerate(parts):
        if name in api:
            out.append(".".join(["quantplug", "api", *parts[i:]]))
            break
    cls = node.get("py:class")
    if cls:
        out.append(f"quantplug.api.{cls.split('.')[-1]}.{target}")
        out.append(f"{node.get('py:module')}.{cls}.{target}")
    return [c for c in out if c != target]


def _resolve(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    domain = env.get_domain("py")
    if node["reftype"] == "mod" and node["reftarget"].startswith("quantplug."):
        # a private module of the core: its public objects are documented under quantplug.api
        mod = importlib.import_module(node["reftarget"])
        if any(getattr(mod, n, None) is not None for n in _api_names()):
            return domain.resolve_xref(env, node["refdoc"], app.builder, "mod", "quantplug.api", node, contnode)
        return None
    objects = domain.objects
    for target in _candidates(node):
        if target in objects:
            return domain.resolve_xref(env, node["refdoc"], app.builder, "obj", target, node, contnode)
    # a short name that names exactly one documented object
    # (or a private module's path to it: quantplug.testing.reference.hf_logits)
    short = node["reftarget"].lstrip("~.")
    if "." not in short or short.startswith("quantplug."):
        last = short.rsplit(".", 1)[-1]
        found = [name for name in objects if name.endswith("." + last)]
        if len(found) == 1:
            return domain.resolve_xref(env, node["refdoc"], app.builder, "obj", found[0], node, contnode)
    return None


def _fix_docstring(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Narrow repairs of docstrings in files this build may not edit (each listed for its owner):
    a bullet list that follows its paragraph without a blank line."""
    if name in ("quantplug.api.StackedLinear",):
        for i in range(len(lines) - 1, 0, -1):
            if lines[i].startswith("* ") and lines[i - 1].strip() and not lines[i - 1].startswith(("* ", "  ")):
                lines.insert(i, "")


def _check_api_reference(app: Any, env: Any) -> None:
    """Every name quantplug.api exports, and every hook of the contract, is documented (the
    reference is the public API, all of it)."""
    from sphinx.util import logging

    documented = env.get_domain("py").objects
    missing = sorted(n for n in _api_names() if f"quantplug.api.{n}" not in documented)
    if missing:
        logging.getLogger(__name__).warning(
            "quantplug.api exports names docs/reference/api.md does not document: %s", ", ".join(missing))
    hooks = importlib.import_module("quantplug.api").HOOKS
    missing = sorted(h for h in hooks if f"quantplug.hookspecs.{h}" not in documented)
    if missing:
        logging.getLogger(__name__).warning(
            "hooks of the contract docs/reference/hooks.md does not document: %s", ", ".join(missing))


def setup(app: Any) -> None:
    app.connect("missing-reference", _resolve)
    app.connect("autodoc-process-docstring", _fix_docstring)
    app.connect("env-check-consistency", _check_api_reference)
