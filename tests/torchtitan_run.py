"""Train torchtitan's llama3 debug model with one attention path and write its loss curve.

    python tests/torchtitan_run.py --attention flexattn --world 2 --cp 2 --cpu --out losses.json

writes ``{"losses": {dtype: {attention: [loss of each step]}}, ...}``.

Run by tests/test_torchtitan.py (CPU, gloo) and tests/test_gpu_torchtitan.py (one GPU), one
process per rank, with torchtitan's own Trainer (or flexattn's, from ``use_flexattn``). What differs
between runs is the attention of every layer:

* ``torchtitan``: torchtitan's own FlexAttention (torch's compiled flex_attention). torch 2.13
  refuses its backward on a CPU ("FlexAttention does not support backward on CPU"), so with
  ``--cpu`` it only gives the first batch's loss.
* ``flexattn``: ``use_flexattn(config)``, so flexattn.flex_attention, and with ``--cp 2`` its
  context parallelism (flexattn.distributed).
* ``dense``: torch's SDPA with the BlockMask's mask written out in full, every (query, key) pair:
  what FlexAttention computes, by another route (the CPU stand-in for torchtitan's path).
  ``dense64`` does the attention in float64 and rounds its output to float32: the golden run.

The data: packed documents of random lengths drawn from a fixed bigram chain (each token picks one
of four successors), so the loss falls within a few dozen steps and the document mask matters.

On a CPU, torchtitan 0.3's Trainer needs an accelerator: with none it takes "cuda" as the device
type. ``--cpu`` shows it the CPU under torch's device-module interface before torchtitan is
imported (torch._utils' two lookups, nothing of torchtitan's), so its Trainer runs unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch


def _show_torchtitan_the_cpu() -> None:
    """torchtitan picks its device type and module once, at import, from torch._utils."""

    class _Properties:
        total_memory = 1  # bytes: memory percentages are not measured on the CPU
        name = "cpu"

    cpu = types.SimpleNamespace(
        set_device=lambda device: None, current_device=lambda: 0, device_count=lambda: 1,
        get_device_name=lambda device=None: "cpu", get_device_properties=lambda device=None: _Properties(),
        reset_peak_memory_stats=lambda *args: None, empty_cache=lambda: None, memory_stats=lambda *args: {},
        synchronize=lambda *args: None, is_available=lambda: True,
    )
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type: cpu


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention", nargs="+", required=True,
                        choices=["torchtitan", "flexattn", "dense", "dense64", "torchtitan+graphs", "flexattn+graphs"],
                        help="one run after another, in the same processes; +graphs: with torchtitan's CUDA graphs")
    parser.add_argument("--world", type=int, default=1, help="processes (ranks) to start")
    parser.add_argument("--cp", type=int, default=1, help="context_parallel_degree")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2, help="of the debug model's 6")
    parser.add_argument("--block-size", type=int, default=128, help="the BlockMask's")
    parser.add_argument("--balance", default="mask", help="flexattn's cp_balance")
    parser.add_argument("--schedule", default="auto", help="flexattn's cp_schedule")
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"],
                        help="FSDP's mixed_precision_param, the layers' compute dtype: every attention runs in each")
    parser.add_argument("--backend", default="spmd_types", help="parallelism.spmd_backend")
    parser.add_argument("--forward-only", action="store_true", help="the first batch's loss, no training")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--no-autotune", action="store_true",
                        help="torchtitan's flex_attention compiled without max_autotune (faster to start)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cp > 1 and any(a.startswith("dense") for a in args.attention):
        parser.error("the dense paths read the whole sequence's mask: they run on one rank only")
    return args


def _spawn(args: argparse.Namespace) -> int:
    """One process per rank, as torchrun would start them (torchtitan reads the same variables)."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(args.world),
               "LOCAL_WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if args.cpu and "OMP_NUM_THREADS" not in os.environ:  # the ranks share the cores
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.world))
        procs.append(subprocess.Popen([sys.executable, *sys.argv, "--rank", str(rank)], env=env))
    return max(p.wait() for p in procs)


def main() -> None:
    args = _parse()
    if args.rank is None:
        sys.exit(_spawn(args))
    if args.cpu:
        _show_torchtitan_the_cpu()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    calls = _context_parallel_calls()
    curves = {dtype: {attention: _train(args, attention, dtype) for attention in args.attention}
              for dtype in args.dtype}
    if int(os.environ["RANK"]) == 0:
        args.out.write_text(json.dumps({"losses": curves, "world": args.world, "cp": args.cp,
                                        "context_parallel_calls": calls}))
    torch.distributed.destroy_process_group()


def _context_parallel_calls() -> list:
    """The (schedule, steps, head chunks) of every ContextParallel.flex_attention call of this rank, from the
    flexattn.distributed logger's debug records."""
    import logging

    calls = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.msg.startswith("rank %d: schedule"):
                calls.append(list(record.args[1:]))

    logger = logging.getLogger("flexattn.distributed")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Recorder())
    return calls


def _train(args: argparse.Namespace, run: str, dtype: str) -> list:
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.protocols.module import Module

    class BigramTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            vocab_size: int = 2048

        def __init__(self, config: Config, **kwargs) -> None:
            super().__init__()
            self.vocab_size = config.vocab_size

        def encode(self, *args, **kwargs) -> list[int]:
            raise NotImplementedError("the bigram data is made of token ids")

        def decode(self, *args, **kwargs) -> str:
            raise NotImplementedError("the bigram data is made of token ids")

        def get_vocab_size(self) -> int:
            return self.vocab_size

    class BigramDocuments(BaseDataLoader):
        """Packed documents (16 to 96 tokens) of a bigram chain: every rank draws the same batches."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            seed: int = 0

        def __init__(self, config: Config, *, tokenizer, seq_len: int, local_batch_size: int, **kwargs) -> None:
            self.seed, self.seq_len, self.batch = config.seed, seq_len, local_batch_size
            self.vocab = tokenizer.get_vocab_size()

        def __iter__(self):
            generator = torch.Generator().manual_seed(self.seed)
            while True:
                tokens = torch.empty(self.batch, self.seq_len + 1, dtype=torch.long)
                positions = torch.empty(self.batch, self.seq_len + 1, dtype=torch.long)
                for row in range(self.batch):
                    start = 0
                    while start < self.seq_len + 1:
                        length = min(int(torch.randint(16, 97, (), generator=generator)), self.seq_len + 1 - start)
                        steps = torch.randint(1, 5, (length,), generator=generator)
                        steps[0] = torch.randint(0, self.vocab, (), generator=generator)
                        tokens[row, start:start + length] = (steps.cumsum(0) * 7) % self.vocab
                        positions[row, start:start + length] = torch.arange(length)
                        start += length
                yield {"input": tokens[:, :-1], "positions": positions[:, :-1]}, tokens[:, 1:]

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict) -> None:
            pass

    class DenseAttention(Module):
        """SDPA with the BlockMask's mask_mod evaluated at every pair (float64 inside for dense64)."""

        @dataclass(kw_only=True, slots=True)
        class Config(FlexAttention.Config):
            float64: bool = False

        def __init__(self, config: Config) -> None:
            super().__init__()
            self.float64 = config.float64

        def forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks, scale=None, enable_gqa=False, **kwargs):
            B, L = q_BLNH.shape[:2]
            keep = create_mask(attention_masks.mask_mod, B, None, L, k_BLNH.shape[1], device=q_BLNH.device)
            dtype = torch.float64 if self.float64 else q_BLNH.dtype
            q, k, v = (t.transpose(1, 2).to(dtype) for t in (q_BLNH, k_BLNH, v_BLNH))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=enable_gqa)
            return out.to(q_BLNH.dtype).transpose(1, 2)

    config = llama3_debugmodel()
    model = config.model_spec.model
    model.layers = model.layers[:args.layers]
    for _, attention, _, _ in model.traverse(FlexAttention.Config):
        attention.block_size = args.block_size
    config.tokenizer = BigramTokenizer.Config(vocab_size=model.vocab_size)
    config.dataloader = BigramDocuments.Config()
    config.training.seq_len, config.training.local_batch_size = args.seq_len, args.batch
    config.training.steps = args.steps
    config.training.mixed_precision_param = dtype
    attention_path, _, graphs = run.partition("+")
    config.training.disable_cuda_graphs = not graphs
    config.parallelism.context_parallel_degree = args.cp
    config.parallelism.spmd_backend = args.backend
    config.checkpoint.enable = False
    config.validator.enable = False
    config.dump_folder = str(args.out.parent / f"{args.out.stem}_dump")
    config.lr_scheduler.warmup_steps = 2

    if attention_path == "flexattn":
        from flexattn.integrations.torchtitan import use_flexattn

        config = use_flexattn(config, cp_balance=args.balance, cp_schedule=args.schedule)
    elif attention_path.startswith("dense"):
        for _, attention, parent, slot in list(model.traverse(FlexAttention.Config)):
            setattr(parent, slot, DenseAttention.Config(block_size=attention.block_size,
                                                        float64=attention_path == "dense64"))

    if args.no_autotune:  # what torchtitan's FlexAttention.inductor_configs advises once tiles are known
        from torch.nn.attention.flex_attention import flex_attention

        FlexAttention._compiled_flex_attn = torch.compile(flex_attention)
    trainer = config.build()
    if args.cpu:
        _sum_gradients_on_gloo(trainer)
    _same_initial_weights(trainer)
    if args.forward_only or (args.cpu and attention_path == "torchtitan"):
        losses = [_first_loss(trainer)]
    else:
        losses = _train_steps(trainer, args.steps)
    trainer.close()
    return losses


def _sum_gradients_on_gloo(trainer) -> None:
    """torchtitan turns FSDP's gradient division off (it divides by the global token count
    itself), and FSDP then reduce-scatters with ReduceOp.PREMUL_SUM(1.0), which gloo does not
    have; a plain sum is the same reduction."""
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def _same_initial_weights(trainer) -> None:
    """The weights of the model built whole on the CPU from seed 0, loaded into the trainer's
    (sharded or not): every run starts from the same point, whatever its attention or rank count.
    torchtitan seeds nothing by default, and its initialisation of sharded parameters draws
    differently on a CPU mesh (DTensor's random ops are not fully supported there, as it warns)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.manual_seed(0)
    whole = trainer.model_config.build()
    with torch.no_grad():
        whole.init_weights()
    values = dict(whole.named_parameters())
    with torch.no_grad():
        for part in trainer.model_parts:
            for name, param in part.named_parameters():
                value = values[name.replace("_checkpoint_wrapped_module.", "")].to(param.device)
                if isinstance(param, DTensor):
                    value = distribute_tensor(value, param.device_mesh, param.placements)
                param.copy_(value)


def _train_steps(trainer, steps: int) -> list:
    """torchtitan's training loop without its extras (checkpoints, validation, profiler), and each
    step's loss over all ranks. Trainer.train of torchtitan 0.3.0 calls torch.distributed.set_timeout
    after the first step, which torch 2.13.0 does not have (torchtitan is tested on torch's nightly
    builds); its logged loss under spmd_backend="full_dtensor" counts a replicated loss once per rank."""
    from torch.distributed.tensor import DTensor

    losses = []
    step_loss = trainer.forward_backward_step

    def recorded(**kwargs):
        loss = step_loss(**kwargs)
        losses.append(loss.detach().clone())
        return loss

    trainer.forward_backward_step = recorded
    data = trainer.batch_generator(trainer.dataloader)
    for _ in range(steps):
        trainer.step += 1
        trainer.train_step(data)
    whole = []
    for loss in losses:  # each rank's sum over its tokens / all tokens
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        else:
            torch.distributed.all_reduce(loss)
        whole.append(float(loss))
    return whole


def _first_loss(trainer) -> float:
    """The loss of the first batch at the initial weights, as the first training step computes it."""
    input_dict, labels = next(iter(trainer.dataloader))
    input_dict = {key: value.to(trainer.device) for key, value in input_dict.items()}
    labels = labels.to(trainer.device)
    with torch.no_grad():
        inputs, labels, extra_kwargs = trainer.post_dataloading_process(input_dict, labels)
        pred = trainer.model_parts[0](inputs, **extra_kwargs)
        loss, _ = trainer.loss_fn(pred, labels, (labels != -100).sum())
    return float(loss)


if __name__ == "__main__":
    main()
