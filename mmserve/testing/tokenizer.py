"""Tiny deterministic byte-level BPE tokenizer for random test checkpoints.

Trained offline on a fixed built-in corpus, so it needs no model hub and gives the same vocab every time.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "A picture is worth a thousand words, but a caption costs only ten.",
    "What is in this image? Describe it in one sentence.",
    "There are 3 red apples and 12 green pears on the table.",
    "The year 2024 had 366 days; 1999 had only 365.",
    "Call me at 555-0199 or e-mail test@example.com before 9:30 am.",
    'She said: "It\'s fine!" -- and then (quietly) left the room...',
    "Is the cat on the mat, or is the mat on the cat?",
    "We ordered a café au lait and a crème brûlée at the café.",
    "His naïve plan failed; the naïve reader believed every word.",
    "日本 is the Japanese name of Japan; 日本語 is its language.",
    "東京 and 大阪 are large cities in 日本.",
    "The emoji 🙂 means happy, 🎉 means party, and 🚀 means launch.",
    "Prices: $4.99, €3,50, £2 and ¥100 — all rounded to 2 decimals.",
    "Über-fast servers answer in 12 ms; façade, jalapeño and Zürich are loanwords.",
    "Hello, world! Hello again, world. Goodbye, world?",
    "The assistant looks at the photo and answers the user's question.",
    "USER: What color is the sky? ASSISTANT: The sky is blue.",
    "USER: How many dogs are there? ASSISTANT: There are two dogs.",
    "A small model with random weights still produces tokens very quickly.",
    "Numbers like 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 and 10 appear often.",
    "x = y + 2 * (z - 1) / 4; print(x) # prints 42",
    "def add(a, b): return a + b",
    '{"name": "mmserve", "version": "0.1.0", "ok": true}',
    "The red square sits left of the blue circle inside a yellow frame.",
    "A striped zebra and a spotted giraffe stand near the river bank.",
    "In the morning the streets are quiet; at night they are loud.",
    "Batching many requests together keeps the accelerator busy.",
    "Résumé, coöperate, piñata, smörgåsbord: accents everywhere.",
    "Καλημέρα means good morning; Привет means hello.",
    "Tabs\tand newlines\nare whitespace too.",
    "The café is naïve about 日本 food 🙂 and serves it anyway.",
    "café café café naïve naïve 日本 日本 🙂 🙂",
    "Count: one, two, three, four, five, six, seven, eight, nine, ten.",
    "Is this a photo of a dog, a cat, a bird or a horse?",
    "Describe the image in detail, then list three objects you can see.",
)


def _filler_token(i: int) -> str:
    # "Ġ" is the byte-level symbol for a space, so fillers decode to " fill<i>".
    return f"Ġfill{i}"


def build_bpe_tokenizer(
    special_tokens: list[str],
    *,
    vocab_size: int = 400,
    bos: str = "<s>",
    eos: str = "</s>",
    pad: str = "<pad>",
    unk: str = "<unk>",
    extra_special_tokens: dict[str, str] | None = None,
) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE on the built-in corpus, Llama-style (BOS prepended).

    Ids: unk=0, bos=1, eos=2, then the 256 byte symbols and the merges, up to ``vocab_size`` base
    tokens (if the corpus runs out of merges, unreachable filler tokens "Ġfill<i>" pad the base
    vocab to exactly ``vocab_size``). After the base vocab come ``special_tokens`` in order, then
    the tokens of ``extra_special_tokens`` not yet present, then ``pad`` — so with
    ``special_tokens=["<image>"]`` the layout matches llava-hf (image = vocab_size, pad = vocab_size + 1).
    """
    base_specials = [unk, bos, eos]
    if vocab_size < 256 + len(base_specials):
        raise ValueError(f"vocab_size must be >= {256 + len(base_specials)}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=base_specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS), trainer=trainer)

    if tok.get_vocab_size(with_added_tokens=True) < vocab_size:
        tok = _pad_vocab(tok, vocab_size)

    added: list[str] = []
    for t in [*special_tokens, *(extra_special_tokens or {}).values(), pad]:
        if t not in added and t not in base_specials:
            added.append(t)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])

    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, bos_id)],
    )
    extra = dict(extra_special_tokens or {})
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        unk_token=unk,
        extra_special_tokens=extra if extra else [t for t in special_tokens if t != pad],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def bpe_token_ids(vocab_size: int, after: tuple[str, ...]) -> dict[str, int]:
    """Ids of :func:`build_bpe_tokenizer`'s layout by name: unk, bos, eos = 0, 1, 2, then the tokens
    named ``after``, in order, from ``vocab_size`` on."""
    return {"unk": 0, "bos": 1, "eos": 2, **{name: vocab_size + i for i, name in enumerate(after)}}


def _pad_vocab(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Append unreachable filler entries to the BPE vocab (no merges produce them)."""
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    n = len(vocab)
    i = 0
    while n < vocab_size:
        name = _filler_token(i)
        if name not in vocab:
            vocab[name] = n
            n += 1
        i += 1
    return Tokenizer.from_str(json.dumps(spec))
