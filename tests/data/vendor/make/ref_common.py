"""Shared by the reference scripts: the transformers DeepseekV3 fp32 model on a given state."""
import json, re, torch
from safetensors.torch import load_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SRC = "/tmp/fp4fix/src"
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1234))


def build(cfg_path=SRC + "/config.json"):
    cfg = json.load(open(cfg_path))
    keep = {k: v for k, v in cfg.items() if k not in ("architectures", "quantization_config", "id2label", "label2id")}
    hc = DeepseekV3Config(**keep)
    hc._attn_implementation = "eager"
    hc._experts_implementation = "eager"
    return DeepseekV3ForCausalLM(hc).eval().float(), hc


def fused(state, hc):
    """hub per-expert tensors -> transformers 5 fused experts."""
    out = {k: v for k, v in state.items() if ".mlp.experts." not in k}
    for layer in range(hc.num_hidden_layers):
        base = f"model.layers.{layer}.mlp.experts"
        if f"{base}.0.gate_proj.weight" not in state:
            continue
        E = hc.n_routed_experts
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([state[f"{base}.{e}.gate_proj.weight"],
                                                              state[f"{base}.{e}.up_proj.weight"]]) for e in range(E)])
        out[f"{base}.down_proj"] = torch.stack([state[f"{base}.{e}.down_proj.weight"] for e in range(E)])
    return out


def logits(state, hc, model=None):
    model = model or build()[0]
    sd = fused({k: v.float() for k, v in state.items()}, hc)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not [m for m in missing if "rotary" not in m], missing
    with torch.no_grad():
        return model(IDS).logits.float()


def dense_logits():
    model, hc = build()
    return logits(load_file(SRC + "/model.safetensors"), hc, model)
