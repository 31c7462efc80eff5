"""auto-round 0.16.1, iters=0 (RTN) on CPU, the tiny DeepSeek-V3 -> one export format."""
import sys, torch
from auto_round import AutoRound
from transformers import AutoModelForCausalLM, AutoTokenizer
src, out, scheme, fmt = sys.argv[1:5]
extra = dict(a.split("=", 1) for a in sys.argv[5:])
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
tok = AutoTokenizer.from_pretrained(src)
text = ["The quick brown fox jumps over the lazy dog. " * 6 + str(i) for i in range(16)]
kw = {k: (int(v) if v.lstrip("-").isdigit() else v == "True" if v in ("True", "False") else v) for k, v in extra.items()}
ar = AutoRound(model, tokenizer=tok, scheme=scheme, iters=0, device_map="cpu", dataset=text, nsamples=8, seqlen=32, **kw)
ar.quantize_and_save(out, format=fmt)
