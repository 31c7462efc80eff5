"""Reference logits for the modelopt NVFP4 fixture, with modelopt's own NVFP4QTensor (CPU, float32)."""
import sys, types, torch
from safetensors.torch import load_file, save_file
from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
sys.path.insert(0, "/tmp/fp4fix")
import ref_common as rc

path = sys.argv[1]
raw = load_file(path + "/model.safetensors")
state, act_scales, fp8_layers = {}, {}, set()
for k, v in raw.items():
    if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
        if k.endswith(".input_scale"):
            act_scales[k[: -len(".input_scale")]] = v.float()
        continue
    m = k[: -len(".weight")]
    if v.dtype == torch.float8_e4m3fn:
        fp8_layers.add(m)
        state[k] = FP8QTensor(v.shape, torch.float32, v).dequantize(dtype=torch.float32, scale=raw[m + ".weight_scale"].float())
    elif v.dtype == torch.uint8:
        shape = (v.shape[0], v.shape[1] * 2)
        q = NVFP4QTensor(torch.Size(shape), torch.float32, v)
        state[k] = q.dequantize(dtype=torch.float32, scale=raw[m + ".weight_scale"],
                                double_scale=raw[m + ".weight_scale_2"].float(), block_sizes={-1: 16})
    else:
        state[k] = v.float()

def fq(x, gs):
    """modelopt's NVFP4 activation quantization: dynamic e4m3 scale per 16 under the static global scale."""
    q, s, s2 = NVFP4QTensor.quantize(x.float(), 16, weights_scaling_factor_2=gs)
    return q.dequantize(dtype=torch.float32, scale=s, double_scale=s2, block_sizes={-1: 16}).to(x.dtype)

def fq8(x, s):
    """modelopt's static per-tensor FP8 activation quantization (clamped to +-448 as the deployed kernels do)."""
    q = FP8QTensor(x.shape, torch.float32, torch.clamp(x.float() / s, -448, 448).to(torch.float8_e4m3fn))
    return q.dequantize(dtype=torch.float32, scale=s).to(x.dtype)

model, hc = rc.build()
dense = rc.dense_logits()
vendor = rc.logits(state, hc, model)
# activation emulation: every quantized nn.Linear's input, and each routed expert's two inputs
for name, mod in model.named_modules():
    if isinstance(mod, torch.nn.Linear) and name in act_scales:
        f = fq8 if name in fp8_layers else fq
        mod.register_forward_pre_hook(lambda m, a, gs=act_scales[name], f=f: (f(a[0], gs),))
    if type(mod).__name__ == "DeepseekV3Experts":
        def fwd(self, hidden_states, top_k_index, top_k_weights, base=name):
            out = torch.zeros_like(hidden_states)
            for e in range(self.num_experts):
                tok, pos = torch.where(top_k_index == e)
                if tok.numel() == 0:
                    continue
                x = fq(hidden_states[tok], act_scales[f"{base}.{e}.gate_proj"])
                gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
                h = fq(self.act_fn(gate) * up, act_scales[f"{base}.{e}.down_proj"])
                h = torch.nn.functional.linear(h, self.down_proj[e]) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, h)
            return out
        mod.forward = types.MethodType(fwd, mod)
with torch.no_grad():
    actq = model(rc.IDS).logits.float()
# gate and up of one expert share their input scale (one fused gate_up input quantizer)
for k in act_scales:
    if k.endswith("gate_proj"):
        assert torch.equal(act_scales[k], act_scales[k[:-9] + "up_proj"]), k
rel = lambda a, b: float((a - b).abs().max() / b.abs().max())
print("vendor vs dense", rel(vendor, dense), "actq vs vendor", rel(actq, vendor),
      "argmax agree", float((actq.argmax(-1) == vendor.argmax(-1)).float().mean()))
save_file({"input_ids": rc.IDS, "dense_logits": dense, "vendor_logits": vendor, "vendor_logits_actquant": actq},
          path + ".reference.safetensors")
