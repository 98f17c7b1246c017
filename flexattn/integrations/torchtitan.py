"""flexattn inside torchtitan: its models' attention, and its context parallelism on flexattn.distributed.

One call turns a torchtitan training config into one that runs on flexattn::

    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from flexattn.integrations.torchtitan import use_flexattn

    config = use_flexattn(llama3_debugmodel())     # any torchtitan Trainer.Config
    trainer = config.build()
    trainer.train()

or, on torchtitan's own command line, every config of ``torchtitan.models`` under its own name::

    torchrun --nproc_per_node 2 -m torchtitan.train --module flexattn.integrations.torchtitan \\
        --config llama3_debugmodel --parallelism.context_parallel_degree 2

``use_flexattn`` swaps every ``FlexAttention.Config`` of the model for :class:`FlexattnAttention`'s
(the model's BlockMasks, score_mods, ``out_transform`` and ``kernel_options`` are passed to
:func:`flexattn.flex_attention` as they were to torch's), and the trainer (and validator) for
:class:`FlexattnTrainer` (:class:`FlexattnValidator`), which, when
``parallelism.context_parallel_degree > 1``, shards each batch with a
:class:`flexattn.distributed.ContextParallel` built from the batch's global BlockMask: the ranks hold
the tokens flexattn's balance deals them (``"mask"``: even full and partial tiles), and each
attention layer runs the ring with mask-aware skipping instead of torch's all-gather of K and V.

The attention alone, with torchtitan's own trainer and no context parallelism, is also one of
torchtitan's overrides: ``--override.imports flexattn.integrations.torchtitan.flexattn_attention``.

Nothing in torchtitan is edited: the attention is a torchtitan ``Module`` whose ``Config``
subclasses ``FlexAttention.Config`` (so torchtitan still builds BlockMasks for it), and the
trainer a ``Trainer`` subclass whose ``post_dataloading_process`` shards the batch. Needs
torchtitan 0.3 (``pip install 'flexattn[torchtitan]'``, Python 3.11 or newer). Context parallelism
runs under ``parallelism.spmd_backend`` "spmd_types" (torchtitan's default) or "full_dtensor",
outside ``torch.compile`` and CUDA graphs. docs/context_parallel.md, section "torchtitan", says
what runs where, what was measured, and what torchtitan 0.3 needs of torch.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

try:
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.components.validate import Validator
    from torchtitan.config.override import derive, override
    from torchtitan.distributed import full_dtensor
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.models.common.attention import FlexAttention
    from torchtitan.models.common.decoder import Decoder
    from torchtitan.protocols.module import Module
    from torchtitan.tools import utils as torchtitan_utils
    from torchtitan.tools.logging import logger
    from torchtitan.trainer import Trainer
except ImportError as err:  # pragma: no cover - the message is the point
    raise ImportError(
        "flexattn.integrations.torchtitan needs torchtitan 0.3 (Python 3.11 or newer): "
        "pip install 'flexattn[torchtitan]'"
    ) from err

from ..api import flex_attention
from ..distributed import ContextParallel
from ..distributed.plan import SCHEDULES
from ..distributed.sharding import BALANCE_MODES
from ..errors import InvalidInputError
from ..options import AuxRequest

__all__ = ["FlexattnAttention", "FlexattnTrainer", "FlexattnValidator", "flexattn_attention", "use_flexattn",
           "shard_batch"]

# ------------------------------------------------------------------------------------ attention


def _flexattn_kernel_options(kernel_options: dict) -> dict:
    """torchtitan's kernel_options as flexattn reads them. Its ``flex_flash`` backend asks torch for
    ``BACKEND="FLASH"`` (FlashAttention's CuTe kernels); flexattn's counterpart is its own fastest
    path, ``"AUTO"`` (the Hopper kernels where they are faster)."""
    if kernel_options.get("BACKEND") == "FLASH":
        return {**kernel_options, "BACKEND": "AUTO"}
    return dict(kernel_options)


class FlexattnAttention(Module):
    """torchtitan's inner attention on :func:`flexattn.flex_attention`, or on
    :meth:`flexattn.distributed.ContextParallel.flex_attention` under context parallelism.

    Takes what torchtitan's ``FlexAttention`` takes (q, k, v as ``[B, L, N, H]``, first, then
    ``attention_masks``, ``score_mod``, ``scale``, ``enable_gqa``, ``out_transform``) and returns
    ``[B, L, N, H]``. ``attention_masks`` is the model's BlockMask (torch's, as torchtitan builds
    it), or, under context parallelism, the ``ContextParallel`` that :func:`shard_batch` made of it.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        cp_balance: str = "mask"
        """How context parallelism deals tokens to ranks: "mask" (even full and partial tiles of
        the batch's mask), "zigzag" (torchtitan's "headtail") or "contiguous". torchtitan's
        ``parallelism.context_parallel_load_balancer`` is not read."""

        cp_schedule: str = "auto"
        """"ring", "allgather" or "auto" (the cost model's choice): flexattn.distributed's schedule."""

        def __post_init__(self):
            if self.cp_balance not in BALANCE_MODES:
                raise InvalidInputError(
                    f"FlexattnAttention: cp_balance must be one of {BALANCE_MODES}, got {self.cp_balance!r}")
            if self.cp_schedule not in SCHEDULES:
                raise InvalidInputError(
                    f"FlexattnAttention: cp_schedule must be one of {SCHEDULES}, got {self.cp_schedule!r}")

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.kernel_options = _flexattn_kernel_options(config.kernel_options)
        self.context_parallel = False  # set by parallelize

    def parallelize(self, parallel_dims) -> None:
        """torchtitan's parallelize, less the all-gather of K and V its sharding config declares
        for context parallelism: the ring brings each rank the K/V shards its queries need."""
        self.context_parallel = parallel_dims.cp_enabled
        if self.context_parallel and self._sharding_config is not None:
            self._sharding_config = _keeping_kv_shards(self._sharding_config)
        super().parallelize(parallel_dims)

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *, attention_masks,
                score_mod: Optional[Callable] = None, scale: Optional[float] = None, enable_gqa: bool = False,
                out_transform: Optional[Callable] = None, **kwargs) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        return_aux = AuxRequest(lse=True) if out_transform is not None else None
        if isinstance(attention_masks, ContextParallel):
            result = attention_masks.flex_attention(q, k, v, score_mod=score_mod, scale=scale, enable_gqa=enable_gqa,
                                                    kernel_options=self.kernel_options, return_aux=return_aux)
        elif self.context_parallel:
            raise InvalidInputError(
                "FlexattnAttention: context parallelism is on but attention_masks is a "
                f"{type(attention_masks).__name__}, not the ContextParallel flexattn shards a batch with: torchtitan's "
                "own trainer (or validator) sharded this batch. Build the config with "
                "flexattn.integrations.torchtitan.use_flexattn(config), or run torchtitan with "
                "--module flexattn.integrations.torchtitan"
            )
        else:
            result = flex_attention(q, k, v, score_mod=score_mod, block_mask=attention_masks, scale=scale,
                                    enable_gqa=enable_gqa, kernel_options=self.kernel_options, return_aux=return_aux)
        if out_transform is None:
            return result.transpose(1, 2)
        out, aux = result
        return out_transform(out.transpose(1, 2), aux.lse.transpose(1, 2))


def _keeping_kv_shards(sharding):
    """``sharding`` (a torchtitan ShardingConfig) with K and V kept where they come from: no
    redistribution across the context-parallel ranks, and their gradients returned as they are."""
    sources = sharding.in_src_shardings or {}
    destinations = dict(sharding.in_dst_shardings or {})
    for name in ("k_BLNH", "v_BLNH"):
        if name in sources:
            destinations[name] = sources[name]
    local_map = sharding.local_map
    if local_map is not None and local_map.in_grad_placements is not None and "q_BLNH" in sources:
        # q, k, v: every gradient has its input's placement.
        grads = list(local_map.in_grad_placements)
        grads[1:3] = [sources.get("k_BLNH", grads[1]), sources.get("v_BLNH", grads[2])]
        local_map = dataclasses.replace(local_map, in_grad_placements=tuple(grads))
    return dataclasses.replace(sharding, in_dst_shardings=destinations, local_map=local_map)


@override(target=FlexAttention.Config, description="flexattn's kernels for torchtitan's FlexAttention")
def flexattn_attention(config: FlexAttention.Config, **fields) -> FlexattnAttention.Config:
    """torchtitan override: ``--override.imports flexattn.integrations.torchtitan.flexattn_attention``
    (fields as JSON: ``'...flexattn_attention={"cp_balance": "zigzag"}'``). Every field of the
    FlexAttention config (block size, kernel_options, sharding) is kept."""
    return derive(config, FlexattnAttention.Config, **fields)


# ------------------------------------------------------------------------------------ sharding


def _attention_config(model_config) -> Optional[FlexattnAttention.Config]:
    """The model's first FlexattnAttention config, or None where the model does not use it."""
    if not isinstance(model_config, Decoder.Config) or model_config.first_attention is None:
        return None
    inner = getattr(model_config.first_attention, "inner_attention", None)
    return inner if isinstance(inner, FlexattnAttention.Config) else None


def _shard_tokens(x: torch.Tensor, layout, rank: int, fill: int) -> torch.Tensor:
    """This rank's part of ``x`` ([B, L]) in ``layout``'s order; padding positions hold ``fill``."""
    pad = layout.padded_length - layout.length
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=fill)
    return x.index_select(1, layout.positions(rank).to(x.device))


def shard_batch(model, inputs: torch.Tensor, labels: torch.Tensor, extra_kwargs: dict, cp_mesh,
                attention: FlexattnAttention.Config) -> tuple[torch.Tensor, torch.Tensor, dict, int]:
    """One batch sharded for context parallelism on flexattn.distributed.

    Builds the model's global attention masks from the global ``extra_kwargs["positions"]`` (as
    torchtitan does), one :class:`~flexattn.distributed.ContextParallel` per mask on ``cp_mesh``,
    and deals tokens, labels and positions to this rank in its plan's order (labels of padding
    positions are ignored by the loss). Returns ``(inputs, labels, extra_kwargs, tokens)`` with
    ``extra_kwargs["attention_masks"]`` the ContextParallel (or a dict of them, for a model with
    several masks) and ``tokens`` the number of real tokens this rank holds.
    """
    positions = extra_kwargs.get("positions")
    if positions is None:
        raise InvalidInputError(
            "flexattn's context parallelism needs the batch's 'positions' (torchtitan's text dataloaders give "
            "them): the global BlockMask is built from them before the batch is sharded")
    masks = model.get_attention_masks(positions=positions)

    def context_parallel(mask):
        return None if mask is None else ContextParallel(mask, cp_mesh, attention.cp_balance,
                                                         schedule=attention.cp_schedule)

    if isinstance(masks, dict):
        plans = {name: context_parallel(mask) for name, mask in masks.items()}
        built = [cp for cp in plans.values() if cp is not None]
    else:
        plans = context_parallel(masks)
        built = [plans]
    # Tokens are queries and keys alike, and every layer must see the same shards.
    layout = built[0].plan.q_layout
    for cp in built:
        if not all(torch.equal(units, layout.units) for units in (cp.plan.q_layout.units, cp.plan.kv_layout.units)):
            raise InvalidInputError(
                f"flexattn's context parallelism: the model's masks deal tokens to ranks differently under "
                f"cp_balance={attention.cp_balance!r}, so its layers would need different shards. Use "
                "cp_balance='zigzag' or 'contiguous', which deal every mask of one length alike")
    rank = built[0].rank
    inputs = _shard_tokens(inputs, layout, rank, 0)
    labels = _shard_tokens(labels, layout, rank, IGNORE_INDEX)
    extra_kwargs = {**extra_kwargs, "positions": _shard_tokens(positions, layout, rank, 0), "attention_masks": plans}
    tokens = inputs.shape[0] * int((layout.positions(rank) < layout.length).sum())
    return inputs, labels, extra_kwargs, tokens


# ------------------------------------------------------------------------------------ trainer


class FlexattnTrainer(Trainer):
    """torchtitan's Trainer, with context parallelism on flexattn.distributed for a model whose
    attention is :class:`FlexattnAttention`: :func:`shard_batch` instead of torchtitan's
    ``prepare_context_parallel_input``. Everything else is torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def __init__(self, config: Config) -> None:
        attention = _check_context_parallel(config)
        super().__init__(config)
        if attention is not None:
            logger.info(f"flexattn: context parallelism deals tokens with cp_balance={attention.cp_balance!r} and "
                        f"runs cp_schedule={attention.cp_schedule!r}; parallelism.context_parallel_load_balancer "
                        "is not read")

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        attention = _attention_config(self.model_config)
        if not self.parallel_dims.cp_enabled or attention is None:
            return super().post_dataloading_process(input_dict, labels)
        inputs = input_dict["input"]
        extra_kwargs: dict[str, Any] = {k: v for k, v in input_dict.items() if k != "input"}
        inputs, labels, extra_kwargs, tokens = shard_batch(
            self.model_parts[0], inputs, labels, extra_kwargs, self.parallel_dims.get_mesh("cp"), attention)
        self.ntokens_seen += tokens
        if self.parallel_dims.spmd_backend == "full_dtensor":
            return full_dtensor.parallelize_inputs(self.parallel_dims, inputs, labels, extra_kwargs)
        return annotate_input_spmd_types(self.parallel_dims, inputs, labels, extra_kwargs)


class FlexattnValidator(Validator):
    """torchtitan's Validator, sharding batches as :class:`FlexattnTrainer` does."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    def post_dataloading_process(self, input_dict, labels, model_parts):
        attention = _attention_config(getattr(model_parts[0], "config", None))
        if not self.parallel_dims.cp_enabled or attention is None:
            return super().post_dataloading_process(input_dict, labels, model_parts)
        inputs = input_dict["input"]
        extra_kwargs = {k: v for k, v in input_dict.items() if k != "input"}
        inputs, labels, extra_kwargs, _ = shard_batch(
            model_parts[0], inputs, labels, extra_kwargs, self.parallel_dims.get_mesh("cp"), attention)
        if self.parallel_dims.spmd_backend == "full_dtensor":
            return full_dtensor.parallelize_inputs(self.parallel_dims, inputs, labels, extra_kwargs)
        return inputs, labels, extra_kwargs


def _check_context_parallel(config) -> Optional[FlexattnAttention.Config]:
    """The attention config whose context parallelism flexattn runs, after checking that torchtitan's
    settings let it; None where it does not run (one context-parallel rank, or another attention)."""
    parallelism = config.parallelism
    if parallelism.context_parallel_degree <= 1 or config.model_spec is None:
        return None
    attention = _attention_config(config.model_spec.model)
    if attention is None:
        return None
    if parallelism.spmd_backend not in ("spmd_types", "full_dtensor"):
        raise InvalidInputError(
            f"flexattn's context parallelism runs under parallelism.spmd_backend 'spmd_types' (torchtitan's default) "
            f"or 'full_dtensor', got {parallelism.spmd_backend!r}, which all-gathers K and V in a wrapper of its own")
    if config.compile.enable and "model" in config.compile.components:
        raise InvalidInputError(
            "flexattn's context parallelism does not run inside torch.compile (its ring's collectives break "
            "torchtitan's fullgraph=True blocks): drop 'model' from compile.components, or set compile.enable=False")
    if not config.training.disable_cuda_graphs and torchtitan_utils.device_type == "cuda":
        raise InvalidInputError(
            "flexattn's context parallelism plans each batch's ring on the host, from the batch's mask; a CUDA graph "
            "would replay the first batch's plan: set training.disable_cuda_graphs=True")
    return attention


def use_flexattn(config: Trainer.Config, **attention_fields) -> FlexattnTrainer.Config:
    """``config`` (a torchtitan ``Trainer.Config``) running on flexattn: every ``FlexAttention``
    of the model becomes a :class:`FlexattnAttention` (``attention_fields``: ``cp_balance``,
    ``cp_schedule``, or any FlexAttention field such as ``kernel_options``), the trainer a
    :class:`FlexattnTrainer` and the validator a :class:`FlexattnValidator`. ``config`` itself is
    left as it was, except its model config, which is shared and changed in place."""
    if not isinstance(config, Trainer.Config):
        raise InvalidInputError(f"use_flexattn takes a torchtitan Trainer.Config, got {type(config).__name__}")
    if config.model_spec is None:
        raise InvalidInputError("use_flexattn: the config has no model_spec (a config_registry function sets it)")
    swapped = 0
    for _, attention, parent, slot in list(config.model_spec.model.traverse(FlexAttention.Config)):
        replacement = flexattn_attention(attention, **attention_fields)
        if isinstance(parent, list):
            parent[slot] = replacement
        else:
            setattr(parent, slot, replacement)
        swapped += 1
    if not swapped:
        raise InvalidInputError(
            f"use_flexattn: the model {config.model_spec.name} has no FlexAttention to swap (its attention backend "
            "is another one: pick a config whose attn_backend is 'flex' or 'flex_flash')")
    trainer = derive(config, FlexattnTrainer.Config)
    if type(trainer.validator) is Validator.Config:
        trainer.validator = derive(trainer.validator, FlexattnValidator.Config)
    logger.info(f"flexattn: {swapped} attention modules of {config.model_spec.name} run on flexattn")
    return trainer


# ------------------------------------------------------------------------------------ command line


def __getattr__(name: str):
    """``--module flexattn.integrations.torchtitan --config <name>``: torchtitan's config ``name``
    (``llama3_debugmodel``: ``torchtitan.models.llama3.config_registry.llama3_debugmodel``) through
    :func:`use_flexattn`."""
    if name.startswith("_"):
        raise AttributeError(name)
    parts = name.split("_")
    for end in range(len(parts) - 1, 0, -1):
        try:
            registry = importlib.import_module(f"torchtitan.models.{'_'.join(parts[:end])}.config_registry")
        except ImportError:
            continue
        make = getattr(registry, name, None)
        if callable(make):
            def config() -> FlexattnTrainer.Config:
                return use_flexattn(make())

            config.__name__ = config.__qualname__ = name
            config.__doc__ = f"torchtitan's {name} on flexattn (use_flexattn)."
            return config
    raise AttributeError(
        f"module {__name__!r} has no attribute {name!r} (and torchtitan registers no config of that name)")
