"""Held-out perplexity of a run: exp(mean next-token NLL) over the test split packed into blocks, each block
scored on its own (`block_size - 1` predictions per block), with the blocks shared out over the processes."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator
from torch import nn
from tqdm.auto import tqdm

from hf_softmax_rnn.evaluation import next_token_nll


@torch.no_grad()
def heldout_metrics(
    model: nn.Module, blocks: torch.Tensor, accelerator: Accelerator, *, batch_size: int, progress: bool = False
) -> dict:
    """{"eval_loss", "perplexity", "eval_tokens"} of `blocks` `[N, L]`, each block scored on its own.

    Process r scores blocks r, r + P, ...; every process runs the same number of batches
    (short ones padded with a block of weight 0), so a wrapped (DDP/FSDP) model stays in step.
    """
    was_training = model.training
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    rows = torch.arange(rank, len(blocks), world)
    per_process = math.ceil(len(blocks) / world)
    weights = torch.cat([torch.ones(len(rows)), torch.zeros(per_process - len(rows))]).double()
    rows = torch.cat([rows, rows.new_zeros(per_process - len(rows))])
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for start in tqdm(range(0, per_process, batch_size), desc="held-out", leave=False, disable=not progress):
        ids = blocks[rows[start : start + batch_size]].to(accelerator.device)
        weight = weights[start : start + batch_size].to(accelerator.device)
        nll = next_token_nll(model(input_ids=ids, use_cache=False).logits, ids)
        totals += torch.stack([(nll.sum(1) * weight).sum(), weight.sum() * (ids.shape[1] - 1)])
    totals = accelerator.reduce(totals, "sum")
    model.train(was_training)
    loss = (totals[0] / totals[1]).item()
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "eval_tokens": int(totals[1].item())}
