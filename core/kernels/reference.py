"""A form's exact dense weight by its definition, in torch (:func:`reference_dequantize`): what
the native exact kernels decode, and what a scheme declaring the form must dequantize to. Apart
from :mod:`quantplug.kernels.forms` because the ggml block types decode through
:mod:`quantplug.kernels.ggml`, which builds on the forms."""

from __future__ import annotations

import torch

from . import ggml
from .forms import _E2M1, FLOAT_DTYPES, Weights, scale_values


def reference_dequantize(w: Weights, out_features: int, in_features: int, slot: int | None = None,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The form's exact dense weight [out, in] (of ``slot``), by its definition, in torch: what the
    native exact kernels decode, and what a scheme declaring the form must dequantize to (the
    conformance kit compares them). Slow and simple on purpose."""
    f = w.form

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return t if t is None or slot is None else t[slot]

    q = pick(w.weight)
    assert q is not None
    if f.dtype in FLOAT_DTYPES:
        return q.to(dtype)
    if not f.scaled:
        return ggml.dequantize(q.contiguous().view(torch.uint8), f.dtype).to(dtype)
    raw = q.contiguous().view(torch.uint8)
    if f.dtype == "INT8":
        vals = raw.view(torch.int8).to(torch.float32)
    elif f.dtype == "FP8":
        vals = raw.view(torch.float8_e4m3fn).to(torch.float32)
    else:
        nib = torch.stack((raw & 15, raw >> 4), dim=-1).flatten(-2)[..., :in_features]
        vals = (nib.to(torch.float32) - 8) if f.dtype == "INT4" else _E2M1[nib.long()]
    s = scale_values(pick(w.scale), f.scale)  # type: ignore[arg-type]
    rows, cols = w.scale_shape(out_features, in_features)
    s = s.reshape(rows, cols)
    r_idx = torch.zeros(out_features, dtype=torch.long) if f.rows == 0 else torch.arange(out_features) // f.rows
    c_idx = torch.zeros(in_features, dtype=torch.long) if cols == 1 else torch.arange(in_features) // f.group
    full = s[r_idx][:, c_idx]
    if f.zero:
        z = pick(w.zero)
        assert z is not None
        vals = vals - z.reshape(rows, cols)[r_idx][:, c_idx]
    if f.global_scale:
        g = pick(w.global_scale)
        assert g is not None
        gv = g.reshape(()).to(torch.float32)
        if f.global_mode == "times_scale":
            return (vals * (full * gv)).to(dtype)
        if f.global_mode == "over_scale":
            return (vals * (full / gv)).to(dtype)
        return (vals * full * gv).to(dtype)
    return (vals * full).to(dtype)
