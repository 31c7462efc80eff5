"""nvidia-modelopt 0.47 NVFP4 export of the tiny DeepSeek-V3 (CPU)."""
import sys, torch
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from transformers import AutoModelForCausalLM
src, out, cfgname = sys.argv[1], sys.argv[2], sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
model.config.architectures = ["DeepseekV3ForCausalLM"]
g = torch.Generator().manual_seed(0)
calib = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(4)]
def loop(m):
    for ids in calib:
        m(ids)
cfg = getattr(mtq, cfgname)
model = mtq.quantize(model, cfg, forward_loop=loop)
mtq.print_quant_summary(model)
export_hf_checkpoint(model, export_dir=out)
