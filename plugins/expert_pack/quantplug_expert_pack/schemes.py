"""Linear schemes of the ExpertPack backend.

* :class:`GGMLScheme`: one GGUF tensor in any supported ggml type, kept packed (a zero-copy view
  of the memory-mapped GGUF when the model dtype allows), dequantized per matmul by the torch
  kernels in :mod:`.ggml`. Used for linears, split MLA K/V stacks and stacked routed experts.
* :class:`PackedExpertsScheme`: routed experts served from an expert pack through the shared
  LRU :class:`~.pack.ExpertCache`; the module holds no expert weights at all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from quantplug.api import (
    GGUF_FLOATS,
    LinearScheme,
    Problem,
    QuantplugError,
    SplitRule,
    TensorInfo,
    TensorSpec,
    fuse_int4_packs,
    ggml,
)
from torch import nn

from .pack import ROLES, ExpertCache, ExpertPack


class GGMLScheme(LinearScheme):
    """A GGUF tensor in ggml type ``ggml_type``; stacked when used for experts or MLA K/V.

    ``key`` is ``"ggml"`` for every type: llama.cpp files mix types tensor by tensor (llama-quantize
    picks per tensor and falls back to legacy types), and quantplug never fuses GGUF shards, so
    q_a / kv_a_mqa in different types are not a disagreement.
    """

    name = "ggml"

    def __init__(self, ggml_type: str, cache: bool = False, kernels: str = "exact") -> None:
        self.ggml_type = ggml_type
        self.cache = cache
        #: "exact" (dequantize bit-exactly, float matmul) or "fast" (the int4-pack kernel for
        #: ggml.FAST_TYPES, bfloat16 activations; other types stay exact)
        self.kernels = kernels
        #: exact kernels are dequantize then float matmul: MLA decode may absorb kv_b through them
        self.weight_only = kernels != "fast" or ggml_type not in ggml.FAST_TYPES

    @property
    def key(self) -> str:
        return "ggml"

    def describe(self) -> str:
        """The type; under ``kernels="fast"`` which kernel computes it (the native one, ``native.py``,
        where built; torch's int4 kernel), since fast results depend on it."""
        if self.cache:
            return f"ggml {self.ggml_type}; cached dense copy"
        if self.kernels == "fast" and self.ggml_type in ggml.FAST_TYPES:
            # asked only here: an exact plan never builds the native library for its description
            native = self.ggml_type in ggml.native.TYPES and ggml.native.library() is not None
            if native and self.ggml_type == "Q8_0":
                return f"ggml {self.ggml_type}; fast native kernel"
            return f"ggml {self.ggml_type}; fast int4 kernel" + ("; fast native kernel for few rows" if native else "")
        return f"ggml {self.ggml_type}"  # exact: the same numbers whichever kernel runs (native or torch)

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        return [TensorSpec("weight", (self.ggml_type,), (out_features, in_features))]

    def split(self, direction: str, out_features: int, in_features: int) -> dict[str, SplitRule] | None:
        """Rows follow out; along in, a row is whole blocks of ``block`` values in ``size`` bytes
        (32 for Q4_0..Q8_0 / MXFP4, 256 for K-quants: llama.cpp ``ggml-common.h``), so a
        row-parallel part must hold whole blocks or the layer is replicated."""
        if direction == "out":
            return {"weight": SplitRule(0)}
        if self.ggml_type in ggml.FLOAT_TYPES:
            return {"weight": SplitRule(1)}
        if self.ggml_type not in ggml.BLOCKS:
            return None
        block, size = ggml.BLOCKS[self.ggml_type]
        return {"weight": SplitRule(1, block, size)}

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        if self.ggml_type not in ggml.SUPPORTED:
            w = tensors.get("weight")
            return [Problem(f"ggml type {self.ggml_type} has no kernel in quantplug-expert-pack; supported: "
                            f"{', '.join(ggml.SUPPORTED)}", tensor=w.label if w else None, layer=layer_name,
                            file=w.file.name if w else None)]
        return []

    def _dense(self, layer: nn.Module, w: torch.Tensor) -> torch.Tensor:
        if self.ggml_type in ggml.FLOAT_TYPES:
            return w
        return ggml.dequantize(w, self.ggml_type).to(layer.model_dtype)

    def dequantize(self, layer: nn.Module, index: int | None = None) -> torch.Tensor:
        cached = getattr(layer, "_dequantized", None)
        if cached is not None:
            return cached if index is None else cached[index]
        w: torch.Tensor = layer.weight  # type: ignore[assignment]
        return self._dense(layer, w if index is None else w[index])

    def _native(self, layer: nn.Module, x: torch.Tensor, rows: int) -> str | None:
        """The native kernel mode (``ggml.native_*``) for ``rows`` input rows per weight, or None:
        the torch path. Exact needs float32 throughout (a bfloat16 model's reference rounds the
        weights first) and few rows; fast takes few rows, or any count when the weight has no
        int4 form."""
        handle = getattr(layer, "_qpk", None)
        if handle is None or ggml.native.library() is None:
            return None
        handle.check(layer.weight)
        if self.ggml_type in ggml.native.EXACT_ONLY:  # K-quants: the exact kernel in either mode, few rows
            if rows > ggml.NATIVE_EXACT_ROWS:
                return None
            if self.kernels == "fast":
                return "fast"
        elif self.kernels == "fast":
            return "fast" if rows <= ggml.NATIVE_FAST_ROWS or getattr(layer, "_int4", None) is None else None
        if rows <= ggml.NATIVE_EXACT_ROWS and x.dtype == torch.float32 and layer.model_dtype == torch.float32:
            return "exact"
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        mode = self._native(layer, x, x.numel() // max(x.shape[-1], 1))
        if mode is not None:
            return ggml.native_linear(x, [layer._qpk], self.ggml_type, mode, index)
        pack = getattr(layer, "_int4", None)
        if pack is not None:
            if index is not None:
                slot_pack, slot_sz = layer._int4_slots[index]  # type: ignore[index]
                return ggml.int4_linear(x, slot_pack, slot_sz, self.ggml_type)
            return ggml.int4_linear(x, pack, layer._int4_sz, self.ggml_type)
        if getattr(layer, "_dequantized", None) is not None or self.ggml_type in ggml.FLOAT_TYPES:
            return F.linear(x, self.dequantize(layer, index).to(x.dtype))
        w: torch.Tensor = layer.weight  # type: ignore[assignment]
        return ggml.linear(x, w if index is None else w[index], self.ggml_type, layer.model_dtype)

    def fuse(self, layers: Sequence[Any]) -> Callable[..., torch.Tensor] | None:
        """Siblings in this ggml type: one native call for all of them (few rows), and under
        ``kernels="fast"`` their int4 forms as one kernel weight (``fuse_int4_packs``: each layer's
        pack becomes a view of it; the fused scales-and-zeros, 1/4 of the packs, are the one new
        buffer) for more rows; the separate applies where neither holds."""
        if any(getattr(layer.scheme, "ggml_type", None) != self.ggml_type for layer in layers):
            return None
        fused = fuse_int4_packs(layers) if self.kernels == "fast" else None
        int4 = ggml.Int4Fused(fused[0], fused[1], self.ggml_type) if fused is not None else None
        has_native = all(getattr(layer, "_qpk", None) is not None for layer in layers)
        if int4 is None and not has_native:
            return None
        return _GGMLFused(self, list(layers), int4)

    def fuse_mlp(self, gate: nn.Module, up: nn.Module, down: nn.Module) -> Callable[..., torch.Tensor] | None:
        """One token through the MLP (or a step's routed experts) in one native call when all
        three weights are native-kernel types (``native.mlp_one``)."""
        if any(getattr(layer, "_qpk", None) is None for layer in (gate, up, down)):
            return None
        return _GGMLMLP(gate, up, down)

    def fuse_attention(self, attn: nn.Module) -> Callable[..., torch.Tensor | None] | None:
        """A decode step of the MLA layer in two native calls (``native.mla_step``) when its
        projections are native-kernel types, its K/V stacks native types or cached float32, the
        model float32, and the layer has q_lora, split K/V and no output gate."""
        return _GGMLMLA.build(attn)

    def apply_grouped(self, layer: nn.Module, x: torch.Tensor, groups: list[tuple[int, int]]) -> torch.Tensor:
        mode = self._native(layer, x, max(n for _, n in groups))
        if mode is not None:
            return ggml.native_grouped(x, [layer._qpk], self.ggml_type, mode, groups)
        pack = getattr(layer, "_int4", None)
        if pack is None or len(groups) == 1:
            return super().apply_grouped(layer, x, groups)
        return ggml.int4_grouped(x, layer._int4_slots, self.ggml_type, groups)

    def apply_all(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """MLA K/V per head in one call: native (few tokens, one sequence: every head's rows in
        one kernel call), else exact as one batched matmul (the whole stack dequantized into the
        reused buffer, as :func:`ggml.linear` does per matrix); fast: per head, the int4 kernel is 2-D."""
        w: torch.Tensor = layer.weight  # type: ignore[assignment]
        nh, t = x.shape[-3], x.shape[-2]
        if x.numel() == nh * t * x.shape[-1]:  # one sequence
            mode = self._native(layer, x, t)
            if mode is not None:
                y = ggml.native_grouped(x.reshape(nh * t, -1), [layer._qpk], self.ggml_type, mode,
                                        [(h, t) for h in range(nh)])
                return y.view(*x.shape[:-1], y.shape[-1])
        if getattr(layer, "_int4", None) is not None or w.numel() > ggml.LINEAR_CHUNK_ELEMS * 16:
            return super().apply_all(layer, x)
        dense = self.dequantize(layer) if self.ggml_type in ggml.FLOAT_TYPES or self.cache \
            else ggml.dequantize_reused(w, self.ggml_type, layer.model_dtype)
        return torch.matmul(x, dense.to(x.dtype).transpose(-1, -2))

    def embed(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Token embedding: dequantize only the looked-up rows of the packed matrix."""
        if getattr(layer, "_dequantized", None) is not None or self.ggml_type in ggml.FLOAT_TYPES:
            return F.embedding(ids, self.dequantize(layer))
        w: torch.Tensor = layer.weight  # type: ignore[assignment]
        rows = ggml.dequantize(w.index_select(0, ids.reshape(-1)), self.ggml_type)
        return rows.to(layer.model_dtype).view(*ids.shape, -1)

    def process_after_loading(self, layer: nn.Module) -> None:
        if self.cache and self.ggml_type not in ggml.FLOAT_TYPES:
            layer.register_buffer("_dequantized", self._dense(layer, layer.weight), persistent=False)  # type: ignore[arg-type]
            return
        w: torch.Tensor = layer.weight  # type: ignore[assignment]
        if ggml.native_ok(w, self.ggml_type):
            layer._qpk = ggml.NativeWeight(w, self.ggml_type)
        # Q8_0's int4 form is two int4 halves (twice the work): with native kernels it is not made
        # and the fast model holds the packed bytes only. Q4_0 keeps its int4 form: torch's int4
        # kernel prefills 64 tokens ~1.2x faster than the native one (the native one is as fast
        # for a decode step; measured in the issue 14 note)
        if self.kernels == "fast" and not (self.ggml_type == "Q8_0" and getattr(layer, "_qpk", None) is not None):
            # repacked once, here (counted in load time and model bytes); the packed weight stays
            # for dequantize / export and the native kernels
            fast = ggml.int4_repack(w, self.ggml_type)
            if fast is not None:
                layer.register_buffer("_int4", fast[0], persistent=False)
                layer.register_buffer("_int4_sz", fast[1], persistent=False)
                if fast[0].dim() == 3:  # stacked experts: each slot's views, made once
                    layer._int4_slots = list(zip(fast[0].unbind(0), fast[1].unbind(0)))  # type: ignore[assignment]


class _GGMLMLP:
    """What :meth:`GGMLScheme.fuse_mlp` returns: ``f(x)`` / ``f(x, slots, weights)`` for one token
    through ``native.mlp_one`` (exact: float32 model and input; else fast under ``kernels="fast"``),
    or, when the native kernels are off, the composition of the layers' own applies."""

    def __init__(self, gate: Any, up: Any, down: Any) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.types = (gate.scheme.ggml_type, up.scheme.ggml_type, down.scheme.ggml_type)
        self.fast = {layer.scheme.kernels for layer in (gate, up, down)} == {"fast"}
        self.exact = {layer.scheme.kernels for layer in (gate, up, down)} == {"exact"} and \
            {layer.model_dtype for layer in (gate, up, down)} == {torch.float32}

    def _mode(self, x: torch.Tensor) -> str | None:
        """As ``GGMLScheme._native`` for one row, once for the three layers."""
        if ggml.native.library() is None:
            return None
        for layer in (self.gate, self.up, self.down):
            layer._qpk.check(layer.weight)
        return "fast" if self.fast else "exact" if self.exact and x.dtype == torch.float32 else None

    def __call__(self, x: torch.Tensor, slots: Sequence[int] | None = None,
                 weights: Sequence[float] | None = None) -> torch.Tensor:
        mode = self._mode(x)
        if mode is None:
            return self._composed(x, slots, weights)
        ix = [0] if slots is None else list(slots)
        g, u, d = (layer._qpk for layer in (self.gate, self.up, self.down))
        if not (g.k == u.k == x.shape[-1] == d.n and d.k == g.n == u.n) or any(not 0 <= i < len(g.ptrs) for i in ix):
            raise QuantplugError(f"native MLP: input {list(x.shape)} / slots {ix} do not fit gate {g.n}x{g.k}, "
                                 f"up {u.n}x{u.k}, down {d.n}x{d.k} ({len(g.ptrs)} slots)")
        xf = x.reshape(1, -1)
        xf = xf if xf.dtype == torch.float32 and xf.is_contiguous() else xf.float().contiguous()
        out = ggml.native.mlp_one(xf, self.types, [g.ptrs[i] for i in ix], [u.ptrs[i] for i in ix],
                                  [d.ptrs[i] for i in ix], g.n, mode, weights)
        return out.to(x.dtype).view(x.shape)

    def _composed(self, x: torch.Tensor, slots: Sequence[int] | None, weights: Sequence[float] | None) -> torch.Tensor:
        gate, up, down = self.gate, self.up, self.down
        if slots is None:
            return down(F.silu(gate(x)) * up(x))
        out = None
        for s, w in zip(slots, weights if weights is not None else [1.0] * len(slots)):
            y = (down(F.silu(gate(x, s)) * up(x, s), s) * w).to(x.dtype)
            out = y if out is None else out + y
        assert out is not None
        return out


class _GGMLMLA:
    """What :meth:`GGMLScheme.fuse_attention` returns (see there and ``LinearScheme.fuse_attention``)."""

    def __init__(self, attn: Any, step: Any, keep: list[torch.Tensor], layers: list[Any]) -> None:
        self.attn, self.step, self.keep, self.layers = attn, step, keep, layers
        self.ptrs = [t.data_ptr() for t in keep]

    @staticmethod
    def build(attn: Any) -> _GGMLMLA | None:
        native = ggml.native
        cfg = attn.cfg
        if (native.library() is None or attn.q_lora is None or attn.layout.kind == "dense" or cfg.mla_use_output_gate
                or attn.num_heads != cfg.num_attention_heads):
            return None
        mats = {"q_a": attn.q_a_proj, "kv_a": attn.kv_a_proj_with_mqa, "q_b": attn.q_b_proj, "o": attn.o_proj}
        stacks = {"k_b": attn.k_b, "v_b": attn.v_b}
        layers = [*mats.values(), *stacks.values()]
        if any(not isinstance(m.scheme, GGMLScheme) or m.model_dtype != torch.float32 for m in layers):
            return None
        # the kernel mode: the projections' (the K/V stacks' schemes are always "exact"; their
        # blocks or float32 copy then run in the step's mode)
        kernels = {m.scheme.kernels for m in mats.values()}
        if len(kernels) != 1:
            return None
        keep: list[torch.Tensor] = []
        fields: dict[str, Any] = {}
        for name, m in mats.items():
            if getattr(m, "_qpk", None) is None:
                return None
            keep.append(m.weight)
            fields[name], fields[f"t_{name}"] = m.weight.data_ptr(), native.MAT_TYPES[m.scheme.ggml_type]
        for name, m in stacks.items():
            dense = getattr(m, "_dequantized", None)
            w = dense if dense is not None else m.weight if getattr(m, "_qpk", None) is not None else None
            if w is None or not w.is_contiguous():
                return None
            keep.append(w)
            fields[name], fields[f"t_{name}"] = w.data_ptr(), 2 if dense is not None else native.MAT_TYPES[m.scheme.ggml_type]
            fields[f"s_{name}"] = w[0].numel() * w.element_size()
        norms = [attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight]
        if any(n.dtype != torch.float32 or not n.is_contiguous() for n in norms):
            return None
        keep += norms
        dims = {"H": cfg.hidden_size, "q_lora": cfg.q_lora_rank, "kv_lora": attn.kv_lora_rank, "rope": attn.qk_rope_head_dim,
                "nope": cfg.qk_nope_head_dim, "v": cfg.v_head_dim, "nh": attn.num_heads}
        if fields["t_k_b"] != 2 and dims["nope"] % 32 or fields["t_v_b"] != 2 and dims["kv_lora"] % 32:
            return None
        # the C code trusts these shapes: every matrix must be what the dimensions say
        H, nh = dims["H"], dims["nh"]
        want = {"q_a": (dims["q_lora"], H), "kv_a": (dims["kv_lora"] + dims["rope"], H),
                "q_b": (nh * (dims["nope"] + dims["rope"]), dims["q_lora"]), "o": (H, nh * dims["v"])}
        if any((m._qpk.n, m._qpk.k) != want[name] for name, m in mats.items()):
            return None
        for name, (rows, k) in (("k_b", (dims["kv_lora"], dims["nope"])), ("v_b", (dims["v"], dims["kv_lora"]))):
            m = stacks[name]
            dense = getattr(m, "_dequantized", None)
            got = (tuple(dense.shape) == (nh, rows, k)) if dense is not None else \
                (m._qpk.n, m._qpk.k, len(m._qpk.ptrs)) == (rows, k, nh)
            if not got:
                return None
        kv_kernels = {m.scheme.kernels for m in stacks.values()}  # the composed path's mode for them
        if len(kv_kernels) != 1:
            return None
        step = native.MLAStep(mode=native.MODES[kernels.pop()], kv_mode=native.MODES[kv_kernels.pop()],
                              eps_q=attn.q_a_layernorm.eps,
                              eps_kv=attn.kv_a_layernorm.eps, scale=attn.scale, q_a_norm=norms[0].data_ptr(),
                              kv_a_norm=norms[1].data_ptr(), rot=None, **dims, **fields)
        return _GGMLMLA(attn, step, keep, layers)

    def __call__(self, x: torch.Tensor, rotation: torch.Tensor, cache: Any) -> torch.Tensor | None:
        if (ggml.native.library() is None or x.dtype != torch.float32 or rotation.dtype != torch.float32
                or not rotation.is_contiguous() or any(t.data_ptr() != p for t, p in zip(self.keep, self.ptrs))):
            return None
        step = ggml.native.MLAStep.from_buffer_copy(self.step)  # per call: concurrent forwards differ in rotation
        step.rot = rotation.data_ptr()

        def append(latent: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            lat, kr = cache.append(latent.view(1, 1, 1, -1), key.view(1, 1, 1, -1))
            return lat[0, 0], kr[0, 0]

        xf = x.reshape(-1)
        out = ggml.native.mla_step(step, xf if xf.is_contiguous() else xf.contiguous(), append)
        return out.view(1, 1, -1)


class _GGMLFused:
    """What :meth:`GGMLScheme.fuse` returns: ``f(x)`` / ``f(x, groups)`` = the layers' outputs
    side by side, through one native call when the rows allow it, else the fused int4 weight, else
    each layer's own apply."""

    def __init__(self, scheme: GGMLScheme, layers: list[Any], int4: ggml.Int4Fused | None) -> None:
        self.scheme, self.layers, self.int4 = scheme, layers, int4

    def __call__(self, x: torch.Tensor, groups: list[tuple[int, int]] | None = None) -> torch.Tensor:
        rows = max(n for _, n in groups) if groups is not None else x.numel() // max(x.shape[-1], 1)
        modes = {self.scheme._native(layer, x, rows) for layer in self.layers}
        if len(modes) == 1 and None not in modes:
            mode = modes.pop()
            handles = [layer._qpk for layer in self.layers]
            if groups is None:
                return ggml.native_linear(x, handles, self.scheme.ggml_type, mode)
            return ggml.native_grouped(x, handles, self.scheme.ggml_type, mode, groups)
        if self.int4 is not None:
            return self.int4(x, groups)
        if groups is None:
            return torch.cat([layer.scheme.apply(layer, x) for layer in self.layers], dim=-1)
        return torch.cat([layer.scheme.apply_grouped(layer, x, groups) for layer in self.layers], dim=-1)


class PackedExpertsScheme(LinearScheme):
    """Routed experts ``role`` of MoE layer ``layer``, read from ``pack`` through ``cache``.

    Declares no checkpoint tensors: the plan checks the pack's index entries instead (every
    expert present, shape [out, in], one supported ggml type) in :meth:`check`, from the index
    alone. Forward reads the selected expert's payloads on first use (checksum verified once).
    """

    name = "expert-pack"

    def __init__(self, pack: ExpertPack, cache: ExpertCache, layer: int, role: str) -> None:
        self.pack, self.cache, self.layer, self.role = pack, cache, layer, role
        self._role = ROLES.index(role)
        self._shape: tuple[int, int] | None = None
        types = {e.ggml_type for e in pack.layer_entries(layer, role)} if pack.has_layer(layer) else set()
        self.ggml_type = types.pop() if len(types) == 1 else "mixed" if types else "absent"

    @property
    def key(self) -> str:
        return "ggml"

    def describe(self) -> str:
        return f"ggml {self.ggml_type} experts from {self.pack.path.name} (LRU cache {self.cache.budget >> 20} MiB)"

    def tensor_specs(self, out_features: int, in_features: int) -> list[TensorSpec]:
        self._shape = (out_features, in_features)
        return []

    def check(self, layer_name: str, tensors: Mapping[str, TensorInfo]) -> list[Problem]:
        where = f"{self.pack.path.name}: layer {self.layer} {self.role}"
        if not self.pack.has_layer(self.layer):
            return [Problem(f"{where}: the expert pack has no entries for MoE layer {self.layer} "
                            f"(it has layers {self.pack.layers})", layer=layer_name, file=self.pack.path.name)]
        problems = []
        if self.ggml_type == "mixed":
            problems.append(Problem(f"{where}: experts use different ggml types; one type per layer and role "
                                    "is expected", layer=layer_name, file=self.pack.path.name))
        if self.ggml_type not in ggml.SUPPORTED and self.ggml_type != "mixed":
            problems.append(Problem(f"{where}: ggml type {self.ggml_type} has no kernel; supported: "
                                    f"{', '.join(ggml.SUPPORTED)}", layer=layer_name, file=self.pack.path.name))
        for e in self.pack.layer_entries(self.layer, self.role):
            if self._shape is not None and e.shape != self._shape:
                problems.append(Problem(f"{where}: entry {e.describe()} has shape {list(e.shape)}, the model "
                                        f"expects {list(self._shape)}", layer=layer_name, file=self.pack.path.name))
                break
        return problems

    def dequantize(self, layer: nn.Module, index: int | None = None) -> torch.Tensor:
        if index is None:
            return torch.stack([self.dequantize(layer, e) for e in range(self.pack.n_experts)])
        raw, entry_type = self._raw(index)
        w = ggml.dequantize(raw, entry_type).to(layer.model_dtype)
        # a float payload may come back as the slot itself: copy, the caller may keep it
        return w.clone() if w.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr() else w

    def _raw(self, index: int) -> tuple[torch.Tensor, str]:
        """Expert ``index``'s payload for this role (a view of a cache slot: use it before the next
        cache read) and its ggml type; float payloads viewed in their dtype."""
        raw = self.cache.get(self.layer, index)[self._role]
        entry_type = self.pack.entry(self.layer, index, self.role).ggml_type
        if entry_type in ggml.FLOAT_TYPES:
            raw = raw.view(GGUF_FLOATS[entry_type])
        return raw, entry_type

    def apply(self, layer: nn.Module, x: torch.Tensor, index: int | None = None) -> torch.Tensor:
        if index is None:
            return F.linear(x, self.dequantize(layer).to(x.dtype))
        raw, entry_type = self._raw(index)
        return ggml.linear(x, raw, entry_type, layer.model_dtype)
