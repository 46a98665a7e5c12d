"""The simulated model's tokenizer and its continuable answers: what lets the component tests check a
resumed answer word for word."""

from __future__ import annotations

import pytest

from engines.sim import lm, tokenizer

CHAT_PROMPT = "<|user|>\ntell me a long story\n<|assistant|>\n"


@pytest.mark.parametrize("text", ["", "  ", "hello world", CHAT_PROMPT, " the of and", "naïve café ☃☃☃☃ supercalifragilistic\n"])
def test_detokenize_inverts_tokenize(text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_the_models_words_are_one_token_each_and_text_counts_as_its_words():
    assert len(tokenizer.encode(" the of and")) == 3
    assert tokenizer.count("a short prompt") == 3
    assert tokenizer.count("") == 1


def test_ids_that_split_a_character_decode_to_a_replacement_until_joined():
    ids = tokenizer.encode("abcde☃")  # 8 bytes: two ids, the first ending inside the snowman
    assert len(ids) == 2
    assert tokenizer.decode(ids[:1]) == "abcde\ufffd"
    assert tokenizer.decode(ids) == "abcde☃"


def answer(prompt: str, n: int, salt: str = "") -> list[str]:
    ctx = lm.Context("m", prompt, salt)
    return [ctx.next()[0] for _ in range(n)]


@pytest.mark.parametrize("prompt", [CHAT_PROMPT, "a long story"])
def test_an_answer_asked_again_with_its_first_tokens_in_the_prompt_goes_on_where_it_was(prompt):
    whole = answer(prompt, 40)
    for j in (1, 7, 39):
        assert answer(prompt + "".join(whole[:j]), 40 - j) == whole[j:]


def test_a_chat_answer_starts_without_a_space_and_goes_on_with_them():
    first, *rest = answer(CHAT_PROMPT, 5)
    assert not first.startswith(" ") and all(t.startswith(" ") for t in rest)


def test_the_end_of_an_answer_is_the_texts_too_and_never_before_64_words():
    n = lm.natural_length("m", "a long story")
    assert n >= lm.Context.MIN_RUN
    ctx, text = lm.Context("m", "a long story"), "a long story"
    for _ in range(n - 10):
        text += ctx.next()[0]
    assert lm.natural_length("m", text) == 10, "the continuation ends where the whole answer does"


def test_a_sampled_answer_is_another_draw():
    assert answer("a long story", 20, salt="x") != answer("a long story", 20, salt="y")
