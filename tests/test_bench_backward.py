"""The training benchmark's own pieces (flexattn/bench/backward.py) that its CPU smoke run cannot judge:
the heads it takes, the names of its rows, and the float32 oracle's slice under grouped-query attention.
Its whole code path on a CPU, GQA rows included: tests/test_bench_targets.py."""

import argparse

import pytest
import torch

from flexattn.bench.backward import heads_shape, oracle_errors, shape_label
from flexattn.reference import reference_attention


def test_heads_are_one_number_or_query_heads_over_key_value_heads():
    assert heads_shape("16") == (16, 16)
    assert heads_shape("32:8") == (32, 8)
    for bad in ("32:5", "8:0", "x", "32:"):
        with pytest.raises(argparse.ArgumentTypeError):
            heads_shape(bad)


def test_a_rows_shape_names_its_grouped_heads_and_length():
    assert shape_label({"B": 2, "H": 16, "L": 16384}) == "B2 H16 16k"  # rows stored before GQA rows existed
    assert shape_label({"B": 2, "H": 32, "H_kv": 8, "L": 8192}) == "B2 H32:8 8k"
    assert shape_label({"B": 1, "H": 2, "H_kv": 2, "L": 200}) == "B1 H2 200"


def test_the_oracle_sums_a_key_value_heads_gradients_over_its_query_heads():
    # Exact float32 results of the whole GQA problem agree with the oracle's slice only if the slice
    # takes the right query heads, shifts b and h for the mods, and sums their dK and dV.
    torch.manual_seed(0)
    B, H, H_kv, L, D = 2, 4, 2, 64, 16
    q, dout = torch.randn(B, H, L, D), torch.randn(B, H, L, D)
    k, v = torch.randn(B, H_kv, L, D), torch.randn(B, H_kv, L, D)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + 0.1 * (h + 1) * (b + 1) * (kv_idx - q_idx) / L

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _, _ = reference_attention(*leaves, score_mod, mask_mod, enable_gqa=True)
    grads = torch.autograd.grad(out, leaves, dout)
    exact = (out.detach(), [g.detach() for g in grads])
    dk_of_one_head = [grads[0], grads[1] / 2, grads[2]]  # as if the group held one query head, not two

    errors = oracle_errors(q, k, v, dout, score_mod, mask_mod, {"exact": exact, "one_head": (out, dk_of_one_head)},
                           B - 1, H_kv - 1)
    assert max(errors["exact"].values()) < 1e-5, errors["exact"]
    assert errors["one_head"]["dk"] > 0.4 and errors["one_head"]["dq"] < 1e-5
