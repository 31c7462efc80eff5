"""NVIDIA ModelOpt's quantization config, parsed once into a frozen value.

``export_hf_checkpoint`` (nvidia-modelopt 0.47) writes two descriptions of one export:

* ``hf_quant_config.json``: ``{"producer": {"name": "modelopt", "version"}, "quantization":
  {"quant_algo": "NVFP4" | "W4A16_NVFP4" | "FP8" | "MIXED_PRECISION" | ..., "group_size": 16,
  "kv_cache_quant_algo", "exclude_modules": [...], "quantized_layers": {module: {"quant_algo",
  "group_size"}}}}`` (``quantized_layers`` for MIXED_PRECISION only, ``exclude_modules`` for the
  others);
* config.json ``quantization_config``: ``quant_method: "modelopt"``, ``quant_algo``, ``ignore``
  (the same list), ``config_groups`` (compressed-tensors style) and, for MIXED_PRECISION,
  ``quantized_layers``. Older releases (nvidia/DeepSeek-R1-FP4) carry ``exclude_modules`` there.

``hf_quant_config.json`` wins where both exist; a different ``quant_algo`` in the two is an
error. ``quantized_layers`` names are full checkpoint names (``model.layers.3.mlp.experts``: a
parent module covers its children); exclusion entries are read as vLLM and sglang read them, as
substrings of module names (``self_attn`` excludes every attention projection), or ``*``
wildcards.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from quantplug.api import ConfigError, Exclusions

#: per-layer algorithms this plugin computes
SUPPORTED = ("NVFP4", "W4A16_NVFP4", "FP8")
SIDECAR = "hf_quant_config.json"


@dataclass(frozen=True)
class LayerAlgo:
    """What one module is quantized as: ``algo`` (a ModelOpt quant_algo) and its group size."""

    algo: str
    group_size: int | None
    why: str


@dataclass(frozen=True)
class ModelOptConfig:
    algo: str  # the checkpoint's quant_algo (MIXED_PRECISION: per layer)
    group_size: int | None
    exclude: Exclusions
    #: MIXED_PRECISION: (module, algo, group_size), in file order
    layers: tuple[tuple[str, str, int | None], ...]
    kv_cache_algo: str | None
    producer: str
    where: str  # what was read, for messages

    @classmethod
    def parse(cls, checkpoint: Any) -> ModelOptConfig | None:
        cfg = checkpoint.config
        qc, qc_where = cfg.get("quantization_config"), "config.json quantization_config"
        text = cfg.get("text_config")
        if not isinstance(qc, dict) and isinstance(text, dict):
            qc, qc_where = text.get("quantization_config"), "config.json text_config.quantization_config"
        side = checkpoint.sidecar(SIDECAR) if SIDECAR in checkpoint.sidecar_names else None
        ours = isinstance(qc, dict) and qc.get("quant_method") == "modelopt"
        producer = side.get("producer") if isinstance(side, dict) else None
        side_ours = isinstance(side, dict) and isinstance(side.get("quantization"), dict) and (
            not isinstance(producer, dict) or producer.get("name") in (None, "modelopt"))
        if not ours and not side_ours:
            return None
        if isinstance(qc, dict) and qc.get("quant_method") not in (None, "modelopt"):
            return None  # another format's config.json next to a stray sidecar: not ours
        if side_ours:
            assert isinstance(side, dict)
            q, where = side["quantization"], f"{SIDECAR} quantization"
            if ours and isinstance(qc, dict) and str(qc.get("quant_algo", q.get("quant_algo"))) != str(q.get("quant_algo")):
                raise ConfigError(f"{checkpoint.path}: {SIDECAR} quantization.quant_algo {q.get('quant_algo')!r} and "
                                  f"{qc_where}.quant_algo {qc.get('quant_algo')!r} differ; quantplug-modelopt will not "
                                  "guess which one the weights follow")
        else:
            q, where = qc, qc_where
        algo = q.get("quant_algo")
        if not isinstance(algo, str) or not algo:
            raise ConfigError(f"{checkpoint.path}: {where}.quant_algo = {algo!r}: expected a string such as 'NVFP4'")
        gs = _group(q.get("group_size"), f"{where}.group_size", checkpoint.path)
        exclude = q.get("exclude_modules")
        field = "exclude_modules"
        if exclude is None:
            exclude, field = q.get("ignore"), "ignore"
        if exclude is None:
            exclude = []
        if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
            raise ConfigError(f"{checkpoint.path}: {where}.{field} = {exclude!r:.80}: expected a list of module names")
        layers: list[tuple[str, str, int | None]] = []
        if algo == "MIXED_PRECISION":
            raw = q.get("quantized_layers")
            if raw is None and side_ours and ours:
                raw = qc.get("quantized_layers")
            if not isinstance(raw, dict) or not raw:
                raise ConfigError(f"{checkpoint.path}: {where}.quantized_layers = {raw!r:.80}: MIXED_PRECISION needs "
                                  "a non-empty map of module -> {quant_algo, group_size}")
            for name, spec in raw.items():
                if not isinstance(spec, dict) or not isinstance(spec.get("quant_algo"), str):
                    raise ConfigError(f"{checkpoint.path}: {where}.quantized_layers[{name!r}] = {spec!r:.80}: expected "
                                      "an object with a quant_algo string")
                layers.append((str(name), spec["quant_algo"],
                               _group(spec.get("group_size"), f"{where}.quantized_layers[{name!r}].group_size",
                                      checkpoint.path)))
        kv = q.get("kv_cache_quant_algo")
        prefix = "language_model" if any(n.startswith("language_model.") for n in checkpoint.tensors) else ""
        version = producer.get("version") if isinstance(producer, dict) else None
        return cls(algo=algo, group_size=gs,
                   # entries are substrings of module names, as vLLM's / sglang's ModelOpt configs read them
                   # (``module in prefix``); ``*`` wildcards and ``re:`` as everywhere
                   exclude=Exclusions(tuple(exclude), f"{where}.{field}", prefix, substring=True),
                   layers=tuple(layers), kv_cache_algo=str(kv) if kv else None,
                   producer=f"modelopt {version}" if version else "modelopt", where=where)

    @property
    def prefix(self) -> str:
        return self.exclude.prefix

    @functools.cached_property
    def layer_map(self) -> Exclusions:
        """MIXED_PRECISION's ``quantized_layers`` keys as exact names (parents cover children)."""
        return Exclusions(tuple(n for n, _, _ in self.layers), f"{self.where}.quantized_layers", self.prefix)

    def algo_for(self, module: str) -> LayerAlgo | None:
        """What ``module`` (checkpoint name) is quantized as, or None (excluded / not listed)."""
        if self.algo == "MIXED_PRECISION":
            hit = self.layer_map.excluded_by(module)
            if hit is None:
                return None
            _, algo, gs = next(x for x in self.layers if x[0] == hit)
            return LayerAlgo(algo, gs, f"{self.where}.quantized_layers[{hit!r}]")
        entry = self.exclude.excluded_by(module)
        if entry is not None:
            return None
        return LayerAlgo(self.algo, self.group_size, f"{self.where}.quant_algo {self.algo}")

    def why_unquantized(self, module: str) -> str:
        if self.algo == "MIXED_PRECISION":
            return f"not listed in {self.where}.quantized_layers"
        return f"{self.exclude.source} entry {self.exclude.excluded_by(module)!r}"


def _group(v: Any, where: str, path: Any) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ConfigError(f"{path}: {where} = {v!r}: expected a positive integer")
    return v
