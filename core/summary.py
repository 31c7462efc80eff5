"""Plan text that stays readable at real scale: identical layers grouped, each scheme said once.

A DeepSeek-V3 plan decides ~1,000 schemes (61 layers x 8-11 projections and expert stacks) that
take two or three distinct values; printed one per projection per layer that was 108 KB of text.
Here :func:`plan_lines` numbers the distinct scheme descriptions once (``[1] fp8 e4m3 block ...``)
and prints one line per group of layers whose every decision is equal (``layers 3-60 (58)``);
:func:`grouped_targets` folds per-target rows (tensor-parallel splits, ``explain``) that differ
only in their layer index into one row (``model.layers.{3-60}.mlp.experts``). ``--json`` keeps
every decision.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

H = TypeVar("H", bound=Hashable)
_LAYER = re.compile(r"^(?P<pre>(?:.+\.)?layers)\.(?P<i>\d+)(?:\.(?P<rest>.+))?$")


def split_layer(name: str) -> tuple[str, int, str] | None:
    """``("model.layers", 3, "self_attn.q_a_proj")`` for a name inside a numbered layer, else None."""
    m = _LAYER.match(name)
    if m is None:
        return None
    return m.group("pre"), int(m.group("i")), m.group("rest") or ""


def ranges(indices: Iterable[int]) -> str:
    """Sorted runs of integers: ``0-2, 5, 7-60``."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def brace(names: Sequence[str]) -> str:
    """Names sharing a parent written once: ``self_attn.{q_a_proj, o_proj}, mlp.gate``."""
    parents: dict[str, list[str]] = {}
    for n in names:
        parent, _, leaf = n.rpartition(".")
        parents.setdefault(parent, []).append(leaf)
    parts = []
    for parent, leaves in parents.items():
        inner = leaves[0] if len(leaves) == 1 else "{" + ", ".join(leaves) + "}"
        parts.append(f"{parent}.{inner}" if parent else inner)
    return ", ".join(parts)


def legend(values: Iterable[str]) -> dict[str, int]:
    """Each distinct value -> its number (1, 2, ... in order of first appearance)."""
    out: dict[str, int] = {}
    for v in values:
        out.setdefault(v, len(out) + 1)
    return out


def _layer_label(pre: str, indices: Sequence[int]) -> str:
    what = ("layers" if len(indices) > 1 else "layer") if pre == "model.layers" else pre
    return f"{what} {ranges(indices)}" + (f" ({len(indices)})" if len(indices) > 1 else "")


def plan_lines(schemes: Mapping[str, str], layouts: Mapping[str, str]) -> list[str]:
    """The ``schemes`` and ``layers`` sections of ``quantplug plan``: every distinct scheme
    numbered once, then one line per group of identical layers and one per other module."""
    uses: dict[str, int] = {}
    for v in schemes.values():
        uses[v] = uses.get(v, 0) + 1
    ids = legend(sorted(uses, key=lambda v: -uses[v]))  # the most used scheme is [1]
    lines = [f"schemes ({len(ids)}; `--json` lists every module's):"]
    lines += [f"  [{i}] {v} ({uses[v]:,} module{'s' if uses[v] != 1 else ''})" for v, i in ids.items()]
    # one signature per layer: (("attention", layout) | (projection, scheme id))...
    layers: dict[tuple[str, int], list[tuple[str, Any]]] = {}
    others: list[tuple[str, str]] = []
    for name, layout in layouts.items():
        where = split_layer(name)
        if where is None:
            others.append((name, f"attention {layout}"))
        else:
            layers.setdefault(where[:2], []).append(("attention", layout))
    for name, scheme in schemes.items():
        where = split_layer(name)
        if where is None:
            others.append((name, f"[{ids[scheme]}]"))
        else:
            layers.setdefault(where[:2], []).append((where[2], ids[scheme]))
    groups: dict[tuple[str, tuple[tuple[str, Any], ...]], list[int]] = {}
    for (pre, i), items in sorted(layers.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        groups.setdefault((pre, tuple(items)), []).append(i)
    n_layers = len(layers)
    lines.append(f"layers ({n_layers} in {len(groups)} group{'s' if len(groups) != 1 else ''} of identical "
                 f"decisions{f', {len(others)} other modules' if others else ''}):")
    for (pre, signature), indices in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[1][0])):
        lines.append(f"  {_layer_label(pre, indices)}: {_describe_layer(signature)}")
    lines += [f"  {name}: {what}" for name, what in others]
    return lines


def _describe_layer(items: Sequence[tuple[str, Any]]) -> str:
    attention = [str(v) for k, v in items if k == "attention"]
    by_scheme: dict[int, list[str]] = {}
    for k, v in items:
        if k != "attention":
            by_scheme.setdefault(int(v), []).append(k)
    parts = [f"attention {', '.join(attention)}"] if attention else []
    if len(by_scheme) == 1:
        (i, names), = by_scheme.items()
        parts.append(f"[{i}] all {len(names)} projections")
    else:
        parts += [f"[{i}] {brace(names)}" for i, names in by_scheme.items()]
    return "; ".join(parts)


def grouped_targets(rows: Sequence[tuple[str, H]]) -> list[tuple[str, H, int]]:
    """``(target, payload)`` rows -> ``(target or template, payload, count)``: rows whose targets
    differ only in their layer index and whose payloads are equal become one row with target
    ``model.layers.{3-60}.mlp.experts`` (a lone row keeps its own name), in first-seen order."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    order: list[tuple[Any, ...]] = []
    for target, payload in rows:
        where = split_layer(target)
        key: tuple[Any, ...] = (where[0], where[2], payload) if where else (target, None, payload)
        if key not in groups:
            groups[key] = []
            order.append(key)
        if where:
            groups[key].append(where[1])
    out: list[tuple[str, H, int]] = []
    for key in order:
        indices = groups[key]
        if not indices:
            out.append((key[0], key[2], 1))
        elif len(indices) == 1:
            out.append((f"{key[0]}.{indices[0]}" + (f".{key[1]}" if key[1] else ""), key[2], 1))
        else:
            out.append((f"{key[0]}.{{{ranges(indices)}}}" + (f".{key[1]}" if key[1] else ""), key[2], len(indices)))
    return out


def parallel_lines(d: Mapping[str, Any]) -> list[str]:
    """``quantplug plan --tp N``: bytes per rank (equal ranks on one line) and the split decisions,
    grouped over layers (``ParallelPlan.to_dict()`` keeps each)."""
    lines = [f"tensor parallel: {d['world_size']} ranks; replicated {d['replicated_bytes']:,} bytes, "
             f"split {d['sharded_bytes']:,} bytes (bound per rank {d['bound_bytes']:,})"]
    for value, ranks in grouped_values(d["rank_bytes"]):
        label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranges(ranks)}"
        lines.append(f"  {label}: reads {value:,} bytes" + (" each" if len(ranks) > 1 else ""))
    counts: dict[str, int] = {}
    for dec in d["decisions"]:
        counts[dec["value"]] = counts.get(dec["value"], 0) + 1
    lines.append("  splits: " + ", ".join(f"{v} x{n}" for v, n in sorted(counts.items())))
    rows = [(dec["target"], (dec["value"], dec["reason"])) for dec in d["decisions"]]
    for target, (value, reason), n in grouped_targets(rows):
        lines.append(f"  {target}: {value} ({reason})" + (f" x{n}" if n > 1 else ""))
    return lines


def grouped_values(values: Sequence[Any]) -> list[tuple[Any, list[int]]]:
    """Each distinct value and the indices holding it, in first-seen order."""
    out: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        out.setdefault(v, []).append(i)
    return list(out.items())


#: an explain VALUE longer than this, repeated in the table, is numbered and said once below it
LONG_VALUE = 48


def table(rows: list[list[str]], head: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def explain_lines(plan: Any, name: str) -> list[str]:
    """``quantplug explain PATH NAME``: the decisions about a layer, a module prefix (every layer
    under it, rows that differ only in their layer index folded into one) or a tensor (stored or
    model name: the decisions of the module it feeds; a skipped tensor: the rule that skips it)."""
    from .errors import QuantplugError

    head: list[str] = []
    decisions = [d for d in plan.decisions_for(name) if d.target != "*"]
    if not decisions:
        fed = _fed_by(plan, name)
        if fed is not None:
            param, module = fed
            head.append(f"{name}: feeds parameter {param}")
            decisions = [d for d in plan.decisions_for(module) if d.target != "*"]
            if not decisions:
                return [*head, f"{module}: loaded as stored (no decision concerns it)"]
    if not decisions and "." in name:
        decisions = [d for d in plan.decisions_for(name.rsplit(".", 1)[0]) if d.target != "*"]
    if not decisions:
        for rule, names in plan.skipped.items():
            if name in names:
                return [f"{name}: skipped by rule {rule}"]
        import difflib

        close = difflib.get_close_matches(name, sorted({d.target for d in plan.decisions}), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}?" if close else ("layer names look like "
                                                              f"{plan.decisions[-1].target if plan.decisions else 'lm_head'}")
        raise QuantplugError(f"no decisions about {name!r} in the plan of {plan.path}, and no tensor of that name; {hint}")
    globals_ = [d for d in plan.decisions if d.target == "*"]
    rows = [(d.target, (d.hook.removeprefix("quantplug_"), str(d.value), str(d.plugin), d.reason)) for d in decisions]
    grouped = grouped_targets(rows)
    counts: dict[str, int] = {}
    for _, (_, value, _, _), _ in grouped:
        counts[value] = counts.get(value, 0) + 1
    ids = legend(v for _, (_, v, _, _), _ in grouped if len(v) > LONG_VALUE and counts[v] > 1)
    out_rows = [[d.hook.removeprefix("quantplug_"), d.target, str(d.value), str(d.plugin), d.reason] for d in globals_]
    for target, (hook, value, plugin, reason), n in grouped:
        shown = f"[{ids[value]}]" if value in ids else value
        out_rows.append([hook, target + (f" (x{n})" if n > 1 else ""), shown, plugin, reason])
    lines = [*head, table(out_rows, ["DECISION", "TARGET", "VALUE", "PLUGIN", "REASON"])]
    lines += [f"[{i}] {v}" for v, i in ids.items()]
    return lines


def _fed_by(plan: Any, tensor: str) -> tuple[str, str] | None:
    """(parameter, module checkpoint name) that checkpoint tensor ``tensor`` (model or stored name) feeds."""
    for pp in plan.params:
        for src, info in pp.sources:
            if tensor in (info.name, info.stored_name):
                slot = f" slot {src.slot}" if src.slot is not None else ""
                return f"{pp.param}{slot}", pp.module.qp_ckpt
    return None
