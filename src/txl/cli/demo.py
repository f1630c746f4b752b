"""`txl demo`: a tiny forward/backward pass, to check an install works."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a tiny forward/backward pass over two segments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    import txl

    torch.manual_seed(0)
    config = txl.ModelConfig(vocab_size=256, n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=128,
                             mem_len=16)
    model = txl.TransformerXL(config)
    tokens = torch.randint(0, 256, (2, 33))
    memory = None
    for start in (0, 16):
        out = model(tokens[:, start:start + 16], labels=tokens[:, start + 1:start + 17], memory=memory)
        out.loss.backward()
        memory = out.memory
        print(f"segment at {start}: loss {out.loss.item():.3f}, memory {tuple(memory[0].shape)}")
    return 0
