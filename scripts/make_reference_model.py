"""Builds the reference model of PEERS.md into a directory, offline and deterministically.

A random Llama (hidden 256, intermediate 1024, 4 layers, 4 heads, vocab 8192, float32, seed 0)
saved with ``save_pretrained``, and a byte-level BPE tokenizer of exactly 8192 tokens trained with
``tokenizers`` on a seeded synthetic corpus, saved as a ``PreTrainedTokenizerFast`` with a ChatML
chat template. Every server loads the same directory: ``--model DIR``.

    .venv/bin/python scripts/make_reference_model.py /tmp/pdserve-peers/reference-model
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SEED = 0
VOCAB_SIZE = 8192
MAX_POSITIONS = 2048
EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
NUM_WORDS = 20000
NUM_LINES = 6000
WORDS_PER_LINE = 40


def _corpus(rng: random.Random) -> Iterator[str]:
    """Lines of Zipf-distributed pseudo-words with punctuation and digits: enough for 8192 merges."""
    lexicon = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(NUM_WORDS)]
    weights = [1.0 / (rank + 1) for rank in range(NUM_WORDS)]
    for _ in range(NUM_LINES):
        words = rng.choices(lexicon, weights=weights, k=WORDS_PER_LINE)
        words = [w.capitalize() if rng.random() < 0.1 else w for w in words]
        yield " ".join(words) + rng.choice([".", ",", "!", "?", f" {rng.randint(0, 999)}."]) + "\n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[EOS_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(_corpus(random.Random(SEED))), trainer=trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def build_model(eos_id: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, do_sample=False
    )
    return model


def make_reference_model(out_dir: Path) -> None:
    """Writes tokenizer, config, generation config and weights into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    tokenizer.save_pretrained(str(out_dir))
    build_model(eos_id).save_pretrained(str(out_dir))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out_dir", type=Path, help="directory to write the model into")
    args = parser.parse_args()
    make_reference_model(args.out_dir)
    print(f"reference model written to {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
