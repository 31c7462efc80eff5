"""What code below the plan reads of a load plan: :class:`LoadPlanView` (a
:class:`quantplug.plan.LoadPlan` as the hooks and the tensor-parallel split see it) and
:class:`ParamPlanView` (one of its parameter plans). Protocols, so that the hook specifications
and :mod:`quantplug.parallel` name the plan's type without importing :mod:`quantplug.plan`
(which imports them)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..types import Claim, Decision, Problem, TensorInfo
from .config import ModelConfig
from .options import LoadOptions
from .scheme import PlannedModule, Source


class ParamPlanView(Protocol):
    """One model parameter and the tensors that feed it (:class:`quantplug.plan.ParamPlan`)."""

    #: tensor sources and the stored tensor of each (rewritten by a tensor-parallel split)
    sources: list[tuple[Source, TensorInfo]]
    shape: tuple[int, ...]

    @property
    def param(self) -> str: ...

    @property
    def module(self) -> PlannedModule: ...

    @property
    def local(self) -> str: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def zero_copy(self) -> bool: ...

    @property
    def nbytes(self) -> int: ...


class LoadPlanView(Protocol):
    """A load plan (:class:`quantplug.plan.LoadPlan`) as hooks and the parallel split read it."""

    #: tensor-parallel split of this plan (``quantplug.parallel.ParallelPlan``), None: one process
    parallel: Any

    @property
    def path(self) -> Path: ...

    @property
    def architecture(self) -> str: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def backend(self) -> str | None: ...

    @property
    def claim(self) -> Claim | None: ...

    @property
    def quant_config(self) -> Any: ...

    @property
    def prefix(self) -> str: ...

    @property
    def decisions(self) -> list[Decision]: ...

    @property
    def params(self) -> Sequence[ParamPlanView]: ...

    @property
    def problems(self) -> list[Problem]: ...

    @property
    def options(self) -> LoadOptions: ...

    @property
    def checkpoint(self) -> Any: ...

    @property
    def model(self) -> nn.Module: ...

    def tensors_matching(self, pattern: str) -> list[TensorInfo]: ...

    def decisions_for(self, layer: str) -> list[Decision]: ...
