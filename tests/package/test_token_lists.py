"""`upcycle.data.token_lists`: the ids of a fast tokenizer's backend, equal to the tokenizer's own call, with the
call kept wherever the two could differ."""

from __future__ import annotations

import random

import pytest

from upcycle.data.token_lists import CHECKED_TEXTS, token_lists

WORDS = "the a river bank money loan water flows north south east west of to in on at by".split()


def wordpiece():
    from upcycle.data.clip_pairs import caption_tokenizer

    return caption_tokenizer(WORDS, max_length=64)


def texts(n: int = 300) -> list[str]:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS + ["unknownword"]) for _ in range(rng.randint(0, 40))) for _ in range(n)]


class CountingCalls:
    """A tokenizer's proxy that counts the texts its own call encodes."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.texts_called = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, batch, **kwargs):
        self.texts_called += len(batch)
        return self._tokenizer(batch, **kwargs)


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_backend_ids_equal_the_tokenizers_call_and_only_the_checked_texts_take_the_call(side):
    tokenizer = wordpiece()
    tokenizer.truncation_side = side
    given = texts()
    expected = tokenizer(given, truncation=True, max_length=12)["input_ids"]
    assert any(len(ids) == 12 for ids in expected) and any(len(ids) < 12 for ids in expected)   # both cases
    counting = CountingCalls(tokenizer)
    assert token_lists(counting, given, 12) == expected
    assert counting.texts_called == CHECKED_TEXTS


def test_a_tokenizer_whose_call_adds_to_its_backend_keeps_its_call():
    """A subclass that changes the ids in Python: the backend's ids differ on the checked texts, so every text
    goes through the tokenizer's own call."""
    tokenizer = wordpiece()

    class Marked(CountingCalls):
        def __call__(self, batch, **kwargs):
            out = super().__call__(batch, **kwargs)
            return {"input_ids": [[*ids, 0] for ids in out["input_ids"]]}

    marked, given = Marked(tokenizer), texts()
    assert token_lists(marked, given, 12) == [[*ids, 0] for ids in
                                              tokenizer(given, truncation=True, max_length=12)["input_ids"]]
    assert marked.texts_called == len(given)


def test_a_slow_tokenizer_takes_its_call():
    tokenizer = CountingCalls(wordpiece())
    tokenizer.is_fast = False
    given = texts()
    assert token_lists(tokenizer, given, 12) == wordpiece()(given, truncation=True, max_length=12)["input_ids"]
    assert tokenizer.texts_called == len(given)


def test_fewer_texts_than_the_check_and_none():
    tokenizer = wordpiece()
    given = texts(5)
    assert token_lists(tokenizer, given, 12) == tokenizer(given, truncation=True, max_length=12)["input_ids"]
    assert token_lists(tokenizer, [], 12) == []
