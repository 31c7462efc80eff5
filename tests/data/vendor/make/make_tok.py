import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
tk = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}, []))
tk.pre_tokenizer, tk.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=chr(0x100 + 0) if False else None)
fast.save_pretrained(sys.argv[1])
