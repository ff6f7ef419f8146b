"""transformers' side of tests/export_eval_generate.rs.

usage:
  hf_interop.py check WORK
      WORK/params.json: {"dirs": [{"path": DIR, "dtype": "float32"|"bfloat16", "shards": N}],
                         "eval": {"dir": DIR, "context_length": T}}
      Loads every DIR with AutoModelForCausalLM.from_pretrained (no missing, unexpected or
      mismatched tensors allowed; the dtype and the number of safetensors files as expected) and
      writes its fp32 logits (unless "logits": false) on WORK/batch.safetensors ("tokens" [b, s]) to WORK/logits_<i>.safetensors.
      A dir with "text" set is also loaded with AutoTokenizer; the ids of that text, its eos
      token and id go to result.json.
      Then the mean cross-entropy of eval.dir over the consecutive non-overlapping windows of T + 1
      tokens of WORK/stream.safetensors ("tokens" [n]) goes to WORK/result.json, with the window count.
  hf_interop.py tokenizers WORK
      WORK/tokenizers.json: {"dirs": [DIR, ...], "texts": [TEXT, ...]}. Loads every DIR with
      AutoTokenizer only and writes WORK/tokenizers_result.json: per DIR its class, eos/bos
      tokens and ids, and per text the ids of tok(text) (special tokens added as the
      tokenizer's defaults say) and tok.decode of those ids.
  hf_interop.py tokenizer WORK TEXT_FILE
      Trains a 512-token byte-level BPE (special tokens <s>, </s>) on TEXT_FILE with `tokenizers`
      and saves it as WORK/tokenizer.json.
  hf_interop.py generate WORK [--qwen3 | --qwen3-moe | --mixtral]
      Saves a small random LlamaForCausalLM (GQA, random RMSNorm weights; with --qwen3 a
      Qwen3ForCausalLM with head_dim 16 apart from hidden / heads = 8; with --qwen3-moe a
      Qwen3MoeForCausalLM, layer 0 of 4 experts (top 2), layer 1 dense; with --mixtral a
      MixtralForCausalLM of 4 experts, top 2) to WORK/model and writes
      WORK/generate.json: prompts and transformers' greedy `generate` outputs. The EOS id in the saved
      generation_config.json is a token that greedy decoding of prompt 0 emits partway, so that
      prompt stops early at EOS.
"""
import glob
import json
import os
import sys

mode, work = sys.argv[1], sys.argv[2]
if mode not in ("tokenizer", "tokenizers"):
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([sys.argv[3]], trainer)
    tok.save(f"{work}/tokenizer.json")


def tokenizers():
    from transformers import AutoTokenizer

    params = json.load(open(f"{work}/tokenizers.json"))
    result = []
    for d in params["dirs"]:
        tok = AutoTokenizer.from_pretrained(d)
        entry = {"class": type(tok).__name__, "eos": [tok.eos_token, tok.eos_token_id],
                 "bos": [tok.bos_token, tok.bos_token_id], "texts": []}
        for text in params["texts"]:
            ids = tok(text)["input_ids"]
            entry["texts"].append({"ids": ids, "decoded": tok.decode(ids)})
        result.append(entry)
    json.dump(result, open(f"{work}/tokenizers_result.json", "w"))


def check():
    params = json.load(open(f"{work}/params.json"))
    tokens = load_file(f"{work}/batch.safetensors")["tokens"]
    result = {"dirs": []}
    for i, d in enumerate(params["dirs"]):
        model, info = AutoModelForCausalLM.from_pretrained(d["path"], output_loading_info=True)
        problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
        assert not problems and not info.get("error_msgs"), f"{d['path']}: {info}"
        assert str(model.dtype) == f"torch.{d['dtype']}", f"{d['path']}: loaded as {model.dtype}"
        files = glob.glob(os.path.join(d["path"], "*.safetensors"))
        assert len(files) == d["shards"], f"{d['path']}: {len(files)} safetensors files"
        model.eval()
        if d.get("logits", True):
            with torch.no_grad():
                logits = model(input_ids=tokens).logits.float()
            save_file({"logits": logits.contiguous()}, f"{work}/logits_{i}.safetensors")
        entry = {"path": d["path"], "dtype": str(model.dtype), "files": len(files)}
        if "text" in d:
            tok = AutoTokenizer.from_pretrained(d["path"])
            entry["ids"] = tok(d["text"], add_special_tokens=False)["input_ids"]
            entry["eos"] = [tok.eos_token, tok.eos_token_id]
            entry["bos"] = [tok.bos_token, tok.bos_token_id]
        result["dirs"].append(entry)

    ev = params["eval"]
    model = AutoModelForCausalLM.from_pretrained(ev["dir"]).float().eval()
    stream = load_file(f"{work}/stream.safetensors")["tokens"].long()
    t = ev["context_length"]
    n = stream.numel() // (t + 1)
    windows = stream[: n * (t + 1)].view(n, t + 1)
    total, count = 0.0, 0
    with torch.no_grad():
        for chunk in windows.split(5):
            logits = model(input_ids=chunk[:, :-1]).logits.float()
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum")
            total += ce.double().item()
            count += chunk[:, 1:].numel()
    result["eval"] = {"loss": total / count, "windows": n, "tokens": count}
    json.dump(result, open(f"{work}/result.json", "w"))


def generate():
    torch.manual_seed(0)
    Config, Model, extra = LlamaConfig, LlamaForCausalLM, {}
    if "--qwen3" in sys.argv:
        from transformers import Qwen3Config as Config, Qwen3ForCausalLM as Model
        extra = {"head_dim": 16, "use_sliding_window": False}
    elif "--qwen3-moe" in sys.argv:
        from transformers import Qwen3MoeConfig as Config, Qwen3MoeForCausalLM as Model
        extra = {"head_dim": 16, "use_sliding_window": False, "num_experts": 4,
                 "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1],
                 "norm_topk_prob": True}
    elif "--mixtral" in sys.argv:
        from transformers import MixtralConfig as Config, MixtralForCausalLM as Model
        extra = {"num_local_experts": 4, "num_experts_per_tok": 2}
    config = Config(
        **extra,
        vocab_size=384,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation="sdpa",
    )
    model = Model(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                # Larger weights than the default init make the logits peaked, so greedy choices
                # are far from ties and the sequences vary instead of repeating one token.
                p.normal_(0.0, 0.2)
    model.eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (5, 1, 17)]
    new_tokens = 32

    def greedy(prompt):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=new_tokens,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            )
        return out[0, len(prompt):].tolist()

    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    free = greedy(prompts[0])
    # EOS := the first token that greedy decoding of prompt 0 emits for the first time at step >= 4.
    stop = next((k for k in range(4, len(free)) if free[k] not in free[:k]), None)
    assert stop is not None, f"no fresh token in {free}"
    eos = free[stop]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.save_pretrained(f"{work}/model")
    outputs = [greedy(p) for p in prompts]
    assert outputs[0] == free[: stop + 1], (outputs[0], free)
    json.dump({"prompts": prompts, "outputs": outputs, "eos": eos, "max_new_tokens": new_tokens,
               "unstopped": free}, open(f"{work}/generate.json", "w"))


{"check": check, "generate": generate, "tokenizer": tokenizer, "tokenizers": tokenizers}[mode]()
