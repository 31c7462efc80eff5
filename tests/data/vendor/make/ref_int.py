"""Reference logits for auto-round's GPTQ / AWQ-layout exports with auto-round's own dequantizers in
float32: auto_round_extension.torch.qlinear_torch_zp.QuantLinear (GPTQ layout, zeros stored - 1;
its forward on an identity input gives W^T exactly) and export_to_awq.utils.dequantize_gemm (AWQ)."""
import json, sys, torch
from safetensors.torch import load_file, save_file
from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
from auto_round.export.export_to_awq.utils import dequantize_gemm
sys.path.insert(0, "/tmp/fp4fix")
import ref_common as rc

path, out = sys.argv[1], sys.argv[2]
qc = json.load(open(path + "/config.json"))["quantization_config"]
awq = qc["quant_method"] == "awq" or "awq" in str(qc.get("packing_format", ""))
bits = qc["bits"]
raw = load_file(path + "/model.safetensors")
state = {}
for k, v in raw.items():
    if k.endswith(".qweight"):
        m = k[: -len(".qweight")]
        scales = raw[m + ".scales"].float()
        G, out_f = scales.shape
        if awq:
            in_f = v.shape[0]
            group = in_f // G
            w = dequantize_gemm(v, raw[m + ".qzeros"], scales, bits, group)
        else:
            in_f = v.shape[0] * 32 // bits
            group = qc["group_size"]
            # QuantLinear.forward's own steps (qlinear_torch_zp, bits 2/4/8), taken here because its
            # g_idx loop reshapes wrongly when out_features > in_features (raises)
            wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
            qz = raw[m + ".qzeros"]
            zeros = torch.bitwise_right_shift(qz.unsqueeze(2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)).to(torch.int8)
            zeros = torch.bitwise_and(zeros, 2 ** bits - 1).reshape(scales.shape) + 1
            weight = torch.bitwise_and(torch.bitwise_right_shift(v.unsqueeze(1).expand(-1, 32 // bits, -1),
                                                                 wf.unsqueeze(-1)).to(torch.int8), 2 ** bits - 1)
            weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
            g_idx = raw.get(m + ".g_idx", torch.arange(in_f) // group).long()
            w = scales[g_idx] * (weight - zeros[g_idx])  # [in, out] = W^T
            if m + ".g_idx" not in raw and in_f % group == 0 and v.shape[1] <= in_f:  # the class itself agrees
                lin = QuantLinear(bits, group, in_f, out_f, False)
                lin.qweight, lin.qzeros, lin.scales = v, qz, scales
                lin.post_init()
                with torch.no_grad():
                    assert torch.equal(lin(torch.eye(in_f)), w), m
        state[m + ".weight"] = w.t().contiguous().float()
    elif not k.endswith((".qzeros", ".scales", ".g_idx")):
        state[k] = v.float()
model, hc = rc.build()
dense = rc.dense_logits()
vendor = rc.logits(state, hc, model)
rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
print("vendor vs dense", rel(vendor, dense))
save_file({"input_ids": rc.IDS, "dense_logits": dense, "vendor_logits": vendor}, out)
