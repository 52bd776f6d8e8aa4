"""A small byte-level BPE tokenizer, trained offline and deterministically, for the tiny presets."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

VOCAB_SIZE: Final = 512
EOS_TOKEN: Final = "<|endoftext|>"
IM_START: Final = "<|im_start|>"
IM_END: Final = "<|im_end|>"
SPECIAL_TOKENS: Final = (EOS_TOKEN, IM_START, IM_END)

CHAT_TEMPLATE: Final = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS: Final = """\
The quick brown fox jumps over the lazy dog. A small town sat at the edge of a wide river, and every
morning the baker opened his shop before the sun came up. People walked in for bread, coffee, and the
latest news about the weather, the harvest, and the price of apples at the market.

Once upon a time there was a little robot who wanted to learn how to paint. It had no brushes, so it
asked the children in the park for help. They showed it how to mix blue and yellow to make green, and
how to draw a tree with a brown trunk and a round crown of leaves. The robot was very happy.

Water boils at 100 degrees Celsius at sea level. The Earth goes around the Sun once a year, and the
Moon goes around the Earth about once a month. Light travels at nearly 300,000 kilometres per second,
so sunlight needs a little more than eight minutes to reach us. Plants turn sunlight, water and carbon
dioxide into sugar and oxygen; this process is called photosynthesis.

The capital of France is Paris. The capital of Japan is Tokyo, the capital of Italy is Rome, and the
capital of Canada is Ottawa. Mount Everest is the highest mountain on Earth, and the Pacific is the
largest ocean. Many rivers, such as the Nile, the Amazon and the Danube, cross several countries.

To make a simple soup, chop two onions, three carrots and a few potatoes. Warm some oil in a large pot,
add the vegetables, stir for five minutes, then pour in one litre of water with a pinch of salt. Let
it simmer for twenty minutes, blend until smooth, and serve it hot with fresh bread.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, 2))

if x > 0 and y < 5:
    result = {"name": "test", "values": [1, 2, 3]}

User: Hello! How are you today?
Assistant: I am doing well, thank you for asking. How can I help you?
User: Can you tell me a short story about a cat?
Assistant: Sure. A curious cat named Tom climbed the old oak tree to watch the birds. When night fell,
he could not find the way down, so he waited until morning, when the gardener brought a ladder.
User: What is two plus three?
Assistant: Two plus three is five.

Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the seven days of the week.
January, February, March, April, May, June, July, August, September, October, November, December.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, hundred, thousand.

Good software is simple, tested and easy to change. Write small functions, give them clear names,
and check their inputs. When a request fails, return a helpful error message that says what went
wrong and how to fix it. Measure before you optimize, because the slow part is rarely where you think.

She said, "It's a beautiful day, isn't it?" He answered: "Yes -- but it might rain later." They
laughed, opened their umbrellas (just in case), and walked along the street past the library, the
school, the hospital and the old train station. Questions? Answers! Lists: apples; pears; plums.

In the beginning, the server waits for requests. Each request carries a prompt, and the model reads
the prompt, builds a cache of keys and values, and then writes new tokens one at a time until it
reaches the end of the text or the maximum length. Streaming the tokens back makes the answer feel fast.
"""


def train_tokenizer() -> Tokenizer:
    """Train the byte-level BPE on the embedded corpus; the same input always gives the same merges."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tokenizer


def build_tokenizer(model_max_length: int) -> PreTrainedTokenizerFast:
    """Return the tiny tokenizer wrapped for transformers, with a ChatML-style chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(out_dir: Path, model_max_length: int) -> PreTrainedTokenizerFast:
    """Build the tokenizer, save it into ``out_dir`` and return it."""
    tokenizer = build_tokenizer(model_max_length)
    tokenizer.save_pretrained(str(out_dir))
    logger.debug("saved tiny tokenizer (%d tokens) to %s", len(tokenizer), out_dir)
    return tokenizer
