"""The backend conformance kit: one class a backend's test suite subclasses.

A vendor writes::

    from quantplug.testing import BackendConformance
    from acme_quant import write_acme

    class TestAcme(BackendConformance):
        backend = "acme"

        def write_checkpoint(self, path, config, dense_state):
            write_acme(path, config, dense_state)

``write_checkpoint`` writes the backend's format (config.json included) into directory ``path``
from a tiny dense DeepSeek-V3 / Kimi-K2.5 model: ``config`` is its config.json dict (Kimi:
wrapped, text config under ``text_config``), ``dense_state`` its weights as stored in a hub
checkpoint (per-expert routed experts, Kimi names under ``language_model.``, vision tensors
included). Bundled backends that can export write it with :meth:`export_checkpoint`.

pytest then runs every ``test_*`` check below against the installed backend (the entry point
named ``backend``, or ``plugin`` when set), each in an isolated plugin manager (core defaults +
this backend; no other entry points, no ``QUANTPLUG_*`` variables). Each failure says what the
backend did and what to change.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import importlib
import importlib.metadata as md
import json
import shutil
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import pytest
import torch
import torch.nn.functional as F

from ..api import LAYER_KINDS, ExportResult, LinearScheme, QuantplugError, TensorSpec, dense_state, plan_of
from ..checkpoint import Checkpoint
from ..kernels import compute, native
from ..kernels.forms import reference_act
from ..kernels.reference import reference_dequantize
from ..layers.linear import DenseScheme, FusedProjections, PlannedModule, QuantLinear, StackedLinear
from ..loader import load
from ..models.deepseek import Embedding
from ..plan import LoadPlan, build_plan
from ..plugins import ENTRY_POINT_GROUP, PluginManager
from . import hub_rope_spelling, random_state, text_names, tiny_config, wrap_kimi, write_checkpoint
from .formats import FORMATS, write_format_fixtures
from .probes import (
    forbid_data_reads,
    installed,
    isolated_plugin_manager,
    rename_stored_tensor,
    truncate_file,
    write_distribution,
)
from .reference import hf_logits, rel_err

#: the kit's model: 2 layers (one dense MLP, one MoE with 4 experts + 1 shared), every in_features
#: a multiple of 64 (MXFP4 and int4 groups of 32, ggml blocks of 32); most FP8 [128, 128] blocks
#: are partial (kv_a_proj_with_mqa: 96 x 64)
KIT_CONFIG: dict[str, Any] = {
    "vocab_size": 160, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 64,
    "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
    "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32, "v_head_dim": 32,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
}
#: checkpoint layouts the kit writes: DeepSeek-V3 (hub spelling) and the Kimi-K2.5 wrapper with vision
LAYOUTS = ("deepseek_v3", "kimi_k25")
#: a layer kind no quantplug version asks about
UNKNOWN_KIND = "quantplug-conformance-unknown-kind"


def _fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


class _Recorder:
    """Wraps a manager's ``call``: names the hook being run, records the backend's answers."""

    def __init__(self, pm: PluginManager, backend: str) -> None:
        self.pm, self.backend, self.current = pm, backend, ""
        self.answers: list[tuple[str, dict[str, Any], Any]] = []
        self._call = pm.call
        pm.call = self.call  # type: ignore[method-assign]

    def call(self, hook: str, plugins: Any, *, firstresult: bool | None = None, **kwargs: Any) -> list[tuple[Any, Any]]:
        outer, self.current = self.current, hook
        try:
            answers = self._call(hook, plugins, firstresult=firstresult, **kwargs)
        finally:
            self.current = outer
        for value, info in answers:
            if info.name == self.backend:
                self.answers.append((hook, kwargs, value))
        return answers

    def replay(self, hook: str, kwargs: dict[str, Any]) -> Any:
        got = self._call(hook, [self.backend], **kwargs)
        return got[0][0] if got else None


def _mutable_part(value: Any, where: str, top: bool = True) -> str | None:
    """Where ``value`` is not a frozen value (None when it is)."""
    if value is None or isinstance(value, bool | int | float | complex | str | bytes | Path | enum.Enum | type
                                   | range | types.MappingProxyType | torch.dtype):
        return None
    if isinstance(value, frozenset | tuple):
        for i, item in enumerate(value):
            found = _mutable_part(item, f"{where}[{i}]", top=False)
            if found:
                return found
        return None
    if isinstance(value, list | dict | set | bytearray):
        return f"{where} is a {type(value).__name__} (use a tuple, frozenset or types.MappingProxyType)"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if not value.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            return f"{where} is a {type(value).__name__} dataclass without frozen=True"
        for f in dataclasses.fields(value):
            if f.compare:  # compare=False fields are caches / handles, not part of the value
                found = _mutable_part(getattr(value, f.name), f"{where}.{f.name}", top=False)
                if found:
                    return found
        return None
    if top:
        return f"{where} is a {type(value).__name__} object (return a frozen dataclass)"
    return None  # a handle held by a frozen value (an open file, a cache): its own business


class BackendConformance:
    """Subclass as ``Test<Name>``, set :attr:`backend`, implement :meth:`write_checkpoint`."""

    #: the backend's entry-point name (= the name its Claims carry)
    backend: ClassVar[str] = ""
    #: the plugin object (module or import path); None: load the installed entry point ``backend``
    plugin: ClassVar[Any] = None
    #: layouts to check (drop "kimi_k25" only if the format cannot hold a Kimi wrapper)
    layouts: ClassVar[tuple[str, ...]] = LAYOUTS
    #: changes to :data:`KIT_CONFIG` (e.g. larger dims for a format with bigger blocks)
    config_overrides: ClassVar[Mapping[str, Any]] = {}
    #: ``options=`` for every plan and load (e.g. ``{"activation_quant": "none"}`` for a weight-only forward)
    options: ClassVar[Mapping[str, Any]] = {}
    #: ``options`` passed to ``quantplug_export`` (by the round-trip check and :meth:`export_checkpoint`)
    export_options: ClassVar[Mapping[str, Any]] = {}
    #: forward vs transformers on the backend's own dequantized weights, and apply vs dequantize + matmul;
    #: raise it only for a format whose forward quantizes activations, and say why in a comment
    forward_rtol: ClassVar[float] = 1e-5
    #: dequantized weights vs the dense weights they were written from (max abs err / max abs)
    weight_rtol: ClassVar[float] = 0.35
    #: bundled formats (keys of ``quantplug.testing.formats.FORMATS``) this backend reads on purpose
    claims_formats: ClassVar[tuple[str, ...]] = ()

    # -- what the vendor writes ---------------------------------------------------------------

    def write_checkpoint(self, path: Path, config: dict[str, Any], dense_state: dict[str, torch.Tensor]) -> None:
        """Write ``dense_state`` in the backend's format, with ``config`` as config.json, into ``path``."""
        raise NotImplementedError(f"{type(self).__name__}.write_checkpoint(path, config, dense_state) must write "
                                  f"a {self.backend!r} checkpoint: the conformance kit builds every test case with it")

    # -- helpers ------------------------------------------------------------------------------

    def plugin_object(self) -> Any:
        """The backend's plugin object (``plugin``, or the installed entry point ``backend``)."""
        plugin = type(self).plugin
        if isinstance(plugin, str):
            return importlib.import_module(plugin)
        if plugin is not None:
            return plugin
        eps = [ep for ep in md.entry_points(group=ENTRY_POINT_GROUP) if ep.name == self.backend]
        if not eps:
            _fail(f"no entry point named {self.backend!r} in group {ENTRY_POINT_GROUP!r} is installed: install your "
                  f"distribution (pip install -e .), or set `plugin = <your module>` on {type(self).__name__}")
        return eps[0].load()

    def export_checkpoint(self, path: Path, config: dict[str, Any], dense_state: dict[str, torch.Tensor], *,
                          options: Mapping[str, Any] | None = None, pick: int = 0) -> ExportResult:
        """Write the checkpoint with the backend's own ``quantplug_export``: a dense checkpoint is
        written beside ``path``, loaded, exported, and export result number ``pick`` copied to ``path``."""
        path = Path(path)
        dense_dir = write_checkpoint(path.parent / f"{path.name}.dense", config, dense_state)
        model = load(dense_dir, plugin_manager=isolated_plugin_manager(), progress=False)
        pm = isolated_plugin_manager({self.backend: self.plugin_object()})
        out = path.parent / f"{path.name}.export"
        out.mkdir()
        plan: LoadPlan = model.quantplug_plan  # type: ignore[assignment]
        results = pm.export(self.backend, model=model, destination=out, plan=plan,
                            options=self.export_options if options is None else options)
        if not results:
            _fail(f"backend {self.backend!r} has no quantplug_export: implement write_checkpoint yourself")
        shutil.copytree(results[pick].path, path, dirs_exist_ok=True)
        return results[pick]

    # -- fixtures -----------------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def quantplug_kit(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Kit]:
        # the kit's model is tiny: one thread computes it fastest, and a shared CI box's other
        # processes do not stall OpenMP's worker pool (restored after the class)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        kit = _Kit(cls(), tmp_path_factory.mktemp(f"conformance-{cls.backend or 'unnamed'}"))
        try:
            yield kit
        finally:
            kit.close()
            torch.set_num_threads(threads)

    def _layout(self, kit: _Kit, layout: str) -> _Case:
        if layout not in self.layouts:
            pytest.skip(f"{type(self).__name__}.layouts leaves out {layout}")
        return kit.case(layout)

    # -- the checks ---------------------------------------------------------------------------

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_claims_its_own_checkpoint(self, quantplug_kit: _Kit, layout: str) -> None:
        """quantplug_detect returns a Claim for the checkpoint write_checkpoint wrote."""
        case = self._layout(quantplug_kit, layout)
        claim = quantplug_kit.claim(case.path)
        if claim is None:
            _fail(f"[claims own checkpoint] quantplug_detect of {self.backend!r} returned None for the {layout} "
                  f"checkpoint its own write_checkpoint wrote ({_listing(case.path)}); detect must recognise "
                  "its format from config.json, sidecar files or the tensor headers (checkpoint.config, "
                  "checkpoint.sidecar(name), checkpoint.tensors)")

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_plan_of_its_own_checkpoint_is_clean(self, quantplug_kit: _Kit, layout: str) -> None:
        """The plan of the backend's own checkpoint has no error Problems."""
        case = self._layout(quantplug_kit, layout)
        plan = quantplug_kit.plan(case.path)
        if plan.backend != self.backend:
            _fail(f"[clean plan] the {layout} checkpoint was planned by {plan.backend or 'the dense core'}, "
                  f"not {self.backend!r} (see test_claims_its_own_checkpoint)")
        if plan.errors:
            listing = "\n  ".join(p.describe() for p in plan.errors[:10])
            _fail(f"[clean plan] the plan of backend {self.backend}'s own {layout} checkpoint has {len(plan.errors)} "
                  f"error(s); the tensors write_checkpoint wrote must be the ones the backend's schemes declare "
                  f"(TensorSpec names, dtypes, shapes):\n  {listing}")

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_does_not_claim_a_dense_checkpoint(self, quantplug_kit: _Kit, layout: str) -> None:
        """A plain float checkpoint (no quantization_config, no sidecars) is not the backend's."""
        case = self._layout(quantplug_kit, layout)
        claim = quantplug_kit.claim(case.dense_path)
        if claim is not None:
            _fail(f"[does not claim dense] quantplug_detect of {self.backend!r} claimed a plain dense {layout} "
                  f"checkpoint (config.json without quantization_config, float safetensors) with reason "
                  f"{claim.reason!r}: return None unless the checkpoint is in your format, or every user who "
                  "installs the backend loses dense loading")

    def test_declares_the_contract_of_the_features_it_uses(self) -> None:
        """QUANTPLUG_CONTRACT is at least the version of every hook, ``quantplug.api`` name and
        optional ``LinearScheme`` member the backend's package uses (``quantplug.testing.contract``):
        an older declaration lets an older quantplug accept a plugin it cannot run."""
        from .contract import shortfall

        missing = shortfall(self.plugin_object())
        if missing:
            _fail(f"[contract version] backend {self.backend!r}: " + "; ".join(missing[:6])
                  + f"; declare QUANTPLUG_CONTRACT = {max(m.split('needs contract ')[1].split(',')[0] for m in missing)!r}")

    @pytest.mark.parametrize("fmt", sorted(FORMATS))
    def test_does_not_claim_other_formats(self, quantplug_kit: _Kit, fmt: str) -> None:
        """The tiny fixtures of the bundled formats are not claimed (two claims are ambiguous)."""
        if fmt == self.backend or fmt in self.claims_formats:
            pytest.skip(f"{fmt} is backend {self.backend}'s own format")
        path = quantplug_kit.formats()[fmt]
        claim = quantplug_kit.claim(path)
        if claim is not None:
            _fail(f"[does not claim other formats] quantplug_detect of {self.backend!r} claimed a {fmt} checkpoint "
                  f"({_listing(path)}) with reason {claim.reason!r}: users with the bundled {fmt!r} backend get "
                  "AmbiguousBackendError. Claim only what your format is recognised by (e.g. "
                  "quantization_config.quant_method == 'yours'); if reading that format is intended, list it in "
                  f"{type(self).__name__}.claims_formats")

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_plan_reads_no_tensor_data(self, quantplug_kit: _Kit, layout: str) -> None:
        """Planning uses headers only: no hook reads tensor bytes."""
        case = self._layout(quantplug_kit, layout)
        rec = quantplug_kit.recorder
        with forbid_data_reads(case.path, lambda: rec.current or "planning") as reads:
            try:
                quantplug_kit.plan(case.path)
            except (QuantplugError, AssertionError):
                if not reads:
                    raise
        if reads:
            listing = "\n  ".join(reads.events[:5])
            _fail(f"[plan reads no tensor data] planning backend {self.backend}'s {layout} checkpoint read tensor data (by the code named):\n"
                  f"  {listing}\nhooks see headers only (checkpoint.tensors: name, dtype, shape, offsets); read "
                  "data in the scheme after loading (process_after_loading) instead")

    def test_hook_answers_are_frozen_and_repeatable(self, quantplug_kit: _Kit) -> None:
        """Every answer is a frozen value (Claim.quant_config included), of the type the hook
        documents, and the same question asked again gets an equal answer."""
        rec = quantplug_kit.recorder
        rec.answers.clear()
        for layout in self.layouts:
            quantplug_kit.plan(quantplug_kit.case(layout).path)
        if not any(hook == "quantplug_detect" for hook, _, _ in rec.answers):
            _fail(f"[frozen answers] the kit saw no answer of {self.backend!r} while planning its own checkpoints "
                  "(see test_claims_its_own_checkpoint)")
        problems: list[str] = []
        for hook, _, value in rec.answers:
            problems += _check_answer(hook, value)
        for hook, kwargs, value in rec.answers[:200]:
            again = rec.replay(hook, kwargs)
            if _fingerprint(hook, again) != _fingerprint(hook, value):
                problems.append(f"{hook}({_args(kwargs)}) answered {_fingerprint(hook, value)!r}, then "
                                f"{_fingerprint(hook, again)!r} when asked again: answers must depend only on the "
                                "arguments (no hidden state)")
        if problems:
            listing = "\n  ".join(dict.fromkeys(problems))
            _fail(f"[frozen answers] backend {self.backend}'s hook answers:\n  {listing}")

    def test_unknown_layer_kind_gets_none(self, quantplug_kit: _Kit) -> None:
        """quantplug_linear_scheme answers None for a layer kind it does not know (kinds are added over time)."""
        plan = quantplug_kit.plan(quantplug_kit.case(self.layouts[0]).path)
        targets = [d.target for d in plan.decisions if d.hook == "quantplug_linear_scheme"]
        asked: list[str] = []
        for name in targets[:1] + targets[-1:]:
            answers = quantplug_kit.pm.call(
                "quantplug_linear_scheme", [self.backend], layer_name=name, layer_kind=UNKNOWN_KIND,
                shard_names=(name,), quant_config=plan.quant_config, checkpoint=plan.checkpoint,
                options=plan.options)
            if answers:
                asked.append(f"{name}: {answers[0][0]!r}")
        if asked:
            _fail(f"[unknown layer kind] quantplug_linear_scheme of {self.backend!r} answered for layer_kind "
                  f"{UNKNOWN_KIND!r} ({'; '.join(asked)}): return None for kinds you do not handle (known today: "
                  f"{', '.join(LAYER_KINDS)}; later versions may ask about new ones)")

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_forward_matches_transformers(self, quantplug_kit: _Kit, layout: str) -> None:
        """Logits equal transformers' DeepseekV3ForCausalLM run on the backend's own dequantized
        weights (``quantplug.api.dense_state`` of the loaded model), fp32."""
        case = self._layout(quantplug_kit, layout)
        quantplug_kit.check_forward(case.path, case, f"{layout} checkpoint")

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_apply_agrees_with_dequantize(self, quantplug_kit: _Kit, layout: str) -> None:
        """For every quantized layer, scheme.apply(x) == x @ scheme.dequantize().T (and embed == row lookup)."""
        case = self._layout(quantplug_kit, layout)
        model = quantplug_kit.load(case.path)
        bad = _apply_mismatches(model, self.forward_rtol, quantplug_kit.ids)
        if bad:
            listing = "\n  ".join(bad[:8])
            _fail(f"[apply agrees with dequantize] {len(bad)} layer(s) of backend {self.backend}'s {layout} checkpoint "
                  f"compute something else than their own dequantized weight (rel err > {self.forward_rtol:g}):\n"
                  f"  {listing}\napply(layer, x) must equal x @ dequantize(layer).T: check scales, zero points, "
                  "packing order and the stacked index in both")

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_form_agrees_with_the_scheme(self, quantplug_kit: _Kit, layout: str) -> None:
        """Where the scheme declares a weight form (``LinearScheme.form``, contract 1.4), the form's
        exact values equal ``dequantize`` (rel 1e-6) and the core's exact product on the layer's
        activations equals ``apply`` (rel 1e-5, activation quantization included; a fast mode's
        product is held to ``forward_rtol`` against dequantize + matmul instead)."""
        case = self._layout(quantplug_kit, layout)
        n, bad = _form_mismatches(quantplug_kit.load(case.path), quantplug_kit.ids, self.forward_rtol)
        if not n:
            pytest.skip(f"backend {self.backend!r} declares no weight form for the {layout} model under options "
                        f"{dict(self.options)}")
        if bad:
            listing = "\n  ".join(bad[:8])
            _fail(f"[form agrees with the scheme] {len(bad)} layer(s) of backend {self.backend}'s {layout} checkpoint "
                  f"declare a form that computes something else than their scheme:\n  {listing}\nform(layer) must "
                  "describe exactly what dequantize returns (scales, zero points, packing, group sizes) and the "
                  "activation quantization apply performs: the core computes every product from the form")

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_fused_projections_equal_separate_applies(self, quantplug_kit: _Kit, layout: str) -> None:
        """Where the scheme fused sibling projections (``LinearScheme.fuse``, under ``options``),
        the fused call equals the layers' own applies side by side."""
        self._check_fusions(quantplug_kit, layout, _fused_mismatches, "projections", "fused projections",
                            "fused group(s)", "their layers' own applies",
                            "fuse(layers) must return the layers' outputs side by side, in the order given")

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_one_token_fusions_equal_the_model_path(self, quantplug_kit: _Kit, layout: str) -> None:
        """Where a one-token MLP / routed-expert block or MLA decode step runs as one call (the
        core's native steps on the layers' forms, or a scheme's deprecated ``fuse_mlp`` /
        ``fuse_attention``), it equals the model's own composition of the layers' products, and
        the attention step appends the same latent and key to the cache."""
        self._check_fusions(quantplug_kit, layout, _one_token_mismatches, "one-token MLP or attention step",
                            "one-token fusions", "fused step(s)", "the model's own path",
                            "the form (or fuse_mlp / fuse_attention) must compute what the separate applies compute")

    def _check_fusions(self, kit: _Kit, layout: str, mismatches: Any, none: str, tag: str, unit: str, ref: str,
                       hint: str) -> None:
        """Load the layout's checkpoint, skip if ``mismatches`` finds no fusion of this kind, fail
        listing those whose output differs from ``ref`` by more than ``forward_rtol``."""
        case = self._layout(kit, layout)
        fused, bad = mismatches(kit.load(case.path), self.forward_rtol)
        if not fused:
            pytest.skip(f"backend {self.backend!r} fuses no {none} of the {layout} model under options "
                        f"{dict(self.options)}")
        if bad:
            listing = "\n  ".join(bad[:8])
            _fail(f"[{tag}] {len(bad)} {unit} of backend {self.backend}'s {layout} checkpoint "
                  f"compute something else than {ref} (rel err > {self.forward_rtol:g}):\n"
                  f"  {listing}\n{hint}")

    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_dequantized_weights_are_close_to_the_source(self, quantplug_kit: _Kit, layout: str) -> None:
        """dense_state of the loaded model is the dense model write_checkpoint was given, up to
        quantization error (``weight_rtol``), under the same names."""
        case = self._layout(quantplug_kit, layout)
        quantplug_kit.check_weights(quantplug_kit.load(case.path), case, f"{layout} checkpoint")

    def test_missing_tensor_is_named_at_plan_time(self, quantplug_kit: _Kit) -> None:
        """With one tensor of a quantized layer gone (a scale, preferably), the plan fails naming it."""
        case = quantplug_kit.case(self.layouts[0])
        plan = quantplug_kit.plan(case.path)
        info = _victim(plan)
        work = quantplug_kit.copy(case.path, "missing")
        stored = info.stored_name or info.name
        rename_stored_tensor(work / info.file.name, stored)
        text, raised = quantplug_kit.plan_errors(work)
        if stored not in text:
            _fail(f"[missing tensor] {stored} (in {info.file.name}) was removed from backend {self.backend}'s checkpoint, "
                  f"but the plan {'raised' if raised else 'reported'}: {text or 'no error'}. Declare every tensor "
                  "a scheme needs in tensor_specs (optional=False) so the plan names a missing one before loading")

    def test_truncated_file_is_named_at_plan_time(self, quantplug_kit: _Kit) -> None:
        """A weight file cut in the middle of its last tensor fails the plan, naming the file.

        safetensors and GGUF files are size-checked against their headers when the checkpoint is
        indexed, so this is a plan-time error (never a load-time one) whatever the backend; the
        check makes sure the backend does not hide it (e.g. by failing differently in detect).
        """
        case = quantplug_kit.case(self.layouts[0])
        ckpt = Checkpoint.open(case.path)
        file = max(ckpt.files, key=lambda f: f.stat().st_size)
        last = max((t for t in ckpt.tensors.values() if t.file == file), key=lambda t: t.offset)
        ckpt.close()
        work = quantplug_kit.copy(case.path, "truncated")
        cut = truncate_file(work / file.name, last.offset + last.nbytes // 2)
        text, raised = quantplug_kit.plan_errors(work)
        if file.name not in text:
            _fail(f"[truncated file] {file.name} was cut by {cut} bytes (inside tensor {last.label}), but planning "
                  f"{'raised' if raised else 'reported'}: {text or 'no error'}; expected a QuantplugError naming "
                  f"{file.name} at plan time")

    def test_export_round_trip(self, quantplug_kit: _Kit) -> None:
        """quantplug_export of a dense model writes checkpoints this backend claims, plans cleanly and
        loads to a model that matches transformers on its dequantized weights (skipped without export)."""
        if not quantplug_kit.pm.implements(self.backend, "quantplug_export"):
            pytest.skip(f"{self.backend!r} does not implement quantplug_export")
        case = quantplug_kit.case(self.layouts[0])
        model = load(case.dense_path, plugin_manager=isolated_plugin_manager(), progress=False)
        plan: LoadPlan = model.quantplug_plan  # type: ignore[assignment]
        out = quantplug_kit.root / "export"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        results = quantplug_kit.pm.export(self.backend, model=model, destination=out, plan=plan,
                                          options=self.export_options)
        if not results:
            _fail(f"[export round trip] quantplug_export of {self.backend!r} returned None for a dense model")
        for res in results:
            label = f"exported checkpoint {res.format!r} ({res.path})"
            exported = quantplug_kit.plan(res.path)
            if exported.backend != self.backend or exported.errors:
                listing = "; ".join(p.describe() for p in exported.errors[:5])
                _fail(f"[export round trip] {label}: planned by {exported.backend or 'the dense core'}"
                      f"{', errors: ' + listing if listing else ''}; an export must be claimed by its own backend "
                      "and plan cleanly")
            loaded = quantplug_kit.check_forward(res.path, case, label)
            quantplug_kit.check_weights(loaded, case, label)

    def test_found_through_its_entry_point(self, quantplug_kit: _Kit) -> None:
        """Entry-point discovery (``quantplug.backends``) lists the backend active and it claims its
        checkpoint. Uses the installed distribution, else a throwaway one pointing at the module."""
        installed_eps = [ep for ep in md.entry_points(group=ENTRY_POINT_GROUP) if ep.name == self.backend]
        plugin = quantplug_kit.plugin
        module = getattr(plugin, "__name__", None)
        if not installed_eps and not isinstance(plugin, types.ModuleType):
            pytest.skip(f"{self.backend!r} is not installed and its plugin is not a module an entry point can name")
        site = quantplug_kit.root / "site"
        with _maybe_installed(site, None if installed_eps else (self.backend, str(module))):
            pm = PluginManager(env={"QUANTPLUG_PLUGINS": self.backend})
            rec = {r.name: r for r in pm.records()}.get(self.backend)
            if rec is None or rec.status != "active":
                _fail(f"[entry point] entry point {self.backend!r} in group {ENTRY_POINT_GROUP!r}: "
                      f"{'not found' if rec is None else f'{rec.status}: {rec.error}'}")
            plan = build_plan(quantplug_kit.case(self.layouts[0]).path, plugin_manager=pm, options=self.options)
            if plan.backend != self.backend:
                _fail(f"[entry point] loaded through its entry point, {self.backend!r} did not claim its checkpoint")


# ---------------------------------------------------------------------------------------------
# the kit's state for one test class
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Case:
    layout: str
    config: dict[str, Any]          # config.json as written (Kimi: wrapped)
    text_config: dict[str, Any]     # the text model's config, transformers 5 spelling (the reference's)
    state: dict[str, torch.Tensor]  # dense weights as stored (Kimi: language_model. + vision)
    prefix: str
    path: Path                      # the backend's checkpoint
    dense_path: Path                # the same model, dense


_FORMAT_CACHE: dict[tuple[str, str], dict[str, Path]] = {}


class _Kit:
    def __init__(self, test: BackendConformance, root: Path) -> None:
        if not test.backend:
            raise TypeError(f"{type(test).__name__}: set `backend = '<entry-point name>'`")
        self.test, self.root, self.backend = test, root, test.backend
        self.plugin = test.plugin_object()
        self.pm = isolated_plugin_manager({self.backend: self.plugin})
        self.recorder = _Recorder(self.pm, self.backend)
        self.text_config = tiny_config(**{**KIT_CONFIG, **dict(test.config_overrides)})
        self.ids = torch.randint(0, self.text_config["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
        self._cases: dict[str, _Case] = {}
        self._models: dict[Path, torch.nn.Module] = {}

    def close(self) -> None:
        self._models.clear()

    def case(self, layout: str) -> _Case:
        if layout not in self._cases:
            text = self.text_config
            state = random_state(text, seed=1)
            if layout == "kimi_k25":
                config, state, prefix = *wrap_kimi(hub_rope_spelling(text), state), "language_model"
            else:
                config, prefix = {**hub_rope_spelling(text), "architectures": ["DeepseekV3ForCausalLM"]}, ""
            dense_path = write_checkpoint(self.root / layout / "dense", config, state)
            path = self.root / layout / self.backend
            path.mkdir(parents=True)
            self.test.write_checkpoint(path, copy.deepcopy(config), dict(state))
            if not (path / "config.json").is_file():
                _fail(f"{type(self.test).__name__}.write_checkpoint wrote no config.json into {path}")
            self._cases[layout] = _Case(layout, config, text, state, prefix, path, dense_path)
        return self._cases[layout]

    def formats(self) -> dict[str, Path]:
        key = (str(self.root.parent), json.dumps(self.text_config, sort_keys=True))
        if key not in _FORMAT_CACHE:
            root = self.root.parent / f"formats-{len(_FORMAT_CACHE)}"
            _FORMAT_CACHE[key] = write_format_fixtures(root, {**self.text_config}, random_state(self.text_config))
        return _FORMAT_CACHE[key]

    def claim(self, path: Path) -> Any:
        """The backend's own answer to quantplug_detect for ``path`` (None: not claimed)."""
        answers = self.pm.call("quantplug_detect", [self.backend], checkpoint=Checkpoint.open(path))
        return answers[0][0] if answers else None

    def plan(self, path: Path) -> LoadPlan:
        return build_plan(path, plugin_manager=self.pm, options=self.test.options)

    def plan_errors(self, path: Path) -> tuple[str, bool]:
        """The plan's errors as text (or the QuantplugError it raised), and whether it raised."""
        try:
            plan = self.plan(path)
        except QuantplugError as exc:
            return str(exc), True
        return "\n".join(p.describe() for p in plan.errors), False

    def load(self, path: Path) -> torch.nn.Module:
        if path not in self._models:
            try:
                self._models[path] = load(path, plugin_manager=self.pm, options=self.test.options, progress=False)
            except QuantplugError as exc:
                _fail(f"{self.backend!r} cannot load {path} ({type(exc).__name__}), so this check cannot run; "
                      f"fix the plan first (test_plan_of_its_own_checkpoint_is_clean):\n{exc}")
        return self._models[path]

    def copy(self, path: Path, tag: str) -> Path:
        dst = self.root / f"{path.parent.name}-{tag}"
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(path, dst)
        return dst

    def text_state(self, model: torch.nn.Module, case: _Case) -> dict[str, torch.Tensor]:
        """dense_state of ``model``, text names (the plan's prefix removed: a backend that renames
        tensors may load a Kimi checkpoint under unprefixed model names)."""
        state = dense_state(model)
        prefix = plan_of(model).prefix
        cut = f"{prefix}." if prefix else ""
        return {k[len(cut):]: v for k, v in state.items() if k.startswith(cut)}

    def check_forward(self, path: Path, case: _Case, label: str) -> torch.nn.Module:
        model = self.load(path)
        with torch.no_grad():
            got = model(self.ids)
        try:
            import transformers  # noqa: F401
        except ImportError:
            _fail("the forward check runs transformers' DeepseekV3ForCausalLM as the reference: "
                  "pip install 'transformers>=5' (or quantplug[test])")
        ref = hf_logits(case.text_config, self.text_state(model, case), self.ids)
        err = rel_err(got, ref)
        if not err <= self.test.forward_rtol:
            _, forms = _form_mismatches(model, self.ids, self.test.forward_rtol)
            bad = _apply_mismatches(model, self.test.forward_rtol, self.ids)
            hint = ("; these layers' declared form disagrees with their scheme (the core computes from the "
                    "form):\n  " + "\n  ".join(forms[:5]) if forms else
                    "; these layers' apply disagrees with their dequantize:\n  " + "\n  ".join(bad[:5]) if bad else
                    "; every scheme's apply agrees with its dequantize, so look at process_after_loading / "
                    "model-level post-processing")
            _fail(f"[forward matches transformers] {self.backend!r}, {label}: logits differ from transformers' "
                  f"DeepseekV3ForCausalLM run on the backend's own dequantized weights (quantplug.api.dense_state): "
                  f"max rel err {err:.3g} > {self.test.forward_rtol:g}{hint}")
        return model

    def check_weights(self, model: torch.nn.Module, case: _Case, label: str) -> None:
        got = self.text_state(model, case)
        want = {n: case.state[(f"{case.prefix}." if case.prefix else "") + n] for n in text_names(case.text_config)}
        missing = sorted(set(want) - set(got))
        if missing:
            _fail(f"[weights close to source] {self.backend!r}, {label}: dense_state of the loaded model lacks "
                  f"{len(missing)} tensor(s), e.g. {missing[:3]}")
        far = []
        for name, w in want.items():
            err = rel_err(got[name].float(), w.float())
            if not err <= self.test.weight_rtol:
                far.append((err, name))
        if far:
            listing = "\n  ".join(f"{n}: rel err {e:.3g}" for e, n in sorted(far, reverse=True)[:8])
            _fail(f"[weights close to source] {self.backend!r}, {label}: {len(far)} dequantized weight(s) are far "
                  f"from the dense weights write_checkpoint was given (max abs err / max abs > "
                  f"{self.test.weight_rtol:g}):\n  {listing}\ncheck that dequantize applies the scales "
                  "(and zero points) and that write_checkpoint quantizes the tensor it names")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

@contextmanager
def _maybe_installed(site: Path, entry: tuple[str, str] | None) -> Iterator[None]:
    if entry is None:
        yield
        return
    shutil.rmtree(site, ignore_errors=True)
    name, module = entry
    write_distribution(site, f"{name}-conformance-probe", "0.0.0", {name: module})
    with installed(site):
        yield


def _listing(path: Path) -> str:
    names = sorted(p.name for p in Path(path).iterdir())
    return ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")


def _args(kwargs: Mapping[str, Any]) -> str:
    keys = ("layer_name", "layer_kind")
    shown = [f"{k}={kwargs[k]!r}" for k in keys if k in kwargs]
    return ", ".join(shown)


def _check_answer(hook: str, value: Any) -> list[str]:
    out: list[str] = []
    if hook == "quantplug_detect":
        found = _mutable_part(value.quant_config, "Claim.quant_config")
        if found:
            out.append(f"quantplug_detect: {found}; the parsed config is shared by every later hook and load")
    elif hook == "quantplug_linear_scheme":  # the answer's type is checked by the plugin manager
        specs = value.tensor_specs(256, 256)
        if not all(isinstance(s, TensorSpec) for s in specs):
            out.append(f"{type(value).__name__}.tensor_specs must return TensorSpec values")
        if not isinstance(value.key, str) or not isinstance(value.describe(), str):
            out.append(f"{type(value).__name__}.key / describe() must be str")
    elif hook in ("quantplug_tensor_names", "quantplug_packed_modules"):
        for k, v in value.items():
            ok = isinstance(v, str) if hook == "quantplug_tensor_names" else (
                isinstance(v, Sequence) and not isinstance(v, str) and all(isinstance(s, str) for s in v))
            if not isinstance(k, str) or not ok:
                out.append(f"{hook}: entry {k!r}: {v!r} is not name -> "
                           f"{'name' if hook == 'quantplug_tensor_names' else 'list of shard names'}")
                break
    elif hook == "quantplug_resolve_prefix":
        pass
    else:
        for i, item in enumerate(value if isinstance(value, list | tuple) else [value]):
            found = _mutable_part(item, f"{hook} answer[{i}]")
            if found:
                out.append(f"{hook}: {found}")
    return out


def _fingerprint(hook: str, value: Any) -> Any:
    if value is None:
        return None
    if hook == "quantplug_detect":
        return (value.backend, value.reason, type(value.quant_config).__name__)
    if hook == "quantplug_linear_scheme":
        return (type(value).__name__, value.key) if isinstance(value, LinearScheme) else repr(value)
    if isinstance(value, Mapping):
        return {k: tuple(v) if isinstance(v, list | tuple) else v for k, v in value.items()}
    if isinstance(value, list | tuple):
        return tuple(getattr(v, "describe", lambda v=v: repr(v))() for v in value)
    return value


def _victim(plan: LoadPlan) -> Any:
    """A tensor the plan needs: preferably a scale of a quantized layer, else a quantized weight."""
    best = None
    for pp in plan.params:
        scheme = getattr(pp.module, "scheme", None)
        if scheme is None or isinstance(scheme, DenseScheme) or not pp.sources:
            continue
        info = pp.sources[0][1]
        if pp.local != "weight":
            return info
        best = best or info
    return best or plan.params[0].sources[0][1]


def _layer_inputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[tuple[int, int | None], torch.Tensor]:
    """The first few input rows each (layer, stacked index) sees in a forward pass on ``ids``:
    realistic activations (schemes with static activation ranges clip anything else)."""
    seen: dict[tuple[int, int | None], torch.Tensor] = {}
    schemes = [getattr(m, "scheme", None) for m in model.modules()]
    classes: set[type[LinearScheme]] = {type(s) for s in schemes if isinstance(s, LinearScheme)}
    saved = [(cls, cls.__dict__.get("apply")) for cls in classes]

    def wrap(original: Any) -> Any:
        def apply(self: LinearScheme, layer: torch.nn.Module, x: torch.Tensor, index: int | None = None) -> Any:
            seen.setdefault((id(layer), index), x.detach().reshape(-1, x.shape[-1])[:4].clone())
            return original(self, layer, x, index)
        return apply

    try:
        for cls, _ in saved:
            cls.apply = wrap(cls.apply)  # type: ignore[method-assign]
        with torch.no_grad(), native.disabled():  # every product through the scheme's apply
            model(ids)
    finally:
        for cls, own in reversed(saved):
            if own is None:
                del cls.apply
            else:
                cls.apply = own
    return seen


def _apply_mismatches(model: torch.nn.Module, rtol: float, ids: torch.Tensor) -> list[str]:
    """Layers whose apply differs from dequantize + matmul, on the inputs they see in a forward
    pass on ``ids`` (random ones for layers the pass does not reach, e.g. unrouted experts).
    Stacked layers also check ``apply_grouped`` / ``apply_all`` where the scheme overrides them."""
    g = torch.Generator().manual_seed(3)
    inputs = _layer_inputs(model, ids)
    bad: list[str] = []

    def x_for(mod: torch.nn.Module, slot: int | None, in_features: int) -> torch.Tensor:
        x = inputs.get((id(mod), slot))
        return torch.randn(3, in_features, generator=g) if x is None else x.float()

    for mod in model.modules():
        scheme = getattr(mod, "scheme", None)
        if scheme is None or isinstance(scheme, DenseScheme):
            continue
        errs: dict[str, float] = {}
        with torch.no_grad():
            if isinstance(mod, Embedding):
                w = scheme.dequantize(mod).float()
                rows = torch.randint(0, w.shape[0], (2, 5), generator=g)
                errs["embed"] = rel_err(scheme.embed(mod, rows).float(), F.embedding(rows, w))
            elif isinstance(mod, QuantLinear):
                x = x_for(mod, None, mod.in_features)
                errs["apply"] = rel_err(scheme.apply(mod, x).float(), F.linear(x, scheme.dequantize(mod).float()))
            elif isinstance(mod, StackedLinear):
                xs = [x_for(mod, i, mod.in_features)[:3] for i in range(mod.n)]
                refs = [F.linear(x, scheme.dequantize(mod, i).float()) for i, x in enumerate(xs)]
                errs["apply"] = max(rel_err(scheme.apply(mod, xs[i], i).float(), refs[i]) for i in range(mod.n))
                cls = type(scheme)
                if cls.apply_grouped is not LinearScheme.apply_grouped:
                    got = scheme.apply_grouped(mod, torch.cat(xs), [(i, len(x)) for i, x in enumerate(xs)])
                    errs["apply_grouped"] = rel_err(got.float(), torch.cat(refs))
                if cls.apply_all is not LinearScheme.apply_all and all(len(x) == len(xs[0]) for x in xs):
                    got = scheme.apply_all(mod, torch.stack(xs))
                    errs["apply_all"] = rel_err(got.float(), torch.stack(refs))
            else:
                continue
        for what, err in errs.items():
            if not err <= rtol:
                bad.append(f"{mod.qp_ckpt} ({scheme.describe()}): {what} rel err {err:.3g}")
    return bad


def _form_mismatches(model: torch.nn.Module, ids: torch.Tensor, rtol: float) -> tuple[int, list[str]]:
    """(layers bound to a form, those whose form disagrees with their scheme's dequantize / apply)."""
    g = torch.Generator().manual_seed(6)
    inputs = _layer_inputs(model, ids)
    n, bad = 0, []
    with torch.no_grad():
        for mod in model.modules():
            if not isinstance(mod, PlannedModule) or mod.qp_native is None:
                continue
            b = mod.qp_native
            n += 1
            scheme: Any = mod.scheme
            where = f"{mod.qp_ckpt} ({scheme.describe()}; form {b.form.describe()})"
            stacked = isinstance(mod, StackedLinear)
            for slot in ((0, b.slots - 1) if stacked else (None,)):
                ref = scheme.dequantize(mod, slot).float()
                got = reference_dequantize(b.weights, b.n, b.k, slot, mod.model_dtype).float()  # type: ignore[arg-type]
                if got.shape != ref.shape or not rel_err(got, ref) <= 1e-6:
                    err = rel_err(got, ref) if got.shape == ref.shape else float("inf")
                    bad.append(f"{where}{'' if slot is None else f' slot {slot}'}: form values vs dequantize rel err {err:.3g}")
                    continue
                if isinstance(mod, Embedding):
                    continue
                x = inputs.get((id(mod), slot))
                x = torch.randn(3, b.k, generator=g) if x is None else x.float()
                x = x.to(mod.model_dtype)  # type: ignore[arg-type]
                native_y = compute.linear(mod, x, slot) if native.library() is not None else None
                if native_y is None:  # no native kernels: the form's product by its torch definition
                    if b.mode == "fast":
                        continue
                    native_y = F.linear(reference_act(b.weights, x, slot), got)
                if b.mode == "fast":  # an approximate product: bounded against the exact weights
                    want, tol = F.linear(x.float(), ref), rtol
                else:
                    want, tol = (scheme.apply(mod, x, slot) if stacked else scheme.apply(mod, x)), 1e-5
                err = rel_err(native_y.float(), want.float())
                if not err <= tol:
                    bad.append(f"{where}{'' if slot is None else f' slot {slot}'}: the form's product vs apply "
                               f"rel err {err:.3g}")
    return n, bad


def _one_token_mismatches(model: torch.nn.Module, rtol: float) -> tuple[int, list[str]]:
    """(number of one-token steps run as one call, those that differ from the model's own path)."""
    from ..generate import LatentCache
    from ..models.deepseek import MLA, MLP, Experts

    g = torch.Generator().manual_seed(5)
    n, bad = 0, []

    def check(what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        err = rel_err(got.float(), ref.float()) if got.shape == ref.shape else float("inf")
        if not err <= rtol:
            bad.append(f"{what}: rel err {err:.3g}" + ("" if got.shape == ref.shape else
                                                       f" (shape {list(got.shape)}, want {list(ref.shape)})"))

    @contextmanager
    def composed(mod: Any) -> Iterator[None]:
        saved = (getattr(mod, "step", None), getattr(mod, "one", None))
        mod.step, mod.one = None, None
        try:
            yield
        finally:
            mod.step, mod.one = saved

    with torch.no_grad():
        for mod in model.modules():
            step: Any = getattr(mod, "step", None)
            one: Any = getattr(mod, "one", None)
            if step is None and one is None:
                continue
            if isinstance(mod, Experts):
                n += 1
                dtype = mod.gate_proj.model_dtype
                x = torch.randn(1, int(mod.gate_proj.in_features), generator=g).to(dtype)
                ids, ws = [[mod.first, mod.first + mod.count - 1]], [[0.25, 0.75]]
                got = mod.forward_step(x, ids, ws) if step is not None else one(x, [s - mod.slot_base for s in ids[0]], ws[0])
                gate, up, down = mod.gate_proj, mod.up_proj, mod.down_proj
                with composed(mod):
                    ref = sum((down(F.silu(gate(x, s - mod.slot_base)) * up(x, s - mod.slot_base), s - mod.slot_base)
                               * w).to(x.dtype) for s, w in zip(ids[0], ws[0]))
                check(f"routed experts {gate.qp_ckpt.rsplit('.', 1)[0]} ({'native step' if step else repr(one)})",
                      got, ref)
            elif isinstance(mod, MLP):
                n += 1
                x = torch.randn(1, int(mod.gate_proj.in_features), generator=g).to(mod.gate_proj.model_dtype)
                got = mod(x)
                with composed(mod):
                    ref = mod(x)
                check(f"MLP {mod.down_proj.qp_ckpt.rsplit('.', 1)[0]} ({'native step' if step else repr(one)})", got, ref)
            elif isinstance(mod, MLA):
                n += 1
                cfg, dtype = mod.cfg, mod.o_proj.model_dtype
                caches = [LatentCache(1, mod.kv_lora_rank, mod.qk_rope_head_dim, dtype=dtype, device=torch.device("cpu"),
                                      capacity=8, limit=64) for _ in range(2)]
                past = (torch.randn(1, 1, 3, mod.kv_lora_rank, generator=g), torch.randn(1, 1, 3, mod.qk_rope_head_dim, generator=g))
                for c in caches:
                    c.append(past[0].to(dtype), past[1].to(dtype))
                x = torch.randn(1, 1, cfg.hidden_size, generator=g).to(dtype)
                cos, sin = mod.rotary[0].cos_sin(torch.tensor([[3]]), dtype)
                got = mod(x, cos, sin, caches[0])
                with composed(mod):
                    ref = mod(x, cos, sin, caches[1])
                check(f"{type(mod).__name__} step of {mod.o_proj.qp_ckpt.rsplit('.', 1)[0]}", got, ref)
                if got.shape == ref.shape:
                    check("its cached latent", caches[0].latent[:, :, :4], caches[1].latent[:, :, :4])
                    check("its cached key", caches[0].k_rope[:, :, :4], caches[1].k_rope[:, :, :4])
    return n, bad


def _fused_mismatches(model: torch.nn.Module, rtol: float) -> tuple[int, list[str]]:
    """(number of fused groups, those whose fused output differs from the layers' own applies)."""
    g = torch.Generator().manual_seed(4)
    n, bad = 0, []
    for mod in model.modules():
        for fused in [v for v in vars(mod).values() if isinstance(v, FusedProjections)]:
            n += 1
            layers: list[Any] = fused.layers
            x = torch.randn(3, int(layers[0].in_features), generator=g)
            with torch.no_grad():
                if isinstance(layers[0], StackedLinear):
                    groups = [(0, 1), (layers[0].n - 1, 2)]
                    got = fused(x, groups)
                    ref = torch.cat([m.scheme.apply_grouped(m, x, groups) for m in layers], dim=-1)
                else:
                    got = fused(x)
                    ref = torch.cat([m.scheme.apply(m, x) for m in layers], dim=-1)
            err = rel_err(got.float(), ref.float()) if got.shape == ref.shape else float("inf")
            if not err <= rtol:
                bad.append(f"{fused!r}: rel err {err:.3g}" + ("" if got.shape == ref.shape else
                                                              f" (shape {list(got.shape)}, want {list(ref.shape)})"))
    return n, bad
