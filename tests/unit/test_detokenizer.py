"""IncrementalDetokenizer on a tiny byte-level BPE: equality with full decode, no split-char U+FFFD, stops."""

from __future__ import annotations

import random

import pytest

from mmserve.engine.detokenizer import IncrementalDetokenizer
from mmserve.sampling_params import SamplingParams
from mmserve.testing.tokenizer import build_bpe_tokenizer

MULTI_BYTE = "Hello café! 日本語 is fun 🎉🙂 Привет naïve 東京"


@pytest.fixture(scope="module")
def tok():
    return build_bpe_tokenizer(["<image>"])


def _byte_symbols() -> dict[int, str]:
    """GPT-2 byte-level alphabet: byte value -> the printable char standing for it in the vocab."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_SYMBOLS = _byte_symbols()


def chunked_ids(tok, text: str, rng: random.Random | None = None) -> list[int]:
    """Ids for `text` split at arbitrary byte boundaries: chunks of 1-4 bytes when in the vocab, else bytes."""
    vocab = tok.get_vocab()
    data = text.encode("utf-8")
    ids, i = [], 0
    while i < len(data):
        n = rng.randint(1, 4) if rng else 1
        piece = "".join(BYTE_SYMBOLS[b] for b in data[i : i + n])
        if n > 1 and piece in vocab:
            ids.append(vocab[piece])
            i += n
        else:
            ids.append(vocab[BYTE_SYMBOLS[data[i]]])
            i += 1
    return ids


def stream(
    tok, ids: list[int], params: SamplingParams, flush: bool = True
) -> tuple[IncrementalDetokenizer, list[str]]:
    """Push ids until a stop matches; checks that `.text` only grows, by exactly the returned deltas."""
    det = IncrementalDetokenizer(tok, [1, 5, 6], params)
    deltas: list[str] = []
    for t in ids:
        before = det.text
        deltas.append(det.push(t))
        assert det.text == before + deltas[-1]
        if det.check_stop() is not None:
            return det, deltas
    if flush:
        before = det.text
        deltas.append(det.flush())
        assert det.text == before + deltas[-1]
    return det, deltas


def test_split_characters_really_happen(tok):
    ids = tok.encode(MULTI_BYTE, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    assert tok.decode(chunked_ids(tok, MULTI_BYTE)) == MULTI_BYTE


@pytest.mark.parametrize("skip_special", [True, False])
def test_matches_full_decode_for_random_ids(tok, skip_special: bool):
    rng = random.Random(0)
    vocab = len(tok)
    params = SamplingParams(skip_special_tokens=skip_special)
    for _ in range(150):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        det, deltas = stream(tok, ids, params)
        expected = tok.decode(ids, skip_special_tokens=skip_special)
        assert det.text == "".join(deltas) == expected
        assert det.check_stop() is None and det.finished


@pytest.mark.parametrize("skip_special", [True, False])
def test_extend_then_flush_gives_the_streamed_text(tok, skip_special: bool):
    """The engine's offline batches (no streaming, no stop strings) add ids without decoding them and decode once
    at the end: the same text as one push per id."""
    rng = random.Random(5)
    params = SamplingParams(skip_special_tokens=skip_special)
    for _ in range(100):
        ids = chunked_ids(tok, MULTI_BYTE, rng)[: rng.randint(1, 40)] + [rng.randrange(len(tok))]
        det = IncrementalDetokenizer(tok, [], params)
        det.push(ids[0])
        det.extend(ids[1:])
        det.flush()
        assert (
            det.text
            == stream(tok, ids, params)[0].text
            == tok.decode(ids, skip_special_tokens=skip_special)
        )
    with pytest.raises(RuntimeError):
        IncrementalDetokenizer(tok, [], SamplingParams(stop=["x"])).extend([1])


def test_no_replacement_char_in_deltas_for_split_characters(tok):
    rng = random.Random(1)
    texts = [MULTI_BYTE, "日本語", "🎉🙂🚀", "café crème brûlée", "Καλημέρα 日本 🙂 ok"]
    held_somewhere = False
    for text in texts:
        for variant in range(6):
            if variant == 0:
                ids = tok.encode(text, add_special_tokens=False)
            else:
                ids = chunked_ids(tok, text, rng if variant > 1 else None)
            det, deltas = stream(tok, ids, SamplingParams())
            assert all("\ufffd" not in d for d in deltas), deltas
            assert "".join(deltas) == det.text == text
            held_somewhere |= "" in deltas[:-1]
    assert held_somewhere


def test_special_tokens_between_split_bytes(tok):
    data = "日".encode()
    vocab = tok.get_vocab()
    ids = [
        vocab[BYTE_SYMBOLS[data[0]]],
        tok.eos_token_id,
        vocab[BYTE_SYMBOLS[data[1]]],
        vocab[BYTE_SYMBOLS[data[2]]],
    ]
    det, deltas = stream(tok, ids, SamplingParams())
    assert det.text == tok.decode(ids, skip_special_tokens=True) == "日"
    assert all("\ufffd" not in d for d in deltas)


def test_decode_window_stays_small(tok):
    calls: list[int] = []

    class Spy:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tok.decode(ids, **kwargs)

    text = MULTI_BYTE * 8
    ids = chunked_ids(tok, text, random.Random(2))
    det, _ = stream(Spy(), ids, SamplingParams())
    assert det.text == text and len(ids) > 200
    assert max(calls) <= 8


def test_dangling_bytes_released_by_flush(tok):
    vocab = tok.get_vocab()
    ids = chunked_ids(tok, "ok ") + [vocab[BYTE_SYMBOLS["日".encode()[0]]]]
    det, deltas = stream(tok, ids, SamplingParams(), flush=False)
    assert det.text == "ok "
    assert det.flush() == "\ufffd"
    assert det.text == tok.decode(ids)


@pytest.mark.parametrize("chunk_seed", [None, 3, 4])
def test_stop_string_spanning_tokens(tok, chunk_seed):
    text = "Hello world! 日本語 is fun"
    ids = chunked_ids(tok, text, random.Random(chunk_seed) if chunk_seed is not None else None)
    det, deltas = stream(tok, ids, SamplingParams(stop=["zzz", "d! 日本"]))
    assert det.check_stop() == "d! 日本"
    assert det.text == "".join(deltas) == "Hello worl"
    with pytest.raises(RuntimeError):
        det.push(ids[-1])
    assert det.flush() == ""


def test_stop_string_in_encoded_tokens(tok):
    text = "Hello world! Hello again, world."
    ids = tok.encode(text, add_special_tokens=False)
    det, _ = stream(tok, ids, SamplingParams(stop=["again"]))
    assert det.check_stop() == "again" and det.text == "Hello world! Hello "


def test_include_stop_str_in_output(tok):
    ids = chunked_ids(tok, "Hello world! 日本語 is fun", random.Random(5))
    det, deltas = stream(
        tok, ids, SamplingParams(stop=["d! 日本"], include_stop_str_in_output=True)
    )
    assert det.check_stop() == "d! 日本"
    assert det.text == "".join(deltas) == "Hello world! 日本"


def test_partial_stop_held_back_then_ruled_out(tok):
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["abc"]))
    got = [det.push(t) for t in chunked_ids(tok, "xab")]
    assert det.text == "x" and "".join(got) == "x"
    assert det.push(chunked_ids(tok, "d")[0]) == "abd"
    assert det.text == "xabd" and det.check_stop() is None


def test_partial_stop_released_by_flush(tok):
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["abc", "日本語"]))
    for t in chunked_ids(tok, "x日本a"):
        det.push(t)
    assert det.text == "x日本"  # "日本" was ruled out by "a", "a" may still start "abc"
    assert det.flush() == "a" and det.text == "x日本a" and det.finished


def test_overlapping_stop_prefix(tok):
    det, deltas = stream(tok, chunked_ids(tok, "ababc tail"), SamplingParams(stop=["abc"]))
    assert det.check_stop() == "abc" and det.text == "".join(deltas) == "ab"


def test_earliest_ending_stop_wins_independent_of_tokenization(tok):
    params = SamplingParams(stop=["ell", "Hello"])
    whole = tok.encode("Hello", add_special_tokens=False)
    assert len(whole) == 1
    for ids in (whole, chunked_ids(tok, "Hello")):
        det, _ = stream(tok, ids, params)
        assert det.check_stop() == "ell" and det.text == "H"


def test_rust_decode_shortcut_only_without_space_cleanup(tok):
    from mmserve.engine.detokenizer import _fast_decode

    ids = chunked_ids(tok, "café 日本 x , y .")
    fast = _fast_decode(tok)
    assert (
        fast == tok._tokenizer.decode
    )  # the test tokenizer has no clean-up: the Rust decode is used
    assert fast(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    tok.clean_up_tokenization_spaces = True
    try:
        assert _fast_decode(tok) == tok.decode  # clean-up rewrites spaces: keep the wrapper
    finally:
        tok.clean_up_tokenization_spaces = False
