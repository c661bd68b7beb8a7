"""config.json folders for scripts/bench.py's ``llm`` section: the 8B target shapes and
their drafters as HF / speculators configs, loaded by jspec.LLM with load_format="dummy"
(random weights, no checkpoint). Each folder is read back through jspec's own config
translation and checked against the shape it was written from."""

from __future__ import annotations

import json
import os

from jspec.config import ModelConfig, load_model_config
from jspec.drafters.config import DrafterConfig


def target_config_json(c: ModelConfig) -> dict:
    d = {
        "architectures": ["LlamaForCausalLM" if c.family == "llama" else "Qwen3ForCausalLM"],
        "model_type": c.family, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope.theta,
        "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias, "mlp_bias": c.mlp_bias,
        "max_position_embeddings": c.max_position_embeddings, "torch_dtype": "bfloat16",
    }
    if c.rope.rope_type == "llama3":
        d["rope_scaling"] = _llama3_rope(c.rope)
    if c.moe_layers:  # a Qwen3 mixture of experts, every layer sparse (Qwen3-30B-A3B's layout)
        assert c.moe_layers == tuple(range(c.num_layers))
        d.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=c.num_experts,
                 num_experts_per_tok=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size,
                 norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[])
    return d


def drafter_config_json(dc: DrafterConfig, K: int) -> dict:
    """A speculators-format config.json for ``dc`` (its decoder layers as a HF layer config)."""
    layer = {
        "model_type": dc.family, "vocab_size": dc.target_vocab_size, "hidden_size": dc.hidden_size,
        "intermediate_size": dc.intermediate_size, "num_hidden_layers": dc.num_layers,
        "num_attention_heads": dc.num_heads, "num_key_value_heads": dc.num_kv_heads, "head_dim": dc.head_dim,
        "hidden_act": "silu", "rms_norm_eps": dc.rms_norm_eps, "rope_theta": dc.rope.theta,
        "max_position_embeddings": dc.max_position_embeddings, "tie_word_embeddings": False,
        "attention_bias": dc.attention_bias, "mlp_bias": dc.mlp_bias,
    }
    if dc.rope.rope_type == "llama3":
        layer["rope_scaling"] = _llama3_rope(dc.rope)
    d = {
        "architectures": [{"eagle3": "Eagle3Speculator", "peagle": "PEagleSpeculator",
                           "dflash": "DFlashSpeculator"}[dc.method]],
        "speculators_model_type": dc.method,
        "speculators_config": {"algorithm": dc.method, "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K}],
                               "verifier": {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}},
        "transformer_layer_config": layer,
        "draft_vocab_size": dc.draft_vocab_size,
        "target_hidden_size": dc.target_hidden_size,
        "norm_before_fc": dc.norm_before_fc,
        "torch_dtype": "bfloat16",
    }
    if dc.method == "dflash":
        d.update(block_size=dc.block_size, aux_hidden_state_layer_ids=list(dc.aux_layer_ids),
                 mask_token_id=dc.mask_token_id)
    else:
        d.update(norm_before_residual=dc.norm_before_residual, eagle_aux_hidden_state_layer_ids=list(dc.aux_layer_ids))
        if dc.method == "peagle":
            d["mask_token_id"] = dc.mask_token_id
    return d


def _llama3_rope(r) -> dict:
    return {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
            "high_freq_factor": r.high_freq_factor,
            "original_max_position_embeddings": r.original_max_position_embeddings}


def write_target_folder(folder: str, cfg: ModelConfig) -> str:
    """``folder`` holding only the config.json of target shape ``cfg`` (e.g. a draft model's)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(target_config_json(cfg), f, indent=1)
    return folder


def write_folders(root: str, cfg: ModelConfig, dc: DrafterConfig, K: int) -> tuple[str, str]:
    """(target folder, drafter folder) under ``root``, each holding only its config.json."""
    from jspec.drafters.config import detect_format, drafter_config_from_hf
    from jspec.drafters.loader import _dummy_tensor_names, read_drafter_config

    tdir, ddir = os.path.join(root, f"target-{cfg.family}"), os.path.join(root, f"drafter-{dc.method}")
    for folder, d in ((tdir, target_config_json(cfg)), (ddir, drafter_config_json(dc, K))):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(d, f, indent=1)
    back = load_model_config(tdir)
    assert back == cfg.__class__(**{**cfg.__dict__, "dtype": back.dtype, "eos_token_ids": back.eos_token_ids}), \
        (back, cfg)
    d = read_drafter_config(ddir)
    dback = drafter_config_from_hf(d, back, _dummy_tensor_names(*detect_format(d)))
    want = {k: v for k, v in dc.__dict__.items() if k not in ("num_speculative_tokens", "has_own_embeddings")}
    got = {k: v for k, v in dback.__dict__.items() if k in want}
    assert got == want, {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    return tdir, ddir


def write_tokenizer(folder: str, vocab_size: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens into ``folder`` (the structured
    section: the grammar engine walks a vocabulary of the model's real size). Its merges are
    random (each token a shorter one + a printable byte), its last two ids the specials
    <|begin_of_text|> and <|eot_id|> (EOS)."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    bytes_ = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(bytes_))}
    printable = [c for c in vocab if c.isalnum() or c in '{}[]":,. -_']
    toks, merges, rng = list(vocab), [], random.Random(seed)
    while len(vocab) < vocab_size - 2:
        a, b = rng.choice(toks[-4096:] if rng.random() < 0.5 else toks), rng.choice(printable)
        if a + b not in vocab and len(a) < 12:
            vocab[a + b] = len(vocab)
            toks.append(a + b)
            merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin_of_text|>", "<|eot_id|>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>",
                            eos_token="<|eot_id|>").save_pretrained(folder)


def main(argv=None) -> None:
    """Write the folders bench.py's llm section uses, for a server (scripts/bench_serving.py):
    ``python scripts/bench_llm_folders.py OUT --method eagle3`` -> OUT/target-llama, OUT/drafter-eagle3."""
    import argparse

    from bench_common import LLAMA_8B, QWEN3_8B, drafter_config

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("out")
    p.add_argument("--method", default="eagle3", choices=["eagle3", "peagle", "dflash"],
                   help="eagle3: the Llama-3.1-8B shape; peagle, dflash: Qwen3-8B (as bench.py)")
    p.add_argument("--k", type=int, default=3, help="the drafter config's speculative tokens")
    p.add_argument("--no-tokenizer", dest="tokenizer", action="store_false",
                   help="no tokenizer in the target folder (the server then streams token ids, no text)")
    a = p.parse_args(argv)
    cfg = LLAMA_8B if a.method == "eagle3" else QWEN3_8B
    tdir, ddir = write_folders(a.out, cfg, drafter_config(a.method, cfg, False), a.k)
    if a.tokenizer:
        write_tokenizer(tdir, cfg.vocab_size)
    print(f"target: {tdir}\ndrafter: {ddir}")


if __name__ == "__main__":
    main()
