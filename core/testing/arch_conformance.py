"""The architecture conformance kit: one class an architecture package's test suite subclasses.

A third party that adds a model architecture (an :class:`~quantplug.api.ArchSpec` registered in
the ``quantplug.architectures`` entry-point group) writes::

    from quantplug.testing import ArchitectureConformance

    class TestMyArch(ArchitectureConformance):
        architecture = "MyArchForCausalLM"

        def write_checkpoint(self, path):
            ...  # a tiny random float32 checkpoint of the architecture: config.json + safetensors

        def reference_logits(self, path, ids):
            ...  # logits [B, T, V] of the checkpoint at ``path`` from an implementation that is
                 # not quantplug's (transformers' model class, the vendor's modeling code)

pytest then checks, against the installed distributions (core defaults and bundled backends):
the architecture is found through its entry point; its plan is clean and reads headers only; a
missing tensor is named at plan time; float32 logits match the reference; cached greedy
generation equals recomputing the whole sequence each step; and each bundled format's export
of the same weights loads, matching the reference on the weights the load holds (within
:attr:`rtol` for weight-only formats; formats that quantize activations within the looser
sanity bound :attr:`act_quant_rtol`).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import pytest
import torch
from safetensors.torch import load_file, save_file

from ..api import QuantplugError, dense_state
from ..layers.linear import PlannedModule
from ..loader import load
from ..models.registry import ENTRY_POINT_GROUP, registered
from ..plan import LoadPlan, build_plan
from .engines import EXPORTS, installed_backends
from .formats import FORMATS
from .probes import forbid_data_reads, isolated_plugin_manager, rename_stored_tensor
from .reference import rel_err


def _fail(message: str) -> NoReturn:
    pytest.fail(message, pytrace=False)


class _ArchKit:
    def __init__(self, root: Path, path: Path) -> None:
        self.root, self.path = root, path
        self.config: dict[str, Any] = json.loads((path / "config.json").read_text())
        self.tensors: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            self.tensors.update(load_file(str(f)))
        vocab = int((self.config.get("text_config") or self.config)["vocab_size"])
        self.ids = torch.randint(0, vocab, (2, 11), generator=torch.Generator().manual_seed(0))
        self._model: torch.nn.Module | None = None

    def model(self) -> torch.nn.Module:
        if self._model is None:
            self._model = load(self.path)
        return self._model


class ArchitectureConformance:
    """Subclass as ``Test<Name>``, set :attr:`architecture`, implement :meth:`write_checkpoint`
    and :meth:`reference_logits`."""

    #: config.json ``architectures[0]`` the package registers
    architecture: ClassVar[str] = ""
    #: float32 logits against the reference (relative, max abs error / max abs value)
    rtol: ClassVar[float] = 1e-5
    #: a format that quantizes activations (fp8 / int8 / fp4 codes of every linear's input), against
    #: the float reference on its dequantized weights: a sanity bound (a tiny random model's logits
    #: move ~0.1-0.3 under e4m3 activations; a mis-mapped tensor moves them by ~1)
    act_quant_rtol: ClassVar[float] = 0.5
    #: bundled formats whose exporters write the architecture (names of ``quantplug.testing.formats.FORMATS``)
    formats: ClassVar[tuple[str, ...]] = tuple(FORMATS)
    #: bundled formats that cannot hold some of the architecture's tensors: format -> text the plan's
    #: refusal of that format's export must contain (the tensor it names); such an export must not
    #: plan clean, and must be refused at plan time rather than load wrong
    refusals: ClassVar[Mapping[str, str]] = {}
    #: greedy tokens generated in the cache check
    new_tokens: ClassVar[int] = 6
    #: bundled exporters to round-trip (labels of ``quantplug.testing.engines.EXPORTS``: each backend's
    #: own ``quantplug_export`` of the loaded float checkpoint, loaded back); none by default
    exporters: ClassVar[tuple[str, ...]] = ()

    def write_checkpoint(self, path: Path) -> None:
        """Write a tiny random float32 checkpoint of the architecture into directory ``path``."""
        raise NotImplementedError(f"{type(self).__name__} must implement write_checkpoint(path)")

    def reference_logits(self, path: Path, ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, V] of the checkpoint at ``path`` for ``ids`` [B, T], from an independent
        implementation (float32)."""
        raise NotImplementedError(f"{type(self).__name__} must implement reference_logits(path, ids)")

    def check_export(self, label: str, model: Any) -> None:
        """The architecture's own checks of an exporter's checkpoint as loaded (``label``: the
        :attr:`exporters` entry); call :func:`pytest.fail` on a problem. Default: none."""

    @pytest.fixture(scope="class")
    @classmethod
    def arch_kit(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[_ArchKit]:
        root = tmp_path_factory.mktemp("quantplug-arch-kit")
        path = root / "float"
        path.mkdir()
        cls().write_checkpoint(path)
        yield _ArchKit(root, path)
        shutil.rmtree(root, ignore_errors=True)

    # -- the checks -----------------------------------------------------------------------------

    def test_found_through_its_entry_point(self, arch_kit: _ArchKit) -> None:
        reg = registered()
        if self.architecture not in reg.specs:
            why = reg.failures.get(self.architecture, "no entry point has that name")
            _fail(f"[entry point] architecture {self.architecture!r} is not registered in the {ENTRY_POINT_GROUP!r} "
                  f"entry-point group: {why}. Add to your pyproject.toml: [project.entry-points."
                  f"\"{ENTRY_POINT_GROUP}\"] {self.architecture} = \"your_module:SPEC\" and reinstall")
        archs = arch_kit.config.get("architectures")
        if archs != [self.architecture]:
            _fail(f"[entry point] write_checkpoint wrote architectures = {archs!r}, expected [{self.architecture!r}]")

    def _plan(self, path: Path) -> LoadPlan:
        return build_plan(path)

    def test_plan_is_clean_and_reads_no_tensor_data(self, arch_kit: _ArchKit) -> None:
        with forbid_data_reads(arch_kit.path) as reads:
            plan = self._plan(arch_kit.path)
        if reads:
            _fail("[plan reads no tensor data] planning read tensor data:\n  " + "\n  ".join(reads.events[:5]))
        if plan.errors:
            _fail("[clean plan] the architecture's own float checkpoint plans with problems:\n  "
                  + "\n  ".join(p.describe() for p in plan.errors))

    def test_missing_tensor_is_named_at_plan_time(self, arch_kit: _ArchKit) -> None:
        plan = self._plan(arch_kit.path)
        used = {info.name for p in plan.params for _, info in p.sources}
        victim = max((t for t in plan.checkpoint.tensors.values() if t.name in used and len(t.shape) == 2),
                     key=lambda t: (t.nbytes, t.name))
        work = arch_kit.root / "missing"
        shutil.copytree(arch_kit.path, work, dirs_exist_ok=True)
        rename_stored_tensor(work / victim.file.name, victim.name)
        try:
            text = "\n".join(p.describe() for p in self._plan(work).errors)
        except QuantplugError as exc:
            text = str(exc)
        if victim.name not in text:
            _fail(f"[missing tensor] {victim.name} was removed, but the plan said: {text or 'nothing'}; every tensor "
                  "the skeleton needs must be a planned module's source (QuantLinear, FloatParams.add_float ...)")

    def test_forward_matches_reference(self, arch_kit: _ArchKit) -> None:
        with torch.no_grad():
            ours = arch_kit.model()(arch_kit.ids)
        ref = self.reference_logits(arch_kit.path, arch_kit.ids)
        err = rel_err(ours, ref)
        if not err <= self.rtol:
            _fail(f"[forward] float32 logits differ from the reference: rel err {err:.3g} > {self.rtol}")

    def test_cached_generation_equals_recompute(self, arch_kit: _ArchKit) -> None:
        model: Any = arch_kit.model()
        prompt = arch_kit.ids[:, :5]
        out = model.generate(prompt, self.new_tokens, eos_token_id=None)
        seq = prompt
        with torch.no_grad():
            for _ in range(self.new_tokens):
                seq = torch.cat([seq, model(seq)[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
        if not torch.equal(out, seq):
            _fail(f"[cache] greedy generate with the cache gave {out.tolist()}, recomputing the whole sequence "
                  f"each step gave {seq.tolist()}")

    def _against_dequantized(self, arch_kit: _ArchKit, model: Any, what: str) -> None:
        """``model``'s logits against the reference on the weights the load holds (``dense_state``)."""
        with torch.no_grad():
            ours = model(arch_kit.ids)
        deq = arch_kit.root / f"{what.replace(' ', '-')}-dequantized"
        deq.mkdir(exist_ok=True)
        save_file({k: v.float().contiguous() if v.is_floating_point() else v.contiguous()
                   for k, v in dense_state(model).items()}, str(deq / "model.safetensors"))
        (deq / "config.json").write_text(json.dumps(arch_kit.config))
        ref = self.reference_logits(deq, arch_kit.ids)
        weight_only = all(getattr(getattr(m, "scheme", None), "weight_only", True)
                          for m in model.modules() if isinstance(m, PlannedModule))
        tol = self.rtol if weight_only else self.act_quant_rtol
        err = rel_err(ours, ref)
        if not err <= tol:
            _fail(f"[{what}] logits vs the reference on the weights the load holds: rel err {err:.3g} > {tol} "
                  f"({'weight-only' if weight_only else 'activations quantized'})")

    @pytest.mark.parametrize("label", tuple(row.label for row in EXPORTS if row.backend is not None))
    def test_bundled_exporter_round_trip(self, arch_kit: _ArchKit, label: str) -> None:
        """The backend's own ``quantplug_export`` of the loaded float model writes a checkpoint that
        plans clean, keeps some linears quantized, and loads matching the reference on the weights it
        holds (:attr:`rtol`, or :attr:`act_quant_rtol` where activations are quantized)."""
        if label not in self.exporters:
            pytest.skip(f"{type(self).__name__}.exporters leaves out {label}")
        row = next(r for r in EXPORTS if r.label == label)
        backends = installed_backends()
        if row.backend not in backends:
            pytest.skip(f"backend {row.backend!r} is not installed")
        pm = isolated_plugin_manager({row.backend: backends[row.backend]})
        source: Any = load(arch_kit.path, plugin_manager=isolated_plugin_manager(), progress=False)
        scratch = arch_kit.root / f".{label}.export"
        res = pm.export(row.backend, model=source, destination=scratch, plan=source.quantplug_plan,
                        options=row.options)[row.pick]
        plan = build_plan(res.path, plugin_manager=pm)
        if plan.errors:
            _fail(f"[exporter {label}] its export plans with problems:\n  "
                  + "\n  ".join(p.describe() for p in plan.errors))
        model = load(res.path, plugin_manager=pm, progress=False)
        packed = [m.qp_ckpt for m in model.modules() if isinstance(m, PlannedModule)
                  and type(getattr(m, "scheme", None)).__name__ != "DenseScheme"]
        if not packed:
            _fail(f"[exporter {label}] the export loads with no quantized module (nothing was quantized)")
        self.check_export(label, model)
        self._against_dequantized(arch_kit, model, f"exporter {label}")

    @pytest.mark.parametrize("fmt", tuple(FORMATS))
    def test_bundled_format_loads(self, arch_kit: _ArchKit, fmt: str) -> None:
        if fmt not in self.formats:
            pytest.skip(f"{type(self).__name__}.formats leaves out {fmt}")
        q = FORMATS[fmt](arch_kit.root / fmt, arch_kit.config, arch_kit.tensors)
        if fmt in self.refusals:
            try:
                text = "\n".join(p.describe() for p in self._plan(q).errors)
            except QuantplugError as exc:
                text = str(exc)
            if self.refusals[fmt] not in text:
                _fail(f"[format {fmt}] {type(self).__name__}.refusals expects the plan to refuse the {fmt} export "
                      f"naming {self.refusals[fmt]!r}; it said: {text or 'nothing (a clean plan)'}")
            return
        plan = self._plan(q)
        if plan.errors:
            _fail(f"[format {fmt}] the {fmt} export plans with problems:\n  " + "\n  ".join(p.describe() for p in plan.errors))
        self._against_dequantized(arch_kit, load(q), f"format {fmt}")
