"""A torchtitan-style training step: each transformer block compiled on its own (fullgraph), block
masks chosen per layer from a dict built outside the compiled code, and activation checkpointing.

Every block is ``torch.compile(checkpointed(block), fullgraph=True)``, as torchtitan applies them;
the blocks read their BlockMask from a dict of masks made once per batch outside the compiled code:
causal, document (packed sequences: a closure over the batch's document ids, rebuilt each step) and
sliding window, one layer kind each. Three checkpointing modes:

* ``none``: the autograd graph keeps every activation.
* ``full``: ``torch.utils.checkpoint`` (non-reentrant): the backward recomputes the block.
* ``selective``: the backward recomputes the block except the attention, whose output the policy
  saves (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): flexattn's op is
  ``torch.ops.flexattn.flex_attention``, so a policy can name it like any aten op.

    python examples/titan_block.py                         # CPU: tiny sizes, a few seconds
    python examples/titan_block.py --device cuda --seq 4096 --dim 768 --heads 12 --layers 6

Exits with status 1 if a compiled step's loss or gradients differ from the eager model's, or if the
loss did not fall.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from flexattn import create_block_mask, flex_attention

LAYER_KINDS = ("causal", "document", "sliding")


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def document_mask(document_ids: torch.Tensor):
    """Packed sequences: a query sees earlier keys of its own document. Rebuilt each batch over the
    batch's ids: the compiled blocks take the new mask without recompiling."""

    def same_document(b, h, q_idx, kv_idx):
        return (document_ids[b, q_idx] == document_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return same_document


def sliding_window(window: int):
    def within_window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return within_window


def block_masks(document_ids: torch.Tensor, window: int) -> dict:
    """One BlockMask per layer kind, built outside the compiled blocks (once per batch)."""
    B, L = document_ids.shape
    device = document_ids.device
    return {
        "causal": create_block_mask(causal, None, None, L, L, device=device),
        "document": create_block_mask(document_mask(document_ids), B, None, L, L, device=device),
        "sliding": create_block_mask(sliding_window(window), None, None, L, L, device=device),
    }


class Block(nn.Module):
    """Pre-norm attention and MLP; the layer's kind picks its mask from the dict it is given."""

    def __init__(self, dim: int, heads: int, kind: str):
        super().__init__()
        self.heads, self.kind = heads, kind
        self.attention_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.GELU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x: torch.Tensor, masks: dict) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, block_mask=masks[self.kind])
        x = x + self.proj(y.transpose(1, 2).reshape(B, L, D))
        return x + self.mlp(self.mlp_norm(x))


def _save_attention(ctx, op, *args, **kwargs):
    """Selective checkpointing's policy: keep flex_attention's outputs, recompute the rest."""
    if op == torch.ops.flexattn.flex_attention.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """A block under activation checkpointing: ``full`` or ``selective`` (attention outputs saved)."""

    def __init__(self, block: nn.Module, mode: str):
        super().__init__()
        self.block, self.mode = block, mode

    def forward(self, x, masks):
        if self.mode == "full":
            return checkpoint(self.block, x, masks, use_reentrant=False)
        context = functools.partial(create_selective_checkpoint_contexts, _save_attention)
        return checkpoint(self.block, x, masks, use_reentrant=False, context_fn=context)


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, LAYER_KINDS[i % len(LAYER_KINDS)]) for i in range(layers))
        self.norm, self.out = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, masks):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, masks)
        return self.out(self.norm(x))


def apply_compile_and_checkpointing(model: Model, mode: str) -> None:
    """torchtitan's order: checkpoint each block, then compile it on its own, fullgraph."""
    if mode != "none":
        # Under torch.compile, flex_attention runs each mod once on empty probes inside a torch-function
        # mode (how the graph gets the tensors the mod reads; docs/compile.md). Inside a checkpointed
        # region Dynamo counts entering that mode as a side effect to replay in the backward; there is
        # none to replay, so let it pass (Dynamo's error names this setting too).
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for i, block in enumerate(model.layers):
        wrapped = block if mode == "none" else Checkpointed(block, mode)
        model.layers[i] = torch.compile(wrapped, fullgraph=True, backend=_BACKEND)


_BACKEND = "inductor"


def batch(B: int, L: int, vocab: int, device, generator) -> tuple:
    tokens = torch.randint(0, vocab, (B, L), device=device, generator=generator)
    # Documents of random lengths packed into each row: ids 0, 0, ..., 1, 1, ..., 2, ...
    starts = torch.rand(B, L, device=device, generator=generator) < 4.0 / L
    starts[:, 0] = True
    return tokens, torch.cumsum(starts.int(), dim=1) - 1


def loss_of(model, tokens, masks):
    logits = model(tokens, masks)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--checkpointing", choices=("none", "full", "selective"), default="selective")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager compiles faster on a CPU)")
    args = parser.parse_args(argv)
    global _BACKEND
    _BACKEND = args.backend
    vocab = 256
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    model = Model(vocab, args.dim, args.heads, args.layers).to(args.device, dtype)
    eager = Model(vocab, args.dim, args.heads, args.layers).to(args.device, dtype)
    eager.load_state_dict(model.state_dict())
    apply_compile_and_checkpointing(model, args.checkpointing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator(device=args.device).manual_seed(1)
    losses, ok = [], True
    for step in range(args.steps):
        tokens, document_ids = batch(args.batch, args.seq, vocab, args.device, generator)
        masks = block_masks(document_ids, args.window)
        if step == 0:  # the compiled, checkpointed step against the eager model, before any update
            want = loss_of(eager, tokens, masks)
            want.backward()
        loss = loss_of(model, tokens, masks)
        loss.backward()
        if step == 0:
            tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-4
            grads = [(p.grad, q.grad) for p, q in zip(model.parameters(), eager.parameters())]
            worst = max(float((g - w).abs().max() / w.abs().max().clamp_min(1e-12)) for g, w in grads)
            print(f"step 0: loss {loss.item():.5f} (eager {want.item():.5f}), worst gradient error {worst:.2e}")
            ok &= abs(loss.item() - want.item()) <= tolerance * abs(want.item()) and worst <= tolerance
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print(f"checkpointing={args.checkpointing}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")
    ok &= losses[-1] < losses[0]
    if not ok:
        print("FAILED: the compiled step differs from eager, or the loss did not fall", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
