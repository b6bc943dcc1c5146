"""Tiny deterministic tokenizers for random test checkpoints, built offline from a fixed corpus.

:func:`build_bpe_tokenizer` trains the small byte-level BPE (the same vocab every time, no model hub);
:func:`relaid_bpe_spec` and :func:`templated_tokenizer` re-lay it for other special-token layouts (T5's,
XLM-R's); :func:`token_block` lays out a block of named special tokens; :func:`build_t5_tokenizer` is a T5-style
Unigram tokenizer whose pieces are counted from the same corpus.
"""

from __future__ import annotations

import json
import math
import string
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

if TYPE_CHECKING:
    from transformers import T5Tokenizer

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


def relaid_bpe_spec(vocab_size: int, specials: Sequence[str]) -> dict[str, Any]:
    """The tokenizers JSON of the small BPE in another special-token layout: ``specials`` at ids 0.. in place of
    its <unk>, <s>, </s> (0..2), its other tokens right after them, ``vocab_size`` entries in all (unreachable
    fillers pad it); no added tokens and no post-processor."""
    shift = len(specials) - 3
    tok = build_bpe_tokenizer([], vocab_size=vocab_size - shift)
    spec = json.loads(tok.backend_tokenizer.to_str())
    old: dict[str, int] = spec["model"]["vocab"]
    assert len(old) == vocab_size - shift, (len(old), vocab_size - shift)
    assert [old[t] for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2], old
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({t: i + shift for t, i in sorted(old.items(), key=lambda kv: kv[1]) if i >= 3})
    assert sorted(vocab.values()) == list(range(vocab_size))
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = []
    spec["post_processor"] = None
    return spec


def templated_tokenizer(
    spec: dict[str, Any],
    specials: Sequence[str],
    single: str,
    pair: str,
    template_tokens: Sequence[str],
    **tokens: str,
) -> PreTrainedTokenizerFast:
    """A PreTrainedTokenizerFast (padding on the right) over the tokenizers JSON ``spec`` with ``specials`` added
    as special tokens and the ``single`` / ``pair`` templates over ``template_tokens`` as its post-processor;
    ``tokens`` are its roles (``eos_token="</s>"``, ...)."""
    backend = Tokenizer.from_str(json.dumps(spec))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.post_processor = processors.TemplateProcessing(
        single=single,
        pair=pair,
        special_tokens=[(t, backend.token_to_id(t)) for t in template_tokens],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        **tokens,
    )


def token_block(named: dict[int, str], length: int, reserved: str) -> list[str]:
    """``length`` tokens by offset: ``named[offset]`` where it names one, else ``reserved.format(i)`` with ``i``
    counting the gaps from 0 (the reserved special tokens of Llama 3 and Fuyu)."""
    tokens, gaps = [], 0
    for offset in range(length):
        if offset in named:
            tokens.append(named[offset])
        else:
            tokens.append(reserved.format(gaps))
            gaps += 1
    return tokens


def named_ids(tokens: Sequence[str], first: int, reserved_prefix: str) -> dict[str, int]:
    """Ids of ``tokens`` numbered from ``first``, but for the reserved ones (names starting ``reserved_prefix``)."""
    return {t: first + i for i, t in enumerate(tokens) if not t.startswith(reserved_prefix)}


# What the T5 pieces are drawn from besides the shared corpus: BLIP-2's prompt style, and every ASCII letter, digit
# and the common punctuation (so only rarer characters become <unk>, as with the real spiece model)
T5_EXTRA_TEXT: tuple[str, ...] = (
    "Question: what is this? Answer: a photo of a cat.",
    "Question: which city is this? Answer: Paris.",
    "Question: how many people are in the picture? Answer: two.",
    "a photography of a dog sitting on a bench in the park",
    string.ascii_letters,
    string.digits,
    "!\"#$%&'()*+,-./:;=?@[]_",
)
T5_SPECIALS = ("<pad>", "</s>", "<unk>")
_MAX_PIECE = 12  # longest piece, in characters


def t5_vocab(text_vocab: int, extra_ids: int) -> list[tuple[str, float]]:
    """The Unigram (piece, score) list of a T5 tokenizer of ``text_vocab`` spiece entries plus ``extra_ids``
    sentinels, computed deterministically (no trainer: the tokenizers Unigram trainer is not bit-reproducible).

    Layout as T5's: ``<pad>``, ``</s>``, ``<unk>`` (score 0), then pieces by descending score, then
    ``<extra_id_{extra_ids-1}>`` .. ``<extra_id_0>``. The pieces are every character of the corpus (the shared
    corpus and :data:`T5_EXTRA_TEXT`, split on whitespace with "▁" before each word, as T5's pre-tokenizer does)
    and its most useful substrings (up to :data:`_MAX_PIECE` characters, ranked by count x (length - 1)); a piece's
    score is the log of its share of all substring counts, so Viterbi prefers long frequent pieces. When the corpus
    runs out, "▁fill<i>" pieces at a score below every other pad the vocab (never chosen over real pieces).
    """
    words = ["▁" + w for line in (*CORPUS, *T5_EXTRA_TEXT) for w in line.split()]
    counts: Counter[str] = Counter()
    for w in words:
        for i in range(len(w)):
            for j in range(i + 1, min(len(w), i + _MAX_PIECE) + 1):
                counts[w[i:j]] += 1
    total = sum(counts.values())
    n = text_vocab - len(T5_SPECIALS)
    chars = sorted((p for p in counts if len(p) == 1), key=lambda p: (-counts[p], p))
    if n < len(chars):
        raise ValueError(
            f"text_vocab must be >= {len(chars) + len(T5_SPECIALS)} for a T5 tokenizer, got {text_vocab}"
        )
    longer = sorted((p for p in counts if len(p) > 1), key=lambda p: (-counts[p] * (len(p) - 1), p))
    chosen = [(p, math.log(counts[p] / total)) for p in chars + longer[: n - len(chars)]]
    chosen.sort(key=lambda ps: (-ps[1], ps[0]))
    floor = chosen[-1][1] - 10.0
    taken = {p for p, _ in chosen}
    i = 0
    while len(chosen) < n:
        if f"▁fill{i}" not in taken:
            chosen.append((f"▁fill{i}", floor))
        i += 1
    sentinels = [(f"<extra_id_{k}>", 0.0) for k in reversed(range(extra_ids))]
    return [(t, 0.0) for t in T5_SPECIALS] + chosen + sentinels


def build_t5_tokenizer(text_vocab: int, extra_ids: int) -> T5Tokenizer:
    """A transformers ``T5Tokenizer`` over :func:`t5_vocab`, with T5's layout and pipeline.

    Unigram, whitespace split + Metaspace "▁", no BOS, ``</s>`` appended to every text; ``<pad>``, ``</s>``,
    ``<unk>`` = 0, 1, 2, the pieces up to ``text_vocab``, then ``extra_ids`` sentinels ``<extra_id_N>`` in reverse
    (``<extra_id_0>`` last) as special tokens. Unlike the real spiece model there is no NFKC normalizer, and
    characters missing from the pieces become ``<unk>`` (no byte fallback, as in T5).
    """
    from transformers import T5Tokenizer

    return T5Tokenizer(vocab=t5_vocab(text_vocab, extra_ids), extra_ids=extra_ids)
