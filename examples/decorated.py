"""A model class planned and trained through ``@autopar.parallelize``.

    python examples/decorated.py                                   # prints the plan (no distributed run)
    torchrun --nproc-per-node 4 examples/decorated.py --steps 2    # plans once (rank 0), then trains

Under torchrun, constructing ``TinyGPT(...)`` returns the rank's ``autopar.runtime`` Trainer, not a
``TinyGPT``: the first run plans and saves ``decorated_plan.json``, later runs reuse it.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from autopar.models.gpt import GPT, GPTConfig

import autopar
from autopar.report import layout_text

CONFIG = {"layers": 4, "hidden": 128, "heads": 4, "vocab": 512, "seq_len": 64}
GLOBAL_BATCH = 8


@autopar.parallelize(cluster="cpu", gpus=4, global_batch=GLOBAL_BATCH, seq_len=CONFIG["seq_len"],
                     plan="decorated_plan.json")
class TinyGPT(GPT):
    """A small GPT of the zoo, built from keyword arguments as the decorator needs."""

    def __init__(self, layers: int = 4, hidden: int = 128, heads: int = 4, vocab: int = 512, seq_len: int = 64):
        super().__init__(GPTConfig(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq_len=seq_len))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    if not autopar.decorator.in_torchrun():
        plan = TinyGPT.autopar_plan(**CONFIG)
        print(f"plan: {layout_text(plan.layout)}; estimated {plan.estimate['iteration_time_s'] * 1e3:.2f} ms "
              f"per iteration on {plan.num_devices} x {plan.cluster['device']}")
        return
    trainer = TinyGPT(**CONFIG)  # this rank's part of the plan, parallelized
    local = GLOBAL_BATCH // trainer.dp_size
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(1000 * step + trainer.dp_rank)  # each dp rank its own samples
        tokens = torch.randint(0, CONFIG["vocab"], (local, CONFIG["seq_len"]), generator=gen)
        loss = trainer.step((tokens,))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
