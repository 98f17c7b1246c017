"""Train a learnable relative-position bias through flex_attention.

A student attention layer has one learnable bias per (head, distance) pair, read by its score_mod:
``score + bias[h, q_idx - kv_idx]``. It learns to reproduce the outputs of a teacher that adds a
fixed bias (ALiBi-like: a per-head slope times the distance) under a causal mask. The loss falls and
the bias receives gradients, on every backend: the blockwise PyTorch backward on a CPU, the fused
Triton backward kernels on a GPU (the score_mod's gradient, including the bias's, is generated from
the mod).

    python examples/train_learnable_bias.py                 # CPU: a few seconds
    python examples/train_learnable_bias.py --device cuda --seq 1024 --steps 100

Exits with status 1 if the loss did not fall by half or the bias received no gradient.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from flexattn import create_block_mask, flex_attention


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class RelativeBiasAttention(nn.Module):
    """Attention with a learnable bias per head and distance (T5-style, without buckets:
    ``flexattn.variants`` has the bucketed one)."""

    def __init__(self, heads: int, max_len: int):
        super().__init__()
        self.max_len = max_len
        # bias[h, max_len - 1 + d] is the bias at distance d = q_idx - kv_idx, d in (-max_len, max_len).
        self.bias = nn.Parameter(torch.zeros(heads, 2 * max_len - 1))

    def score_mod(self, score, b, h, q_idx, kv_idx):
        # self.bias is a captured tensor: read by the kernel on every call (so each optimizer step's
        # values are used without a new trace), and it receives its gradient.
        return score + self.bias[h, q_idx - kv_idx + self.max_len - 1]

    def forward(self, q, k, v, block_mask):
        return flex_attention(q, k, v, score_mod=self.score_mod, block_mask=block_mask)


def teacher_score_mod(slopes: torch.Tensor):
    def linear_distance_bias(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    return linear_distance_bias


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.seq < 2 or args.steps < 1:
        parser.error("--seq must be at least 2 and --steps at least 1")

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    B, H, L, D = args.batch, args.heads, args.seq, args.head_dim
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    block_mask = create_block_mask(causal, None, None, L, L, device=device)  # built once, reused every step

    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, dtype=torch.float32, device=device) / H)
    teacher = teacher_score_mod(slopes)
    student = RelativeBiasAttention(H, L).to(device)
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr)

    print(f"device {device}, dtype {dtype}, B={B} H={H} L={L} D={D}, {args.steps} steps")
    start = time.perf_counter()
    losses = []
    grad_norm = 0.0
    for step in range(args.steps):
        q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype) for _ in range(3))
        with torch.no_grad():
            target = flex_attention(q, k, v, score_mod=teacher, block_mask=block_mask)
        out = student(q, k, v, block_mask)
        loss = (out.float() - target.float()).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = student.bias.grad.norm().item()
        optimizer.step()
        losses.append(loss.item())
        if step % max(1, args.steps // 8) == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {loss.item():.3e}  |d loss / d bias| {grad_norm:.3e}")
    elapsed = time.perf_counter() - start

    # What was learned: head 0's bias at distances 0..3 relative to distance 0 (a softmax ignores a
    # constant added to every score of a row, so only differences can be learned), next to the teacher's.
    learned = student.bias.detach()[0, L - 1:L + 3].float().cpu()
    learned = learned - learned[0]
    truth = -slopes[0].cpu() * torch.arange(4)
    print(f"head 0, bias at distances 0..3 minus the bias at 0: learned {[round(x, 3) for x in learned.tolist()]}, "
          f"teacher {[round(x, 3) for x in truth.tolist()]}")
    print(f"loss {losses[0]:.3e} -> {losses[-1]:.3e} in {elapsed:.1f} s")

    if not losses[-1] < 0.5 * losses[0]:
        print("FAILED: the loss did not fall by half", file=sys.stderr)
        return 1
    if not grad_norm > 0:
        print("FAILED: the bias received no gradient", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
