"""acme-quant: int8 weights with one float32 scale per output row, as a quantplug backend.

Written only against ``quantplug.api``. Format: config.json ``quantization_config =
{"quant_method": "acme", "bits": 8, "ignore": [...]}``; every linear projection of the text
model is stored as ``<module>.weight`` I8 [out, in] + ``<module>.weight_scale`` F32 [out, 1]
(w = weight * weight_scale), except the modules in ``ignore`` (names without the Kimi
``language_model.`` prefix); everything else is stored as floats.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from quantplug.api import (
    Claim,
    ExportResult,
    Fields,
    Form,
    LinearScheme,
    OptionSpec,
    TensorSpec,
    Weights,
    dense_state,
    hookimpl,
    quant_config_fields,
)
from safetensors.torch import save_file

__version__ = "1.0.0"
#: the quantplug contract this backend is written for
QUANTPLUG_CONTRACT = "1.4"
PREFIX = "language_model."
#: linear weights: ``*_proj`` (not Kimi-K3's attention-residual ``*_res_proj`` [1, hidden], a float
#: parameter), DeepSeek's ``kv_a_proj_with_mqa``, the Kimi family's experts ``w1`` / ``w2`` / ``w3``
_LINEAR = re.compile(r"^(model\.layers\.\d+\..+((?<!_res)_proj(_with_mqa)?|\.w[123])|lm_head)\.weight$")


@dataclass(frozen=True)
class AcmeConfig:
    bits: int
    ignore: frozenset[str]

    @classmethod
    def parse(cls, qc: Fields) -> AcmeConfig:
        # typed readers: a wrong type or value is one ConfigError naming config.json and the key path
        bits = qc.get_int("bits", 8, 8, 8)  # acme-quant reads 8-bit weights only
        return cls(bits, frozenset(qc.str_list("ignore")))

    def quantized(self, module: str) -> bool:
        return module.removeprefix(PREFIX) not in self.ignore


class Int8RowScheme(LinearScheme):
    """int8 weight, float32 scale per output row; apply scales after the matmul."""

    name = "acme-int8-row"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        return [TensorSpec("weight", ("I8",), (out_features, in_features)),
                TensorSpec("weight_scale", ("F32",), (out_features, 1), target="F32")]

    def _tensors(self, layer: Any, index: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        w, s = layer.weight, layer.weight_scale
        return (w, s) if index is None else (w[index], s[index])

    def dequantize(self, layer: Any, index: int | None = None) -> torch.Tensor:
        w, s = self._tensors(layer, index)
        return (w.float() * s).to(layer.model_dtype)

    def apply(self, layer: Any, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        w, s = self._tensors(layer, index)
        return (F.linear(x.float(), w.float()) * s.view(-1)).to(x.dtype)

    def form(self, layer: Any) -> Weights:
        """The stored tensors as the core's int8 form (one float32 scale per row): the core runs
        every product natively, with no C here (contract 1.4)."""
        return Weights(Form("INT8", scale="F32"), layer.weight, scale=layer.weight_scale)


@hookimpl
def quantplug_detect(checkpoint: Any) -> Claim | None:
    qc, _ = quant_config_fields(checkpoint)
    if qc is None or qc.opt_str("quant_method") != "acme":
        return None
    return Claim("acme", AcmeConfig.parse(qc), "quantization_config.quant_method == 'acme'")


@hookimpl
def quantplug_options() -> list[OptionSpec]:
    return []  # acme reads no options: any given option other than the core's is a plan error


@hookimpl
def quantplug_linear_scheme(layer_name: str, layer_kind: str, shard_names: Any, quant_config: AcmeConfig) -> Any:
    if layer_kind not in ("linear", "experts"):
        return None  # embeddings (and kinds added later) are stored as floats
    names = list(shard_names) if layer_kind == "experts" else [layer_name]
    return Int8RowScheme() if all(quant_config.quantized(n) for n in names) else None


@hookimpl
def quantplug_export(model: Any, destination: Path, plan: Any) -> ExportResult:
    config = copy.deepcopy(plan.checkpoint.config)
    for cfg in (config, config.get("text_config") or {}):
        cfg.pop("quantization_config", None)
    files = write_acme(destination, config, dense_state(model))
    return ExportResult(Path(destination), "acme int8 (per-row float32 scale)", files)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (weight I8 [out, in], weight_scale F32 [out, 1])."""
    scale = (w.float().abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8), scale


def write_acme(path: str | Path, config: Mapping[str, Any], state: Mapping[str, torch.Tensor],
               ignore: tuple[str, ...] = ("lm_head",)) -> tuple[Path, ...]:
    """Write an acme checkpoint (config.json + model.safetensors) from dense weights named as stored."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    qc = AcmeConfig(8, frozenset(ignore))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        text = name.removeprefix(PREFIX)
        if _LINEAR.match(text) and t.dim() == 2 and qc.quantized(text.removesuffix(".weight")):
            tensors[name], tensors[f"{name}_scale"] = quantize(t)
        else:
            tensors[name] = t.contiguous()
    out = dict(copy.deepcopy(config))
    out["quantization_config"] = {"quant_method": "acme", "bits": 8, "ignore": sorted(ignore)}
    (root / "config.json").write_text(json.dumps(out, indent=2))
    save_file(tensors, str(root / "model.safetensors"))
    return (root / "model.safetensors",)
