import os

# A forked worker (tests/test_distributed.py) can spin forever in MKL's fast allocator once the
# parent process has used it; the plain allocator avoids that. Must be set before torch loads.
os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread: the test models are tiny, so a second thread buys little, and on a shared
# machine a thread waiting for a descheduled core stalls every small op (on 2 cores beside two
# CPU-bound jobs, 100 steps of a tiny BERT fine-tune took 47 s with two threads, 0.8 s with one).
torch.set_num_threads(1)


@pytest.fixture
def float64_deberta_layernorm(monkeypatch):
    """transformers' DeBERTa v1 LayerNorm casts to float32 internally, so a float64 model is
    only float32-exact through it. For the ≤ 1e-9 symmetry checks we run it in the input
    dtype — the same formula, without the cast."""
    from transformers.models.deberta import modeling_deberta

    def forward(self, hidden_states):
        mean = hidden_states.mean(-1, keepdim=True)
        variance = (hidden_states - mean).pow(2).mean(-1, keepdim=True)
        normed = (hidden_states - mean) / torch.sqrt(variance + self.variance_epsilon)
        return self.weight * normed + self.bias

    monkeypatch.setattr(modeling_deberta.DebertaLayerNorm, "forward", forward)
