"""Batched sampling: greedy rows are argmax, random rows stay inside top-k / top-p."""

import torch

from services.worker.batch import Sampling
from services.worker.sampler import sample


def test_greedy_rows_take_the_argmax_next_to_random_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [Sampling(), Sampling(temperature=1.0), Sampling(), Sampling(temperature=0.7)]
    tokens = sample(logits, params, torch.Generator().manual_seed(1))
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())


def test_top_k_restricts_support_to_the_k_best():
    logits = torch.linspace(0, 1, 20).repeat(200, 1)
    params = [Sampling(temperature=5.0, top_k=3)] * 200
    tokens = sample(logits, params, torch.Generator().manual_seed(0))
    assert set(tokens) == {17, 18, 19}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(400, 1)
    tokens = sample(
        logits, [Sampling(temperature=1.0, top_p=0.8)] * 400, torch.Generator().manual_seed(0)
    )
    assert set(tokens) == {0, 1}  # 0.5 + 0.3 reaches 0.8; 2 and 3 are cut


def test_tiny_top_p_is_greedy():
    logits = torch.randn(8, 30)
    tokens = sample(logits, [Sampling(temperature=1.0, top_p=1e-6)] * 8)
    assert tokens == logits.argmax(dim=-1).tolist()


def test_sampling_follows_the_softmax_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    n = 3000
    tokens = sample(
        probs.log().repeat(n, 1), [Sampling(temperature=1.0)] * n, torch.Generator().manual_seed(0)
    )
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)
