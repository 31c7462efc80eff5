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

from quantplug.api import ConfigError, Exclusions, quant_config_fields, sidecar_fields

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
        """The config of a ModelOpt checkpoint, or None when it is not one. Every field is read
        through ``quantplug.api.Fields``: a wrong type or value is one ConfigError naming the file
        and the key path."""
        qc, qc_path = quant_config_fields(checkpoint)
        method = qc.opt_str("quant_method") if qc is not None else None
        if method not in (None, "modelopt"):
            return None  # another format's config.json (next to a stray sidecar): not ours
        ours = method == "modelopt"
        side = sidecar_fields(checkpoint, SIDECAR)
        producer = side.opt_obj("producer") if side is not None else None
        side_q = None
        if side is not None and (producer is None or producer.opt_str("name") in (None, "modelopt")):
            side_q = side.opt_obj("quantization")
        if not ours and side_q is None:
            return None
        if side_q is not None:
            q, where = side_q, f"{SIDECAR} quantization"
        else:
            assert qc is not None
            q, where = qc, f"config.json {qc_path}"
        algo = q.get_str("quant_algo")
        q.expect(bool(algo), "quant_algo", "a non-empty string such as 'NVFP4'")
        if side_q is not None and ours:
            assert qc is not None
            other = qc.opt_str("quant_algo")
            if other is not None and other != algo:
                raise ConfigError(f"{checkpoint.path}: {SIDECAR} quantization.quant_algo {algo!r} and config.json "
                                  f"{qc_path}.quant_algo {other!r} differ; quantplug-modelopt will not guess which "
                                  "one the weights follow")
        field = "exclude_modules" if q.has("exclude_modules") else "ignore"
        exclude = q.str_list(field)
        for i, e in enumerate(exclude):
            if e.startswith("re:"):
                q.regex(f"{field}[{i}]", e[3:])
        layers: list[tuple[str, str, int | None]] = []
        if algo == "MIXED_PRECISION":
            src = q
            if not q.has("quantized_layers") and side_q is not None and ours and qc is not None:
                src = qc  # older exports put the per-layer map in config.json only
            entries = src.entries("quantized_layers")
            src.expect(bool(entries), "quantized_layers",
                       "a non-empty map of module -> {quant_algo, group_size} (MIXED_PRECISION)")
            for name, spec in entries:
                assert spec is not None
                layers.append((name, spec.get_str("quant_algo"), spec.opt_int("group_size", 1, 1 << 16)))
        version = producer.opt_str("version") if producer is not None else None
        prefix = "language_model" if any(n.startswith("language_model.") for n in checkpoint.tensors) else ""
        return cls(algo=algo, group_size=q.opt_int("group_size", 1, 1 << 16),
                   # entries are substrings of module names, as vLLM's / sglang's ModelOpt configs read them
                   # (``module in prefix``); ``*`` wildcards and ``re:`` as everywhere
                   exclude=Exclusions(exclude, f"{where}.{field}", prefix, substring=True),
                   layers=tuple(layers), kv_cache_algo=q.opt_str("kv_cache_quant_algo") or None,
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

