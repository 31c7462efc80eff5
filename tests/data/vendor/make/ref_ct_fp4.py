"""Reference logits for auto-round's llm_compressor NVFP4 / MXFP4 exports with compressed-tensors'
own steps in float32 (its decompressor takes them in bfloat16)."""
import json, sys, types, torch
from safetensors.torch import load_file, save_file
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from compressed_tensors.compressors.mx_utils import decompress_mx_scale
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize
from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
sys.path.insert(0, "/tmp/fp4fix")
import ref_common as rc

path = sys.argv[1]
qc = json.load(open(path + "/config.json"))["quantization_config"]
group = next(iter(qc["config_groups"].values()))
wargs = QuantizationArgs(**{k: v for k, v in group["weights"].items() if k != "scale_dtype"},
                         scale_dtype=torch.float8_e4m3fn if "e4m3" in str(group["weights"].get("scale_dtype")) else torch.uint8)
aargs = QuantizationArgs(**{k: v for k, v in group["input_activations"].items() if k not in ("scale_dtype", "observer")},
                         scale_dtype=torch.float8_e4m3fn if "e4m3" in str(group["input_activations"].get("scale_dtype")) else torch.uint8)
mx = qc["format"] == "mxfp4-pack-quantized"
raw = load_file(path + "/model.safetensors")
state, igs, quantized = {}, {}, set()
for k, v in raw.items():
    if k.endswith(".weight_packed"):
        m = k[: -len(".weight_packed")]
        quantized.add(m)
        rows, half = v.shape
        q = unpack_fp4_from_uint8(v, rows, half * 2, dtype=torch.float32)
        s = raw[m + ".weight_scale"]
        s = decompress_mx_scale(s).to(torch.float32) if mx else s.to(torch.float32)
        state[m + ".weight"] = dequantize(x_q=q, scale=s, args=wargs, global_scale=raw.get(m + ".weight_global_scale"),
                                          dtype=torch.float32)
        if m + ".input_global_scale" in raw:
            igs[m] = raw[m + ".input_global_scale"].float()
    elif not k.endswith((".weight_scale", ".weight_global_scale", ".input_global_scale")):
        state[k] = v.float()

def fq(x, m):
    """forward_quantize of the input: dynamic scales (compute_dynamic_scales_and_zp) then fake_quantize."""
    gs = igs.get(m)
    scale, zp = compute_dynamic_scales_and_zp(x.float(), aargs, None, global_scale=gs)
    return fake_quantize(x.float(), scale, zp, aargs, global_scale=gs).to(x.dtype)

model, hc = rc.build()
dense = rc.dense_logits()
vendor = rc.logits(state, hc, model)
for name, mod in model.named_modules():
    if isinstance(mod, torch.nn.Linear) and name in quantized:
        mod.register_forward_pre_hook(lambda mo, a, name=name: (fq(a[0], name),))
    if type(mod).__name__ == "DeepseekV3Experts":
        def fwd(self, hidden_states, top_k_index, top_k_weights, base=name):
            out = torch.zeros_like(hidden_states)
            for e in range(self.num_experts):
                tok, pos = torch.where(top_k_index == e)
                if tok.numel() == 0:
                    continue
                x = fq(hidden_states[tok], f"{base}.{e}.gate_proj")
                gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                h = fq(self.act_fn(gate) * up, f"{base}.{e}.down_proj")
                h = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, h)
            return out
        mod.forward = types.MethodType(fwd, mod)
with torch.no_grad():
    actq = model(rc.IDS).logits.float()
for k in igs:
    if k.endswith("gate_proj"):
        assert torch.equal(igs[k], igs[k[:-9] + "up_proj"]), k
rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
print("vendor vs dense", rel(vendor, dense), "actq vs vendor", rel(actq, vendor),
      "argmax agree", float((actq.argmax(-1) == vendor.argmax(-1)).float().mean()))
save_file({"input_ids": rc.IDS, "dense_logits": dense, "vendor_logits": vendor, "vendor_logits_actquant": actq},
          sys.argv[2])
