"""Weight forms: how stored tensors encode a weight matrix, as the core computes with them.

A backend knows storage (names, packing, scales, config); the core knows compute. The meeting
point is a :class:`Form` (a compute layout: ggml blocks, int4 / int8 codes with scales and zero
points, FP8 E4M3 with block / channel / tensor scales, FP4 E2M1 with E8M0 or E4M3 scales and a
global scale, plain floats) plus how the layer's activations are quantized (:class:`ActQuant`).
A scheme's :meth:`~quantplug.api.LinearScheme.form` hands the core its tensors as
:class:`Weights` of one form (repacking them once at load if it must); the core then runs every
product of that layer, the one-token MLP / MoE steps and the absorbed MLA decode step on them,
natively where it can (``qp_kernels.c``), through the scheme's own ``apply`` otherwise.

Exact arithmetic of each form (float32, then rounded once to the model dtype, as
``dequantize(...).to(dtype)``):

==========  ========================================================================================
float       the stored value (F32 / F16 / BF16 rows)
ggml        gguf-py's dequantization of the block (``quantplug.kernels.ggml``)
int         ``(q - zero) * scale``; INT4: q = nibble - 8 (byte j = elements 2j low, 2j+1 high nibble:
            compressed-tensors' pack-quantized words read as bytes); INT8: q = the int8 value
fp8         ``e4m3(q) * scale`` (E4M3FN, NaN codes decode to NaN)
fp4         ``e2m1(nibble) * scale`` (nibbles as INT4)
==========  ========================================================================================

A ``global_scale`` (one float32 per matrix) enters as ``global_mode`` says, each a float32
operation in this order: ``"after"`` ``((q - zero) * scale) * global``; ``"times_scale"``
``(q - zero) * (scale * global)`` (ModelOpt NVFP4: ``weight_scale_2`` multiplies the e4m3 block
scale first); ``"over_scale"`` ``(q - zero) * (scale / global)`` (compressed-tensors NVFP4:
``weight_global_scale`` divides it). Zero points are float32, or int8 for integer zero points
(the same values, a quarter of the bytes).

``scale`` / ``zero`` hold one value per group of ``group`` inputs (0: the whole row) and per
block of ``rows`` rows (1: per row; 0: the whole matrix): ``scale[r // rows, c // group]``.

The table of form ids and block sizes (:data:`FORMS`) is the one the C file states in
``qp_form_info``; ``tests/kernels`` checks the two against each other and the ggml rows against
gguf-py's ``GGML_QUANT_SIZES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import QuantplugError

#: form name -> (C id, elements per block, bytes per block). ggml types keep gguf-py's
#: GGMLQuantizationType numbers; quantplug's own forms are numbered from 100.
FORMS: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "Q8_0": (8, 32, 34),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210), "MXFP4": (39, 32, 17),
    # the IQ and ternary types (block decoders from iq_blocks.h)
    "IQ2_XXS": (16, 256, 66), "IQ2_XS": (17, 256, 74), "IQ3_XXS": (18, 256, 98), "IQ1_S": (19, 256, 50),
    "IQ4_NL": (20, 32, 18), "IQ3_S": (21, 256, 110), "IQ2_S": (22, 256, 82), "IQ4_XS": (23, 256, 136),
    "IQ1_M": (29, 256, 56), "TQ1_0": (34, 256, 54), "TQ2_0": (35, 256, 66),
    "INT4": (100, 2, 1), "INT8": (101, 1, 1), "FP8": (102, 1, 1), "FP4": (103, 2, 1),
}
FLOAT_DTYPES = ("F32", "F16", "BF16")
GGML_TYPES = tuple(k for k, (i, _, _) in FORMS.items() if i < 100 and k not in FLOAT_DTYPES)
#: scale encodings of the int / fp8 / fp4 forms (C: QS_*)
SCALE_ENCODINGS = {"F32": 0, "BF16": 1, "F16": 2, "E8M0": 3, "E4M3": 4}
_SCALE_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "E8M0": torch.uint8,
                "E4M3": torch.float8_e4m3fn}
#: activation quantizations (C: QA_*)
ACT_KINDS = {"fp8": 1, "fp8_static": 2, "int8_sym": 3, "int8_asym": 4, "int8_static": 5,
             "nvfp4": 6, "nvfp4_inv": 7, "mxfp4": 8}
#: kinds that read the layer's static input scale (``Weights.input_scale``)
STATIC_ACTS = ("fp8_static", "int8_static", "nvfp4", "nvfp4_inv")
FP4_ACTS = ("nvfp4", "nvfp4_inv", "mxfp4")
#: how a form's global scale combines with its scales (C: QG_*)
GLOBAL_MODES = {"after": 0, "times_scale": 1, "over_scale": 2}
#: integer epilogues of INT8 weights with int8 activations (C: QE_*)
INTEGER = {"float": 0, "static": 1, "dynamic": 2}


@dataclass(frozen=True)
class ActQuant:
    """How a layer quantizes its input rows before the product (emulated exactly, in both modes).

    * ``fp8``: per row, in groups of ``group`` inputs (0: the whole row): s = max(amax, floor) / 448
      (``floor`` 0: s = amax / 448, a zero s becomes 1), rounded up to a power of two when
      ``ue8m0``; x' = e4m3(x / s) * s (DeepSeek's act_quant: group 128, floor 1e-4;
      compressed-tensors dynamic fp8: floor 0). ``fp8_static``: s is the layer's input scale.
    * ``int8_sym``: s = amax / 127 (0 -> 1), q = clamp(round(x / s)), x' = q * s (vLLM / Ascend
      dynamic per token). ``int8_asym`` (msmodelslim): lo = min(min x, 0), hi = max(max x, 0),
      s = (hi - lo) / 255, o = round(-128 - lo / s), q = clamp(round(x / s + o)), x' = (q - o) * s.
      ``int8_static``: the layer's input scale and offset, as ``int8_asym`` computes with them.
    * FP4 E2M1 per ``group`` inputs of a row (``e2m1_rne``: nearest value, ties to the even code,
      saturating at 6), the group's scale b from its amax: ``nvfp4`` (ModelOpt / TensorRT-LLM, the
      input scale a multiplier): s = amax / (6 * input_scale) (0 -> 1) clamped to [2^-9, 448],
      b = e4m3(s) * input_scale, x' = e2m1_rne(x / b) * b; ``nvfp4_inv`` (compressed-tensors,
      ``input_global_scale`` a divisor): s = e4m3(min(input_scale * (amax / 6), 448)) (0 -> 0.125),
      b = s / input_scale, x' = e2m1_rne(clamp(x / b, -6, 6)) * b; ``mxfp4`` (compressed-tensors'
      dynamic MX activations): p = amax rounded to a power of two by its float32 bits (+ 2^21, the
      mantissa dropped), b = 2^(clamp(log2(p) - 2 + 127, 0, 255) - 127),
      x' = e2m1_rne(clamp(x / b, -6, 6)) * b.
    * ``integer`` (INT8 weights only): ``"float"`` multiplies x' by the weights; ``"static"``
      computes ``(q . w + bias) * output_scale`` on integers (ModelSlim W8A8: ``quant_bias``,
      ``deq_scale``, which fold the input scale and offset); ``"dynamic"``
      ``((q . w - o * rowsum(w)) * s) * scale`` (ModelSlim
      W8A8_DYNAMIC per channel). Both are what the torch paths' ``torch._int_mm`` computes.
    """

    kind: str
    group: int = 0
    ue8m0: bool = False
    floor: float = 0.0
    integer: str = "float"

    def __post_init__(self) -> None:
        if self.kind not in ACT_KINDS:
            raise QuantplugError(f"ActQuant kind {self.kind!r}: expected one of {', '.join(ACT_KINDS)}")
        if self.integer not in INTEGER:
            raise QuantplugError(f"ActQuant integer {self.integer!r}: expected one of {', '.join(INTEGER)}")
        if self.group < 0 or self.floor < 0:
            raise QuantplugError(f"ActQuant: group {self.group} and floor {self.floor} must be >= 0")
        if self.kind in FP4_ACTS and self.integer != "float":
            raise QuantplugError(f"ActQuant {self.kind}: fp4 activations have no integer products")

    def describe(self) -> str:
        if self.kind in FP4_ACTS:
            how = {"nvfp4": "e4m3 scales under the static input_scale", "nvfp4_inv": "e4m3 scales under the static "
                   "input_global_scale (divisor)", "mxfp4": "dynamic e8m0 scales"}[self.kind]
            return f"{self.kind[:5]} activations (per {self.group or 'row'}, {how})"
        if self.kind.startswith("fp8"):
            how = "static" if self.kind == "fp8_static" else f"per token{f', groups of {self.group}' if self.group else ''}"
            return f"fp8 e4m3 activations ({how}{', ue8m0' if self.ue8m0 else ''})"
        how = {"int8_sym": "dynamic symmetric", "int8_asym": "dynamic asymmetric", "int8_static": "static"}[self.kind]
        return f"int8 activations ({how}{'' if self.integer == 'float' else ', integer products'})"


@dataclass(frozen=True)
class Form:
    """A compute layout of one weight matrix [out, in] (see the module docstring).

    ``dtype``: the stored element: a float dtype ("F32", "F16", "BF16"), a ggml type ("Q4_0"...),
    or "INT4" / "INT8" / "FP8" / "FP4". ``scale``: the scale encoding ("F32", "BF16", "F16",
    "E8M0", "E4M3") and ``group`` / ``rows`` its granularity; ``zero``: zero points (float32 or
    int8 values); ``global_scale``: one more float32 scale per matrix, entering as ``global_mode``
    says (``GLOBAL_MODES``: ``"after"``, ``"times_scale"``, ``"over_scale"``; the module
    docstring); ``act``: activation quantization.
    """

    dtype: str
    scale: str = "F32"
    group: int = 0
    rows: int = 1
    zero: bool = False
    global_scale: bool = False
    act: ActQuant | None = None
    global_mode: str = "after"

    def __post_init__(self) -> None:
        if self.dtype not in FORMS:
            raise QuantplugError(f"form dtype {self.dtype!r}: expected one of {', '.join(FORMS)}")
        if self.scale not in SCALE_ENCODINGS:
            raise QuantplugError(f"form scale {self.scale!r}: expected one of {', '.join(SCALE_ENCODINGS)}")
        if self.group < 0 or self.rows < 0:
            raise QuantplugError(f"form group {self.group} / rows {self.rows}: expected >= 0")
        if not self.scaled and (self.zero or self.global_scale or self.group or self.rows != 1):
            raise QuantplugError(f"form {self.dtype}: scales, zero points and groups belong to INT4 / INT8 / FP8 / FP4")
        if self.act is not None and self.act.integer != "float" and self.dtype != "INT8":
            raise QuantplugError(f"integer activation products need INT8 weights, not {self.dtype}")
        if self.global_mode not in GLOBAL_MODES:
            raise QuantplugError(f"form global_mode {self.global_mode!r}: expected one of {', '.join(GLOBAL_MODES)}")
        if self.global_mode != "after" and not self.global_scale:
            raise QuantplugError(f"form global_mode {self.global_mode!r} without a global scale")

    @property
    def scaled(self) -> bool:
        """INT4 / INT8 / FP8 / FP4: codes with separate scales."""
        return FORMS[self.dtype][0] >= 100

    @property
    def block(self) -> tuple[int, int]:
        """(elements, bytes) of one block along a row."""
        return FORMS[self.dtype][1], FORMS[self.dtype][2]

    def row_bytes(self, k: int) -> int:
        e, b = self.block
        return k // e * b

    def describe(self) -> str:
        if not self.scaled:
            s = self.dtype if self.dtype in FLOAT_DTYPES else f"ggml {self.dtype}"
        else:
            gran = ("per tensor" if self.rows == 0 and self.group == 0 else
                    f"block {self.rows}x{self.group}" if self.rows > 1 else
                    f"group {self.group}" if self.group else "per channel")
            s = f"{self.dtype.lower()} {self.scale.lower()} scales {gran}"
            s += " + zero points" if self.zero else ""
            s += {"after": " x global scale", "times_scale": " (scale x global scale)",
                  "over_scale": " (scale / global scale)"}[self.global_mode] if self.global_scale else ""
        return s + (f", {self.act.describe()}" if self.act else "")


@dataclass
class Weights:
    """A layer's weight in one :class:`Form`: what :meth:`LinearScheme.form` returns.

    Stacked layers (routed experts, per-head K/V) carry a leading slot dimension on every tensor.

    * ``weight``: the stored rows, [.., out, in] for float / INT8 / FP8 forms, [.., out, bytes per
      row] for packed ones (any integer dtype: read as bytes, so compressed-tensors' int32 words
      serve as they are);
    * ``scale``: [.., ceil(out / rows), ceil(in / group)] (rows 0 / group 0: 1), as ``form.scale``
      says (E8M0 as uint8 exponents, E4M3 as float8 or uint8 bytes);
    * ``zero``: zero points shaped as ``scale`` (``form.zero``): float32, or int8 when they are
      integers (e.g. GPTQ / AWQ zero points repacked for INT4);
    * ``global_scale``: float32 [..] or [.., 1] (``form.global_scale``);
    * ``input_scale`` / ``input_offset``: static activation quantization (``fp8_static``,
      ``int8_static``), one value per matrix;
    * ``bias`` / ``output_scale``: int32 / float32 [.., out], the ``integer="static"`` epilogue's
      integer bias and output scale (``scale`` still describes the weights' own values).

    ``keep``: tensors the binding must keep alive (e.g. a repacked copy); the core holds the
    :class:`Weights` for as long as it uses them.
    """

    form: Form
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    input_offset: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    output_scale: torch.Tensor | None = None
    keep: list[torch.Tensor] = field(default_factory=list)

    def check(self, out_features: int, in_features: int, slots: int | None, where: str) -> None:
        """Shapes, dtypes and layout against the layer: a QuantplugError naming ``where``
        otherwise (the native code trusts these)."""
        f = self.form
        lead = () if slots is None else (slots,)

        def fail(what: str) -> None:
            raise QuantplugError(f"{where}: form {f.describe()}: {what}")

        e, _ = f.block
        if in_features % e:
            fail(f"{in_features} inputs are not whole blocks of {e}")
        w = self.weight
        if w.dim() != len(lead) + 2 or tuple(w.shape[:len(lead) + 1]) != (*lead, out_features):
            fail(f"weight {list(w.shape)}: expected [{', '.join(map(str, (*lead, out_features)))}, ...]")
        if f.dtype in FLOAT_DTYPES:
            want = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[f.dtype]
            if w.dtype != want or w.shape[-1] != in_features:
                fail(f"weight {w.dtype} {list(w.shape)}: expected {want} [.., {out_features}, {in_features}]")
        elif f.dtype in ("FP8", "INT8") and w.element_size() == 1:
            if w.shape[-1] != in_features:
                fail(f"weight {list(w.shape)}: expected {in_features} values per row")
        else:
            if w.is_floating_point() and f.dtype != "FP8":
                fail(f"weight dtype {w.dtype}: packed rows must be an integer dtype")
            if w.shape[-1] * w.element_size() != f.row_bytes(in_features):
                fail(f"weight rows of {w.shape[-1] * w.element_size()} bytes: expected {f.row_bytes(in_features)}")
        if f.scaled:
            if self.scale is None:
                fail("no scale tensor")
            s = self.scale
            assert s is not None
            want_shape = (*lead, *self.scale_shape(out_features, in_features))
            if tuple(s.shape) != want_shape and not (s.numel() == 1 and want_shape[-2:] == (1, 1)):
                fail(f"scale {list(s.shape)}: expected {list(want_shape)}")
            if s.dtype != _SCALE_TORCH[f.scale] and not (f.scale in ("E8M0", "E4M3") and s.element_size() == 1):
                fail(f"scale dtype {s.dtype}: expected {_SCALE_TORCH[f.scale]} ({f.scale})")
            if not s.is_contiguous():
                fail("scale must be contiguous")
            if f.zero:
                z = self.zero
                if z is None or z.dtype not in (torch.float32, torch.int8) or z.shape != s.shape or not z.is_contiguous():
                    fail(f"zero points must be contiguous float32 or int8 {list(s.shape)}")
            if f.global_scale and (self.global_scale is None or self.global_scale.numel() != (slots or 1)):
                fail(f"global_scale: expected {slots or 1} float32 values")
        act = f.act
        if act is not None and act.kind in STATIC_ACTS and (
                self.input_scale is None or self.input_scale.numel() != (slots or 1)):
            fail(f"static activation quantization needs input_scale ({slots or 1} values)")
        if act is not None and act.integer == "static" and any(
                t is None or t.numel() != out_features * (slots or 1) for t in (self.bias, self.output_scale)):
            fail(f"integer static epilogue needs bias and output_scale of {out_features * (slots or 1)} values")

    def contiguous_rows(self) -> bool:
        """Whether the native kernels can address the weight: contiguous rows, equally spaced
        slots (a narrowed fused tensor qualifies; a transposed one does not)."""
        w = self.weight
        return w.stride(-1) == 1 and w.stride(-2) == w.shape[-1] and (w.dim() == 2 or w.stride(0) >= w.shape[-2] * w.shape[-1])

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        f = self.form
        rows = 1 if f.rows == 0 else -(-out_features // f.rows)
        cols = 1 if f.group == 0 and f.rows == 0 else 1 if f.group == 0 else -(-in_features // f.group)
        return rows, cols


# -- torch reference ---------------------------------------------------------------------------

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def scale_values(t: torch.Tensor, encoding: str) -> torch.Tensor:
    """Decoded float32 scales of a stored scale tensor."""
    if encoding == "E8M0":
        e = t.view(torch.uint8).to(torch.int32)
        v = torch.where(e == 0, torch.full_like(e, 0, dtype=torch.float32) + 2.0 ** -127,
                        (e << 23).view(torch.float32))
        return torch.where(e == 255, torch.full_like(v, float("nan")), v)
    if encoding == "E4M3":
        return t.view(torch.float8_e4m3fn).to(torch.float32)
    return t.to(torch.float32)


def reference_act(w: Weights, x: torch.Tensor, slot: int | None = None) -> torch.Tensor:
    """The activations as the form's exact product sees them (float32), by the definitions in
    :class:`ActQuant`, in torch: what the native kernels compute before the product (an integer
    epilogue's float equivalent, ``(q - o) * s``)."""
    act = w.form.act
    xf = x.to(torch.float32)
    if act is None:
        return xf

    def value(t: torch.Tensor | None) -> torch.Tensor:
        assert t is not None
        return (t.reshape(-1)[slot or 0] if t.numel() > 1 else t.reshape(())).to(torch.float32)

    if act.kind in FP4_ACTS:
        return _fp4_act(act, xf, value(w.input_scale) if act.kind != "mxfp4" else None)
    if act.kind.startswith("fp8"):
        k = xf.shape[-1]
        g = act.group if 0 < act.group < k else k
        out = torch.empty_like(xf)
        for c0 in range(0, k, g):
            part = xf[..., c0:c0 + g]
            if act.kind == "fp8_static":
                s = value(w.input_scale)
            else:
                amax = part.abs().amax(-1, keepdim=True)
                if act.floor > 0:
                    s = amax.clamp(min=act.floor) / 448.0
                    if act.ue8m0:
                        s = torch.exp2(torch.ceil(torch.log2(s)))
                else:
                    s = amax / 448.0
                    s = torch.where(s == 0, torch.ones_like(s), s)
            out[..., c0:c0 + g] = (part / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * s
        return out
    if act.kind == "int8_static":
        s, o = value(w.input_scale), value(w.input_offset) if w.input_offset is not None else torch.tensor(0.0)
    elif act.kind == "int8_sym":
        s = xf.abs().amax(-1, keepdim=True) / 127.0
        s, o = torch.where(s == 0, torch.ones_like(s), s), torch.zeros(())
    else:
        lo = xf.amin(-1, keepdim=True).clamp(max=0)
        hi = xf.amax(-1, keepdim=True).clamp(min=0)
        s = (hi - lo) / 255.0
        s = torch.where(s == 0, torch.ones_like(s), s)
        o = torch.round(-128 - lo / s)
    q = torch.clamp(torch.round(xf / s + o if act.kind != "int8_sym" else xf / s), -128, 127)
    return (q - o) * s


_E2M1_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_E2M1_ODD_TIES = torch.tensor([0.75, 1.75, 3.5])


def e2m1_rne(v: torch.Tensor) -> torch.Tensor:
    """float32 -> the nearest E2M1 value, ties to the even code, |v| > 6 (and NaN) -> 6; negative
    where v < 0 (-0 -> +0)."""
    a = v.abs()
    idx = torch.searchsorted(_E2M1_MIDS, a) + torch.isin(a, _E2M1_ODD_TIES).long()
    mag = _E2M1[:8][idx.clamp_(max=7)]
    return torch.where(v < 0, -mag, mag)


def _fp4_act(act: ActQuant, xf: torch.Tensor, gs: torch.Tensor | None) -> torch.Tensor:
    """:class:`ActQuant`'s FP4 kinds, per group of ``act.group`` inputs (the last may be partial)."""
    k = xf.shape[-1]
    g = act.group if 0 < act.group < k else k
    out = torch.empty_like(xf)
    for c0 in range(0, k, g):
        part = xf[..., c0:c0 + g]
        amax = part.abs().amax(-1, keepdim=True)
        if act.kind == "nvfp4":
            assert gs is not None
            s = amax / (6.0 * gs)
            s = torch.where(s == 0, torch.ones_like(s), s).clamp(2.0 ** -9, 448.0)
            b = s.to(torch.float8_e4m3fn).to(torch.float32) * gs
            out[..., c0:c0 + g] = e2m1_rne(part / b) * b
            continue
        if act.kind == "nvfp4_inv":
            assert gs is not None
            s = (gs * (amax / 6.0)).clamp(max=448.0).to(torch.float8_e4m3fn).to(torch.float32)
            b = torch.where(s == 0, torch.full_like(s, 0.125), s) / gs
        else:
            p = ((amax.contiguous().view(torch.int32) + (1 << 21)) & -(1 << 23)).view(torch.float32)
            b = torch.exp2((127 + torch.floor(torch.log2(p)) - 2).clamp(0, 255) - 127)
        out[..., c0:c0 + g] = e2m1_rne((part / b).clamp(-6.0, 6.0)) * b
    return out
