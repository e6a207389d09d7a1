"""The tiny GPT-2 and synthetic token data the Hugging Face test scripts and tests train: built
from a config (nothing downloaded), each sample derived from its index alone."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    )


class Tokens(torch.utils.data.Dataset):
    """`length` samples of 16 token ids below 64."""

    def __init__(self, length: int = 256):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}
