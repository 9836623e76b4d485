"""An RNN language model whose embedding table lives on another worker.

The table sits on worker "ps" behind an RRef; the trainer looks tokens up
through the RRef's proxy, runs the LSTM and decoder locally, and trains all
three with one distributed backward pass and one DistributedOptimizer step.
The task: predict the next token of sequences that count up modulo the
vocabulary size from a random start.

    python examples/rnn_remote_embedding.py        # two local processes
    torchrun --nproc-per-node 2 examples/rnn_remote_embedding.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import ucxrpc as rpc
import ucxrpc.autograd as dist_autograd
from ucxrpc.optim import DistributedOptimizer
from _launch import launch

VOCAB, DIM, HIDDEN = 50, 16, 32
STEPS = 25


class EmbeddingTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(VOCAB, DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens)

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        return [rpc.RRef(p) for p in self.parameters()]


class RNNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.table = rpc.remote("ps", EmbeddingTable)
        self.lstm = nn.LSTM(DIM, HIDDEN, batch_first=True)
        self.decoder = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        embedded = self.table.rpc_sync().forward(tokens)
        out, _ = self.lstm(embedded)
        return self.decoder(out)

    def parameter_rrefs(self) -> list[rpc.RRef[torch.Tensor]]:
        local = [rpc.RRef(p) for p in (*self.lstm.parameters(), *self.decoder.parameters())]
        return self.table.rpc_sync().parameter_rrefs() + local


def batch(gen: torch.Generator) -> torch.Tensor:
    """32 sequences of 12 tokens: start, start + 1, ... modulo VOCAB."""
    start = torch.randint(VOCAB, (32, 1), generator=gen)
    return (start + torch.arange(12)) % VOCAB


def train() -> None:
    model = RNNModel()
    opt = DistributedOptimizer(torch.optim.Adam, model.parameter_rrefs(), lr=0.05)
    gen = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        seq = batch(gen)
        with dist_autograd.context() as context_id:
            logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        print(f"step {step:2d} loss {loss.item():.4f}", flush=True)


def main(rank: int, world_size: int) -> None:
    rpc.init_rpc("trainer" if rank == 0 else "ps", rank=rank, world_size=world_size)
    if rank == 0:
        train()
    rpc.shutdown()


if __name__ == "__main__":
    launch(main, world_size=2)
