"""nvidia-modelopt 0.47: NVFP4 MLPs / experts, FP8 attention, kv_b_proj left bf16 -> MIXED_PRECISION export."""
import copy, sys, torch
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint
from transformers import AutoModelForCausalLM
src, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
model.config.architectures = ["DeepseekV3ForCausalLM"]
g = torch.Generator().manual_seed(0)
calib = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(4)]
def loop(m):
    for ids in calib:
        m(ids)
cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
fp8 = {"num_bits": (4, 3), "axis": None}
cfg["quant_cfg"] += [{"quantizer_name": "*self_attn*weight_quantizer", "cfg": fp8},
                     {"quantizer_name": "*self_attn*input_quantizer", "cfg": fp8},
                     {"quantizer_name": "*kv_b_proj*", "enable": False}]
model = mtq.quantize(model, cfg, forward_loop=loop)
export_hf_checkpoint(model, export_dir=out)
