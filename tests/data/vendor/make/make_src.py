"""Tiny DeepSeek-V3 source model (bf16, hub layout) for the FP4 / int4 vendor fixtures."""
import json, sys, torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
out = sys.argv[1]
cfg = json.load(open("/work/wt-fp4-formats/tests/data/vendor/ct_w4a16_experts_dsv3/config.json"))
cfg.pop("quantization_config")
keep = {k: v for k, v in cfg.items() if k not in ("architectures", "id2label", "label2id")}
torch.manual_seed(24)
hc = DeepseekV3Config(**keep)
model = DeepseekV3ForCausalLM(hc)
with torch.no_grad():
    # every 16-column group of each 2-D weight scaled by a log-uniform factor in [1/3, 3]: a scale
    # applied to the wrong group, or a wrong global scale, shows in the logits
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "norm" not in name and "embed" not in name:
            cols = p.shape[-1]
            f = torch.exp((torch.rand(cols // 16, generator=g) * 2 - 1) * 1.0986).repeat_interleave(16)
            p.mul_(f)
        if name.endswith("e_score_correction_bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.01)
model = model.to(torch.bfloat16)
model.config.architectures = ["DeepseekV3ForCausalLM"]
model.save_pretrained(out)
print(sorted(n for n in __import__("safetensors").safe_open(out + "/model.safetensors", "pt").keys())[:60])
