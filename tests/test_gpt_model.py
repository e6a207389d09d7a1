"""The example GPT's data: the corpus as token ids, the same on every path."""

from __future__ import annotations

import torch

from transom.workloads.gpt_model import encode, make_corpus


def lookup(text: str, chars: list[str]) -> torch.Tensor:
    stoi = {c: i for i, c in enumerate(chars)}
    return torch.tensor([stoi[c] for c in text], dtype=torch.long)


def test_the_corpus_is_encoded_as_each_characters_place_by_the_byte_path_and_any_text_too():
    text = make_corpus()
    chars = sorted(set(text))
    ids = encode(text, chars)
    assert ids.dtype == torch.long and torch.equal(ids, lookup(text, chars))
    other = "héllo wörld"  # not ASCII: a lookup per character
    assert torch.equal(encode(other, sorted(set(other))), lookup(other, sorted(set(other))))
