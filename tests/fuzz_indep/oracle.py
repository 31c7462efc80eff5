"""The oracle: run one mutated checkpoint through quantplug and classify what happened.

Stages: ``quantplug.plan`` -> ``quantplug.load`` -> one forward; the tokenizer
(``quantplug.tokenizer.load_tokenizer``, encode / decode, the chat template); for a sample of
cases the CLI (``quantplug.cli.main(["plan", dir])`` in process, and ``python -m quantplug plan``
as a subprocess). Outcomes, worst first:

``crash`` (an exception that is not a ``QuantplugError``, a panic, a signal), ``oom``
(``MemoryError``, an allocator failure, the address-space limit), ``hang`` (past the case
timeout: decided by the runner), ``raw-message`` (a ``QuantplugError`` carrying raw Python error
text), ``unnamed-message`` (one naming no file of the checkpoint nor its directory),
``escape-accepted`` (a file resolving outside the checkpoint was read), ``silent-wrong-load``
(a malformed / inconsistent change loaded with logits other than the base model's), ``lenient``
(a value of the wrong type or out of range accepted), ``cli`` (the command line disagreed with the
API, printed nothing, or a traceback); then the good ones: ``refused`` (a clean ``QuantplugError``),
``ok-same`` / ``ok-changed`` (loaded: same logits as the base / other logits from a legitimate
change).
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

FAILURES = ("crash", "oom", "hang", "raw-message", "unnamed-message", "escape-accepted", "silent-wrong-load",
            "lenient", "cli")
GOOD = ("refused", "ok-same", "ok-changed")
OUTCOMES = FAILURES + GOOD + ("harness-error",)

#: raw Python error texts that must not reach a user's message
RAW = re.compile("|".join(re.escape(s) for s in (
    "Traceback", "object has no attribute", "invalid literal for", "unsupported operand", "index out of range",
    "KeyError", "is not subscriptable", "NoneType", "cannot convert", "unterminated", "codec can't decode",
    "codec can't encode", "Expecting value", "Expecting property name", "Expecting ',' delimiter", "Extra data",
    "Invalid control character", "maximum recursion", "object is not iterable", "positional argument",
    "required positional", "must be real number", "not supported between instances", "can't multiply sequence",
    "division by zero", "math domain error", "out of range float", "int too large", "OverflowError",
    "unpack requires a buffer", "struct.error", "cannot reshape", "ValueError", "TypeError", "AttributeError",
    "IndexError", "RuntimeError", "UnicodeDecodeError", "object of type", "has no len()", "argument must be",
    "[Errno", "JSONDecodeError", "Unterminated string", "expected str, bytes", "embedded null",
    "is not JSON serializable", "unhashable type", "got an unexpected keyword",
)))

#: config.json keys that define a DeepSeek-V3 / Kimi forward (transformers' DeepseekV3Config and the
#: Kimi wrapper) or its quantization: a wrong-typed or out-of-range value of one must be refused.
#: Other keys (bos_token_id, torch_dtype, use_cache, id2label, head_dim, topk_method...) are read by
#: no inference path of this architecture and may hold anything.
MODEL_KEYS = frozenset({
    "architectures", "model_type", "text_config", "quantization_config", "vocab_size", "hidden_size",
    "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads", "n_shared_experts",
    "n_routed_experts", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
    "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob",
    "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "rope_interleave", "attention_bias", "tie_word_embeddings", "scoring_func", "num_nextn_predict_layers",
    "mla_use_output_gate", "num_local_experts",
})

#: ``file:key`` patterns (regular expressions) whose value no reader of the format uses, so a
#: wrong-typed value may be accepted, each checked by hand (see docs/fuzzing.md):
#: (pattern, a file that must be present for it to apply or "", why)
UNREAD_KEYS: tuple[tuple[str, str, str], ...] = (
    (r"config\.json:quantization_config\.provider", "", "AutoRound's provenance note"),
    (r"config\.json:quantization_config\..*\.(zp_dtype|scale_dtype)", "", "compressed-tensors: descriptive; the "
     "tensors' header dtypes are what is read"),
    (r"model\.safetensors\.index\.json:metadata(\..*)?", "", "the index's metadata (total_size) is informational"),
    (r"config\.json:quantization_config\..*observer(_kwargs)?(\..*)?", "", "compressed-tensors: calibration only"),
    (r"config\.json:quantization_config\..*max_input_numel", "", "Quark: a calibration-time limit"),
    (r"config\.json:quantization_config\.softmax_quant_spec", "", "Quark: attention softmax quantization (not in "
     "any export quantplug reads; DeepSeek's MLA is computed unquantized)"),
    (r"config\.json:quantization_config\.(producer|global_compression_ratio|quantization_status|version|format_version)"
     r"(\..*)?", "", "provenance / statistics written by the exporter"),
    (r"config\.json:quantization_config\.(global_quant_config|layer(_type)?_quant_config\..*)\.weight\."
     r"(scale_type|mx_element_dtype|symmetric|zero_point_type|round_method|scale_calculation_mode|is_scale_quant|"
     r"is_dynamic|block_size|observer_cls)", "",
     "Quark: implied by the one spec the backend runs (dtype fp4, per_group 32, e8m0), or quantization-time"),
    (r"config\.json:quantization_config\.(quant_mode|algo_config|export\.weight_merge_groups)(\..*)?", "",
     "Quark: export / calibration settings (algo_config: see docs/fuzzing.md, not read at all)"),
    (r"config\.json:quantization_config\.kv_cache_quant_config(\..*)?", "", "Quark: KV-cache quantization, "
     "optional at inference (the cache is kept in the model dtype)"),
    (r"config\.json:quantization_config\.(moe_sparsity_config|.*target_device)(\..*)?", "",
     "compressed-tensors MoE sparsity / Quark target device: not read by any reader of the format"),
    (r"config\.json:quantization_config\.(to_quant_block_names|block_name_to_quantize)", "",
     "AutoRound / GPTQ: calibration scope"),
    (r"config\.json:quantization_config\.global_quant_config\.bias", "", "Quark: bias quantization; DeepSeek-V3 "
     "linears have no bias"),
    (r"config\.json:quantization_config\..*input_activations\.actorder", "", "compressed-tensors: activation "
     "ordering applies to weights only"),
    (r"config\.json:quantization_config\.(damp_percent|static_groups|true_sequential|mse|sym)", "",
     "GPTQ calibration settings; AWQ's zero_point decides symmetry (sym is typed where GPTQ reads it)"),
    (r"config\.json:quantization_config\.(autoround_version|kv_cache_post_rope|enable_quanted_input|"
     r".*enable_buffer_reuse|export\.(kv_cache_group|min_kv_scale))(\..*)?", "",
     "exporter / calibration settings that do not change the stored weights' meaning"),
    (r"config\.json:quantization_config\.modules_in_block_to_quantize.*", "", "GPTQModel: calibration grouping"),
    (r"config\.json:quantization_config\.(config_groups|quantized_layers|ignore|kv_cache_scheme).*",
     "hf_quant_config.json", "ModelOpt: hf_quant_config.json wins over config.json's description"),
)

IDS = [[1, 2, 3, 4, 5, 6, 7]]
MESSAGES = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "hello w3"}]


def _names(root: Path, mutated: list[str]) -> set[str]:
    out = set(mutated)
    with contextlib.suppress(OSError):
        out |= {p.name for p in root.iterdir()}
    return {n for n in out if n}


#: what a message may name instead of a file: a tensor, a layer, a plugin
NAMED = re.compile(r"(model\.layers\.\d+|lm_head|embed_tokens|language_model\.|blk\.\d+|token_embd|output(_norm)?\.weight|"
                   r"model\.norm|plugin \w+|backend \w+)")


def judge_message(msg: str, root: Path, names: set[str]) -> str | None:
    if RAW.search(msg):
        return "raw-message"
    if str(root) in msg or any(n in msg for n in names) or NAMED.search(msg):
        return None
    return "unnamed-message"


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    if not tb:
        return ""
    f = tb[-1]
    return f"{Path(f.filename).name}:{f.lineno} in {f.name}"


class Stage:
    """One stage's result: ``ok`` / ``refused`` / a failure outcome, with the message."""

    def __init__(self, name: str) -> None:
        self.name, self.status, self.message, self.where, self.value = name, "ok", "", "", None


def run_stage(name: str, fn: Any, root: Path, names: set[str]) -> Stage:
    from quantplug.errors import QuantplugError

    st = Stage(name)
    try:
        st.value = fn()
    except QuantplugError as exc:
        st.message = str(exc)
        st.status = judge_message(st.message, root, names) or "refused"
        if "out of memory" in st.message:  # the worker's address-space limit caught an unbounded allocation
            st.status = "oom"
        st.where = _where(exc)
    except MemoryError as exc:
        st.status, st.message, st.where = "oom", f"MemoryError {exc}", _where(exc)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # noqa: BLE001 (a panic too)
        text = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        st.status = "oom" if "can't allocate memory" in text or "not enough memory" in text else "crash"
        st.message, st.where = text[:2000], _where(exc)
    return st


def run_case(root: Path, mutations: list[Any], base: Any, *, cli: bool = False,
             subprocess_cli: bool = False) -> dict[str, Any]:
    """Everything the oracle says about ``root``; ``base``: the seed's logits (or None)."""
    import quantplug
    import torch
    from quantplug.tokenizer import load_tokenizer

    names = _names(root, [m.file for m in mutations])
    stages: list[Stage] = []
    plan = run_stage("plan", lambda: quantplug.plan(root), root, names)
    stages.append(plan)
    logits = None
    if plan.status == "ok":
        plan.value = None
        load = run_stage("load", lambda: quantplug.load(root), root, names)
        stages.append(load)
        if load.status == "ok":
            model = load.value
            load.value = None

            def forward() -> torch.Tensor:
                with torch.no_grad():
                    return model(torch.tensor(IDS)).float()
            fwd = run_stage("forward", forward, root, names)
            stages.append(fwd)
            if fwd.status == "ok":
                logits = fwd.value
            fwd.value = None
            del model
    tok = run_stage("tokenizer", lambda: load_tokenizer(root), root, names)
    stages.append(tok)
    if tok.status == "ok" and tok.value is not None:
        t = tok.value
        tok.value = None
        enc = run_stage("encode", lambda: t.decode(t.encode("hello w1 w2 <|end|> [EOS]")), root, names)
        stages.append(enc)
        if t.chat_template:
            stages.append(run_stage("chat_template", lambda: t.render_chat(MESSAGES), root, names))
        del t
    if cli:
        stages.append(_cli_inprocess(root, names, plan))
    if subprocess_cli:
        stages.append(_cli_subprocess(root, names, plan))
    return classify(stages, mutations, logits, base, names)


def _cli_check(rc: int, err: str, out: str, root: Path, names: set[str], plan: Stage, how: str) -> Stage:
    st = Stage(how)
    st.message = err.strip()[:2000]
    if rc == 3 or "Traceback" in err:
        st.status = "crash" if rc == 3 else "cli"
    elif rc not in (0, 1):
        st.status = "cli"
        st.message = f"exit {rc}: {st.message}"
    elif rc == 1:
        if not err.strip():  # `quantplug plan` lists a plan's problems with the plan, on stdout
            err = out
            st.message = err.strip()[-2000:]
        if not err.strip():
            st.status, st.message = "cli", "exit 1 with nothing printed"
        else:
            st.status = judge_message(err, root, names) or "refused"
        if plan.status == "ok":
            st.status, st.message = "cli", f"API planned it, CLI exit 1: {st.message}"
    elif plan.status not in ("ok",):
        st.status, st.message = "cli", f"API raised ({plan.message[:200]}), CLI exit 0"
    return st


def _cli_inprocess(root: Path, names: set[str], plan: Stage) -> Stage:
    from quantplug import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(["plan", str(root)])
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return _cli_check(rc, err.getvalue(), out.getvalue(), root, names, plan, "cli")


def _cli_subprocess(root: Path, names: set[str], plan: Stage) -> Stage:
    try:
        r = subprocess.run([sys.executable, "-m", "quantplug", "plan", str(root)], capture_output=True, text=True,
                           timeout=60, errors="replace")
    except subprocess.TimeoutExpired:
        st = Stage("cli-subprocess")
        st.status, st.message = "hang", "quantplug plan ran past 60 s"
        return st
    if r.returncode < 0:
        st = Stage("cli-subprocess")
        st.status, st.message = "crash", f"quantplug plan killed by signal {-r.returncode}"
        return st
    return _cli_check(r.returncode, r.stderr, r.stdout, root, names, plan, "cli-subprocess")


def classify(stages: list[Stage], mutations: list[Any], logits: Any, base: Any,
             present: set[str] = frozenset()) -> dict[str, Any]:
    import torch


    meaning = combined_meaning(mutations)
    worst = "refused"
    reason = ""
    bad = [s for s in stages if s.status in FAILURES]
    if bad:
        s = min(bad, key=lambda s: FAILURES.index(s.status))
        worst, reason = s.status, f"[{s.name}] {s.message} ({s.where})" if s.where else f"[{s.name}] {s.message}"
    refused = any(s.status == "refused" for s in stages)
    loaded = logits is not None
    same: bool | None = None
    if loaded and base is not None:
        same = bool(logits.shape == base.shape and torch.allclose(logits, base, rtol=1e-4, atol=1e-5, equal_nan=True))
    if not bad:
        if meaning == "escape" and not refused:
            worst, reason = "escape-accepted", "every stage accepted a file resolving outside the checkpoint"
        elif loaded and meaning == "struct" and same is False:
            worst = "silent-wrong-load"
            reason = f"loaded with other logits (max |diff| {float((logits - base).abs().max()) if logits.shape == base.shape else 'shape'})"
        elif loaded and meaning == "lenient" and not refused and any(lenient_key(m, present) for m in mutations
                                                     if m.meaning == "lenient"):
            worst = "lenient"
            reason = f"accepted ({'same' if same else 'other'} logits): " + "; ".join(m.detail for m in mutations)
        if worst == "refused" and loaded:
            worst = "ok-same" if same or same is None else "ok-changed"
    return {"outcome": worst, "reason": reason[:3000], "meaning": meaning, "loaded": loaded, "same": same,
            "stages": {s.name: s.status for s in stages},
            "messages": {s.name: s.message[:500] for s in stages if s.message}}


def combined_meaning(mutations: list[Any]) -> str:
    """escape / lenient dominate; otherwise a legitimate data change makes other logits fine."""
    from .mutators import RANK

    ms = {m.meaning for m in mutations}
    for m in ("escape", "lenient"):
        if m in ms:
            return m
    if "data" in ms:
        return "data"
    return max(ms, key=RANK.__getitem__, default="none")


#: the unknown keys ``mutators.m_json`` adds
ADDED_KEYS = frozenset({"zzz_unknown", "", "\u0000", "__proto__"})


def lenient_key(m: Any, present: set[str] = frozenset()) -> bool:
    """Whether accepting mutation ``m`` (meaning ``lenient``) is a finding: config.json keys that
    define the model or its quantization, any key of a quantization sidecar or GGUF metadata
    quantplug reads; not keys no reader of the format uses (``UNREAD_KEYS``)."""
    key = m.key
    if key.rsplit(".", 1)[-1] in ADDED_KEYS:
        return False  # a key the json.add mutator made up: an unknown key is ignored, like transformers does
    if m.file == "config.json":
        top = key.removeprefix("text_config.").split(".")[0].split("[")[0]
        if top not in MODEL_KEYS:
            return False
    return not any(re.fullmatch(pat, f"{m.file}:{key}") and (not need or need in present)
                   for pat, need, _ in UNREAD_KEYS)
