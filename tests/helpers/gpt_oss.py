"""A tiny gpt-oss target (transformers' GptOssForCausalLM) with tests/helpers/spec_e2e.py's
planted feature, its MXFP4 copy and its EAGLE3 and DFlash drafters: built by
tests/e2e/test_gpt_oss.py and, for the GPU check, by tests/helpers/gpu_lines.py."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from jspec.checkpoint.gpt_oss_layout import mxfp4_quantize
from jspec.mxfp4 import Mxfp4Weight
from tests.helpers import spec_e2e as h
from tests.helpers.drafters import fill_random

WINDOW = 8  # its sliding layers' window: contexts of up to 56 tokens run well past it


def config(**kw):
    from transformers import GptOssConfig

    kw = {"vocab_size": h.V, "bos_token_id": 1, "eos_token_id": 2, **kw}
    cfg = GptOssConfig(hidden_size=h.H, intermediate_size=32, num_hidden_layers=h.L,
                       num_attention_heads=h.HEADS, num_key_value_heads=h.KVH, head_dim=h.HD, num_local_experts=8,
                       num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=128,
                       tie_word_embeddings=False,
                       rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                        "truncate": False, "original_max_position_embeddings": 32,
                                        "rope_theta": 150000.0}, **kw)
    cfg._attn_implementation = "eager"
    return cfg


def mxfp4_copy(m, folder: str):
    """``folder``: m's checkpoint with its experts as MXFP4 blocks and scales (their [out, in]
    rows, gate and up interleaved, as gpt-oss ships them); m's experts set to the values
    transformers dequantizes them to, the reference's weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    m.save_pretrained(folder)
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    for i, layer in enumerate(m.model.layers):
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            w = getattr(ex, name).detach().float().transpose(1, 2).numpy()  # [E, out, in]
            blocks, scales = mxfp4_quantize(w)
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[key + "_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            tensors[key + "_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
            ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            assert np.array_equal(np.asarray(Mxfp4Weight(blocks, scales).dequantize()),  # jspec's own
                                  ref.transpose(1, 2).numpy())
            assert not np.allclose(ref.transpose(1, 2).numpy(), w)  # 4-bit values: not the weights themselves
            with torch.no_grad():  # transformers' dequantized values [E, in, out]: the reference's weights
                getattr(ex, name).copy_(ref)
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(folder, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))


def build(root: str) -> dict:
    """{"target", "mxfp4", "eagle3", "eagle3_orig", "dflash4": folders; "hf", "hf_mxfp4": torch models}."""
    from speculators.models import Eagle3DraftModel
    from speculators.models.dflash import DFlashDraftModel
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    m = GptOssForCausalLM(config()).eval()
    with torch.no_grad():
        fill_random(m, scale=0.15)
        m.model.embed_tokens.weight[:, h.F] = h.C_EMBED
        for layer in m.model.layers:
            layer.self_attn.sinks.mul_(10)  # logits of a few units, as trained models have
            layer.self_attn.o_proj.weight[h.F, :] = 0.0
            layer.self_attn.o_proj.bias[h.F] = 0.0
            layer.mlp.experts.down_proj[..., h.F] = 0.0  # [E, I, H]
            layer.mlp.experts.down_proj_bias[:, h.F] = 0.0
            layer.input_layernorm.weight[h.F] = 0.0
            layer.post_attention_layernorm.weight[h.F] = 0.0
        m.lm_head.weight[h.X, h.F] += h.A_TARGET
    out = {"hf": m, "target": os.path.join(root, "target"), "mxfp4": os.path.join(root, "mxfp4")}
    # bf16 checkpoints, as gpt-oss ships (its experts MXFP4 in the second); the references run
    # their values in float32
    m.to(torch.bfloat16).save_pretrained(out["target"])
    m.to(torch.float32)
    q = GptOssForCausalLM(config()).eval()
    q.load_state_dict(m.state_dict())
    mxfp4_copy(q.to(torch.bfloat16), out["mxfp4"])
    out["hf_mxfp4"] = q.to(torch.float32)
    sc = h._spec_config("eagle3", "llama", 1, 3, draft_vocab_size=h.DRAFT_VOCAB, norm_before_residual=True,
                        eagle_aux_hidden_state_layer_ids=h.AUX)
    out["eagle3"] = os.path.join(root, "eagle3")
    h._randomize(Eagle3DraftModel(sc), m, h.DRAFT_VOCAB, seed=1, fc_col=h.F).save_pretrained(out["eagle3"])
    from jspec.drafters.convert import speculators_eagle3_to_original

    out["eagle3_orig"] = os.path.join(root, "eagle3_orig")  # the same head in the original layout (midlayer.*)
    speculators_eagle3_to_original(out["eagle3"], out["eagle3_orig"])
    sc = h._spec_config("dflash", "qwen3", 1, 3, draft_vocab_size=h.DRAFT_VOCAB, mask_token_id=h.MASK, block_size=4,
                        aux_hidden_state_layer_ids=h.DFLASH_AUX)
    out["dflash4"] = os.path.join(root, "dflash4")
    h._randomize(DFlashDraftModel(sc), m, h.DRAFT_VOCAB, seed=7, fc_col=h.F).save_pretrained(out["dflash4"])
    return out


# gpt-oss's harmony special tokens (a byte-level tokenizer's ids 256 and up in chat_model)
HARMONY_SPECIALS = ["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                    "<|constrain|>", "<|return|>", "<|call|>"]
# A harmony-shaped template of our own (gpt-oss's, shortened): each message as
# <|start|>ROLE<|message|>TEXT<|end|>, then <|start|>assistant for the reply.
HARMONY_TEMPLATE = ("{%- for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{%- endfor %}"
                    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}")


def chat_model(folder: str, seed: int = 0) -> str:
    """``folder``: a random gpt-oss target over a byte-level tokenizer (ids 0-255 the bytes,
    the harmony special tokens after) with a harmony-shaped chat template; <|return|> and
    <|call|> end a reply (its generation_config.json, as gpt-oss's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, GptOssForCausalLM, PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:] + [256 + n for n in range(256 - len(bs))]
    bs += [b for b in range(256) if b not in bs]
    byte_to_char = dict(zip(bs, map(chr, cs)))
    assert set(byte_to_char.values()) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab={byte_to_char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(HARMONY_SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|startoftext|>", eos_token="<|return|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = HARMONY_TEMPLATE
    fast.save_pretrained(folder)
    ids = {t: fast.convert_tokens_to_ids(t) for t in HARMONY_SPECIALS}
    torch.manual_seed(seed)
    m = GptOssForCausalLM(config(vocab_size=256 + len(HARMONY_SPECIALS), bos_token_id=ids["<|startoftext|>"],
                                 eos_token_id=[ids["<|return|>"], ids["<|call|>"]],
                                 pad_token_id=ids["<|endoftext|>"])).eval()
    with torch.no_grad():
        fill_random(m, scale=0.15)
    m.save_pretrained(folder)
    GenerationConfig(eos_token_id=[ids["<|return|>"], ids["<|call|>"]], bos_token_id=ids["<|startoftext|>"],
                     pad_token_id=ids["<|endoftext|>"]).save_pretrained(folder)
    return folder
