"""A router's :class:`~quantplug.contract.routing.RouterSpec` and tensors as the kernels' ``qp_router``
(``native.Router``), and the native route of a few rows (``qp_route``; tests compare it with
:func:`quantplug.contract.routing.route`)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ..contract.routing import SCORES, SELECTS, RouterSpec
from ..errors import QuantplugError
from . import native

#: the most experts (and groups) the native router takes (``QP_ROUTE_MAX`` in ``blocks/router.c``)
MAX_EXPERTS = 1024


def fits(spec: RouterSpec, experts: int, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
         tid2eid: torch.Tensor | None = None) -> bool:
    """Whether the native router takes ``spec`` with these tensors for ``experts`` experts (the C
    code's ``router_ok``, decided here): the bias and table present as the spec declares them,
    shapes, the group split, at most :data:`MAX_EXPERTS` experts."""
    if not 1 <= experts <= MAX_EXPERTS or spec.top_k > experts or weight is None or weight.shape[0] != experts:
        return False
    if spec.has_bias != (bias is not None) or bias is not None and bias.numel() != experts:
        return False
    if spec.by_token:
        return tid2eid is not None and tid2eid.dim() == 2 and tid2eid.shape[1] == spec.top_k and tid2eid.shape[0] > 0
    if tid2eid is not None:
        return False
    if spec.select != "greedy":
        per = experts // spec.n_group
        return spec.n_group <= MAX_EXPERTS and experts % spec.n_group == 0 and spec.top_k <= spec.topk_group * per
    return True


def route(out: native.Router, spec: RouterSpec, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
          tid2eid: torch.Tensor | None = None) -> native.Router:
    """Fills ``out`` (a ``qp_router``) with ``spec`` and pointers into the tensors (float32
    ``weight`` [experts, hidden], ``bias`` [experts], int32 ``tid2eid`` [vocab, top_k]; contiguous;
    the caller keeps them alive)."""
    out.score, out.select = SCORES[spec.score], SELECTS[spec.select]
    out.top_k, out.n_group, out.topk_group = spec.top_k, spec.n_group, spec.topk_group
    out.norm_topk, out.scaling = int(spec.norm_topk), spec.scaling
    out.weight = None if weight is None else weight.data_ptr()
    out.bias = bias.data_ptr() if spec.has_bias and bias is not None else None
    if spec.by_token and tid2eid is not None:
        out.tid2eid, out.vocab = tid2eid.data_ptr(), tid2eid.shape[0]
    else:
        out.tid2eid, out.vocab = None, 0
    return out


def native_route(spec: RouterSpec, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                 ids: Sequence[int] | torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
                 experts: int | None = None) -> tuple[list[list[int]], list[list[float]]]:
    """:func:`quantplug.contract.routing.route` through the kernels (``qp_route``): ``x`` [rows, hidden] with
    ``weight``, or the logits [rows, experts] without. Per row the ids ascending and their float32
    weights. Raises QuantplugError where the kernels refuse (or are unavailable)."""
    lib = native.library()
    if lib is None:
        raise QuantplugError(f"native kernels unavailable: {native.status()}")
    xf = x.float().contiguous()
    e = experts if experts is not None else (weight.shape[0] if weight is not None else xf.shape[1])
    w = None if weight is None else weight.float().contiguous()
    b = None if bias is None else bias.float().contiguous()
    t = None if tid2eid is None else tid2eid.to(torch.int32).contiguous()
    tok = None if ids is None else torch.as_tensor(ids, dtype=torch.int64).contiguous()
    r = route(native.Router(), spec, w, b, t)
    rows = xf.shape[0]
    out_ids = torch.empty(rows, spec.top_k, dtype=torch.int32)
    out_w = torch.empty(rows, spec.top_k, dtype=torch.float32)
    rc = lib.qp_route(ctypes.byref(r), e, rows, xf.shape[1], xf.data_ptr(), int(weight is None),
                      None if tok is None else tok.data_ptr(), out_ids.data_ptr(), out_w.data_ptr())
    native.check(rc, "route")
    return out_ids.tolist(), out_w.tolist()
