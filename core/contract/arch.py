"""What an architecture is, for the loader and for a third party that adds one: :class:`ArchSpec`
(registered through the ``quantplug.architectures`` entry-point group, or added by a backend's
``quantplug_architectures`` hook) and :class:`PlanOracle` (what a model asks the plan while it
builds itself). The entry-point group is read here (:func:`registered`); the core's own
architectures are declared in :mod:`quantplug.models.registry`, which re-exports these names.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import QuantplugError
from ..types import AttentionLayout, SkipRule
from .config import ModelConfig, parse_model_config
from .scheme import LinearScheme

log = logging.getLogger("quantplug")

#: the entry-point group architectures register in
ENTRY_POINT_GROUP = "quantplug.architectures"

#: ``config(config_json, architecture, wrapped, file)`` -> the model config the skeleton is built from
ConfigParser = Callable[[dict[str, Any], str, bool, str], ModelConfig]


@dataclass(frozen=True)
class ArchSpec:
    """A buildable architecture: ``cls(model_config, oracle)`` builds the skeleton (see
    :class:`~quantplug.models.deepseek.PlanOracle`); ``wrapped``: text config under
    ``text_config`` and text weights under ``language_model.``; ``skip_rules``: checkpoint
    tensors left out on purpose (listed in the plan); ``config``: the architecture's config
    schema, a parser from config.json to the model config (default: the core's DeepSeek-V3
    parser, :func:`quantplug.api.parse_model_config`); it raises ``ConfigError`` naming
    the file and key of anything it refuses."""

    name: str
    cls: type[nn.Module]
    wrapped: bool  # text config under text_config, text weights under language_model.
    skip_rules: tuple[SkipRule, ...]
    config: ConfigParser | None = None

    def parse_config(self, config: dict[str, Any], file: str = "config.json") -> ModelConfig:
        """The model config of ``config`` (config.json's content) under this architecture's schema."""
        parse = self.config or parse_model_config
        return parse(config, self.name, self.wrapped, file)


class PlanOracle(Protocol):
    """What the model asks the plan while it builds itself: the prefix, and every decision
    (scheme, attention layout, expert layout), each answered through the backend's hooks and
    recorded by the plan as a :class:`~quantplug.types.Decision`. An architecture added through
    ``quantplug_architectures`` builds itself with this, as :class:`DeepseekV3ForCausalLM` does."""

    prefix: str
    model_dtype: torch.dtype

    def ck(self, rel: str) -> str:
        """Checkpoint name of a text-model-relative name (prefix applied)."""
        ...

    def scheme(self, ckpt_name: str, kind: str = "linear", shards: Sequence[str] | None = None) -> LinearScheme:
        """Scheme for one linear (``kind`` "linear"), expert projection ("experts"), MLA K/V
        stack ("attn_k_b" / "attn_v_b") or the token embedding ("embedding"); ``shards``:
        checkpoint modules feeding it."""
        ...

    def layout(self, attn_ckpt_name: str) -> AttentionLayout: ...

    #: how many multi-token-prediction layers to build (``num_nextn_predict_layers``, or 0 when the
    #: load option ``mtp`` is false or the checkpoint stores none); an oracle without it builds none
    mtp_layers: int

    def expert_layout(self, experts_ckpt_name: str) -> str:
        """``"hub"`` (per-expert tensors), ``"fused"`` (transformers 5 gate_up_proj / down_proj),
        ``"stacked"`` (one [E, out, in] tensor per projection, GGUF ``ffn_*_exps``) or ``"none"``
        (no expert tensors: the scheme serves them, e.g. from an expert pack)."""
        ...


@dataclass(frozen=True)
class Registered:
    """What the ``quantplug.architectures`` entry points gave: ``specs`` by name, the
    distribution of each (``owners``), and the entries that could not be used (``failures``:
    name -> why, naming the distribution and the entry point's value)."""

    specs: Mapping[str, ArchSpec]
    owners: Mapping[str, str]
    failures: Mapping[str, str]


def _dist_name(ep: md.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.metadata['Name']} {dist.version}" if dist is not None else "an unknown distribution"


@functools.lru_cache(maxsize=1)
def registered() -> Registered:
    """Every architecture of the ``quantplug.architectures`` entry-point group, loaded once per
    process (``registered.cache_clear()`` reads the group again). An entry point that does not
    import, is not an :class:`ArchSpec`, names another architecture than its ``name``, or repeats
    a name another distribution registered, is left out and recorded in ``failures`` (logged; a
    plan for that architecture raises its message)."""
    specs: dict[str, ArchSpec] = {}
    owners: dict[str, str] = {}
    failures: dict[str, str] = {}
    seen: set[tuple[str, str]] = set()
    for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        dist = _dist_name(ep)
        if (ep.name, ep.value) in seen:  # one distribution found twice on sys.path (an editable install)
            continue
        seen.add((ep.name, ep.value))
        where = f"architecture entry point {ep.name!r} = {ep.value!r} of {dist}"
        if ep.name in specs:
            failures[ep.name] = f"{where}: {ep.name!r} is already registered by {owners[ep.name]}"
            specs.pop(ep.name)
            continue
        try:
            obj = ep.load()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 (a third party's import failure is reported, not fatal)
            failures[ep.name] = f"{where}: import failed: {type(exc).__name__}: {exc}"
            continue
        if not isinstance(obj, ArchSpec):
            failures[ep.name] = f"{where}: is a {type(obj).__name__}, expected a quantplug.api.ArchSpec"
        elif obj.name != ep.name:
            failures[ep.name] = f"{where}: is ArchSpec {obj.name!r}; an entry point's name must be its architecture"
        else:
            specs[ep.name], owners[ep.name] = obj, dist
    for why in failures.values():
        log.warning("quantplug: %s", why)
    return Registered(specs, owners, failures)


def check_plugin_architectures(answers: list[tuple[Mapping[str, Any], Any]]) -> dict[str, ArchSpec]:
    """The architectures backend plugins add (``quantplug_architectures`` answers with the plugin
    that gave each), checked: each key is its spec's name, and no name is registered twice."""
    reg = registered()
    out: dict[str, ArchSpec] = {}
    owner: dict[str, Any] = {}
    for answer, info in answers:
        for name, spec in answer.items():
            if spec.name != name:
                raise QuantplugError(f"plugin {info}: quantplug_architectures[{name!r}] is ArchSpec "
                                     f"{spec.name!r}; its name must be its key")
            if name in reg.specs or name in out:
                other = (f"{reg.owners[name]} (entry point {ENTRY_POINT_GROUP})" if name in reg.specs
                         else f"plugin {owner[name]}")
                raise QuantplugError(f"plugin {info} adds architecture {name!r}, which {other} already defines")
            out[name], owner[name] = spec, info
    return out
