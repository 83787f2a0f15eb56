"""Tiny random-weight Qwen2/Qwen3/Llama models with a locally trained tokenizer.

No model hub is needed: the tokenizer is a byte-level BPE trained on a synthetic corpus
generated here, and the model is built from a config with random weights. The directory
it writes loads with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer`` and with
``vllm.LLM(model=DIR)`` like any hub checkpoint.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rpa.core.errors import InputError
from rpa.core.fieldtypes import seed_problem

ARCHS = ("qwen2", "qwen3", "llama")
MIN_CONTEXT = 64
"""The smallest context a tiny model is built with: the probe's default prompts and a short completion."""
MAX_VOCAB = 262_144
"""The largest vocabulary a tiny model is built with: the largest of a released LM family (Gemma 3's
262,144; Qwen3's is 151,936). The synthetic corpus gives the tokenizer ~800 tokens, so the rest are
embedding rows no token uses; tokenizers' BPE trainer allocates a table of ``vocab_size`` entries
up front, and at 10**11 the process aborts in Rust."""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_WORDS = (
    "the a of to and in is it that for on with as was by at be this are from or an but not what "
    "all were when we there can which their if do will each about how up out them then she many "
    "some so these would other into has more her two like him see time could no make than first "
    "been its who now people my made over did down only way find use may water long little very "
    "after words called just where most know get through back much before go good new write our "
    "number sum answer question add plus minus times equal count list sort reverse copy repeat"
).split()


@dataclass(frozen=True)
class TinySpec:
    """Sizes of a tiny model. vLLM's CPU attention needs ``head_dim`` in {32, 64, ...}."""

    arch: str = field(default="qwen3", metadata={"help": "model family", "choices": ARCHS})
    hidden_size: int = field(default=128, metadata={"help": "hidden width"})
    intermediate_size: int = field(default=384, metadata={"help": "SwiGLU width"})
    num_hidden_layers: int = field(default=2, metadata={"help": "decoder layers"})
    num_attention_heads: int = field(default=4, metadata={"help": "query heads"})
    num_key_value_heads: int = field(default=2, metadata={"help": "key/value heads (a divisor of the query heads)"})
    head_dim: int = field(default=32, metadata={"help": "per-head width (a multiple of 32: vLLM CPU attention)"})
    vocab_size: int = field(default=512, metadata={"help": "vocabulary (>= 300; the tokenizer may have fewer tokens)"})
    max_position_embeddings: int = field(default=1024, metadata={"help": "context length"})
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base"})
    tie_word_embeddings: bool = field(default=False, metadata={"help": "share the embedding and LM-head weights"})
    initializer_range: float = field(default=0.02, metadata={
        "help": "std of the random weights; larger gives peakier next-token distributions (a random model at "
                "0.02 is near uniform, so every sampled token has p ~ 1/vocab)"})
    seed: int = field(default=0, metadata={"help": "seed of the weights and the tokenizer's corpus"})

    def validate(self) -> None:
        """Refuse (:class:`~rpa.core.errors.InputError`, a ``ValueError``) a spec that would not build,
        or build a model vLLM cannot run, before anything is written."""
        if self.arch not in ARCHS:
            raise InputError(f"unsupported tiny arch {self.arch!r}; supported: {', '.join(ARCHS)}")
        sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "max_position_embeddings")
        bad = [f"{name} {getattr(self, name)}" for name in sizes if getattr(self, name) < 1]
        if bad:
            raise InputError(f"sizes must be >= 1: {', '.join(bad)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InputError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.arch == "qwen2" and self.hidden_size != self.num_attention_heads * self.head_dim:
            raise InputError("qwen2 needs hidden_size == num_attention_heads * head_dim")
        if self.head_dim % 32:
            raise InputError(f"head_dim must be a multiple of 32 (vLLM CPU attention), got {self.head_dim}")
        if not 0 < self.initializer_range < float("inf") or not 0 < self.rope_theta < float("inf"):
            raise InputError("initializer_range and rope_theta must be finite and > 0")
        if seed_problem(self.seed):
            raise InputError(f"seed {seed_problem(self.seed)}")
        if self.max_position_embeddings < MIN_CONTEXT:
            raise InputError(f"max_position_embeddings {self.max_position_embeddings} cannot hold a prompt and a "
                             f"completion; at least {MIN_CONTEXT}")
        if self.vocab_size < 300:
            raise InputError(f"vocab_size must be at least 300 (256 byte symbols + merges + specials), "
                             f"got {self.vocab_size}")
        if self.vocab_size > MAX_VOCAB:
            raise InputError(f"vocab_size must be at most {MAX_VOCAB} (the largest vocabulary of a released LM; "
                             f"the tokenizer has ~800 tokens), got {self.vocab_size}")


def synthetic_corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Deterministic training text for the tokenizer: words, numbers, arithmetic."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.randrange(3)
        if kind == 0:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))))
        elif kind == 1:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"What is {a} + {b}? Answer: {a + b}")
        else:
            seq = [str(rng.randint(0, 9)) for _ in range(rng.randint(3, 8))]
            lines.append(f"sort {' '.join(seq)} -> {' '.join(sorted(seq))}")
    return lines


def build_tokenizer(vocab_size: int, seed: int):
    """Train a byte-level BPE tokenizer and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(seed), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 30,
    )


def build_config(spec: TinySpec, tokenizer):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        initializer_range=spec.initializer_range,
    )
    if spec.arch == "qwen2":
        config = Qwen2Config(**common)
    elif spec.arch == "llama":  # SmolLM2's layout: no biases, full-head NeoX RoPE
        config = LlamaConfig(head_dim=spec.head_dim, attention_bias=False, mlp_bias=False, **common)
    else:
        config = Qwen3Config(head_dim=spec.head_dim, **common)
    config.dtype = "bfloat16"
    return config


SPEC_FILE = "rpa_tiny.json"
"""What :func:`build_tiny` writes last into a model directory: the spec it was built from."""


def check_target(out_dir: str | Path) -> None:
    """``out_dir`` can take a tiny model: not there yet, empty, or an earlier tiny model (rebuilt in
    place, as the workflow reruns its rule); a directory of other files is refused
    (:class:`InputError`), not written into."""
    out = Path(out_dir)
    if not out.is_dir() or (out / SPEC_FILE).is_file():
        return
    others = sorted(p.name for p in out.iterdir())
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise InputError(f"--out {out_dir}: a non-empty directory that is not a tiny model ({shown}); rpa tiny "
                         f"writes into a new or empty directory")


def build_tiny(out_dir: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a tiny random model (Qwen2, Qwen3 or Llama), its tokenizer and ``rpa_tiny.json`` to ``out_dir``
    (:func:`check_target`: not into a directory of other files)."""
    import torch
    from transformers import AutoModelForCausalLM

    spec.validate()
    check_target(out_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens > vocab_size {spec.vocab_size}")
    config = build_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # norm weights off 1.0, so the weight multiply rounds like a trained model's
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out
