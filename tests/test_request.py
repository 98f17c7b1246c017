"""One front door (flexattn/request.py): the eager call, the call under torch.compile and the call under
context parallelism check their inputs with the same code, so the same bad input gives the same
error, type and message, on every entry. Copies of these checks drifted apart once (the compiled
path lacked the block mask's batch/heads check); these tests catch the next drift.

Context parallelism runs on a one-rank gloo group made in this process: with one rank a shard is
the whole sequence, so the three entries take the very same tensors.
"""

import pytest
import torch
import torch.distributed as dist

from flexattn import AuxRequest, create_block_mask, flex_attention
from flexattn.errors import InvalidInputError

L, E, BLOCK = 64, 16, 32

pytestmark = pytest.mark.usefixtures("one_thread")


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


_ON_META = torch.randn(2, device="meta")  # stands for a tensor on another device than the query


def reads_a_meta_tensor(score, b, h, q_idx, kv_idx):
    return score + _ON_META[h]


def _mask(heads=None):
    return create_block_mask(causal, None, heads, L, L, device="cpu", BLOCK_SIZE=BLOCK)


def _qkv(q_shape=(1, 2, L, E), k_shape=(1, 2, L, E), v_shape=None, dtype=torch.float32):
    v_shape = k_shape if v_shape is None else v_shape
    return tuple(torch.randn(shape).to(dtype) for shape in (q_shape, k_shape, v_shape))


def _mixed_with_grad():
    q, k, v = _qkv()
    return q.requires_grad_(), k.to(torch.bfloat16), v


# (name, inputs: () -> (q, k, v, keywords), heads of the mask, entries it applies to). Each input
# has one fault.
ALL, NOT_CP = ("eager", "compiled", "context_parallel"), ("eager", "compiled")
CASES = [
    ("query not a tensor", lambda: ([1.0], *_qkv()[1:], {}), None, ALL),
    ("integer dtype", lambda: (*_qkv(dtype=torch.int32), {}), None, ALL),
    ("3-D query", lambda: (torch.randn(2, L, E), *_qkv()[1:], {}), None, ALL),
    ("key on another device", lambda: (*_qkv()[:1], torch.randn(1, 2, L, E, device="meta"), _qkv()[2], {}), None,
     ALL),
    ("key and value lengths differ", lambda: (*_qkv(v_shape=(1, 2, L // 2, E)), {}), None, ALL),
    ("key batch is neither the query's nor 1", lambda: (*_qkv(q_shape=(2, 2, L, E), k_shape=(3, 2, L, E)), {}), None,
     ALL),
    ("head dims differ", lambda: (*_qkv(k_shape=(1, 2, L, 2 * E), v_shape=(1, 2, L, E)), {}), None, ALL),
    ("heads differ without enable_gqa", lambda: (*_qkv(q_shape=(1, 4, L, E)), {}), None, ALL),
    ("heads not a multiple", lambda: (*_qkv(q_shape=(1, 3, L, E)), {"enable_gqa": True}), None, ALL),
    ("empty head dim", lambda: (*_qkv(q_shape=(1, 2, L, 0), k_shape=(1, 2, L, 0)), {}), None, ALL),
    ("unknown kernel option", lambda: (*_qkv(), {"kernel_options": {"BLOK_M": 64}}), None, ALL),
    ("kernel_options not a dict", lambda: (*_qkv(), {"kernel_options": [("BACKEND", "PYTORCH")]}), None, ALL),
    ("return_aux not an AuxRequest", lambda: (*_qkv(), {"return_aux": "lse"}), None, ALL),
    ("scale not a number", lambda: (*_qkv(), {"scale": "0.25"}), None, ALL),
    ("captured tensor on another device", lambda: (*_qkv(), {"score_mod": reads_a_meta_tensor}), None, ALL),
    ("block_mask heads neither 1 nor the query's", lambda: (*_qkv(), {}), 3, ALL),
    ("return_lse and return_aux", lambda: (*_qkv(), {"return_lse": True, "return_aux": AuxRequest(lse=True)}), None,
     NOT_CP),
    ("mixed dtypes with a gradient", lambda: (*_mixed_with_grad(), {}), None, NOT_CP),
]


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank process group for ContextParallel, and one ContextParallel per mask."""
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from flexattn.distributed import ContextParallel

    made = {}

    def context_parallel(heads):
        if heads not in made:
            made[heads] = ContextParallel(_mask(heads))
        return made[heads]

    yield context_parallel
    dist.destroy_process_group()


def _raised(fn) -> Exception:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - what each entry raises is the subject
        return err
    pytest.fail("no error raised")


def _compiled_error(err: Exception) -> str:
    """``repr`` of the error the call under torch.compile(fullgraph=True) raised. Dynamo reports an
    error raised in code it traces (the checks of api._compiled_call) in its own exception, which
    names the original's repr; an error of a function it runs as a constant (the options and the
    mods' tensors, checked once per compile: api._registered_call) is the context of its own, with
    the user's code appended to its message."""
    cause = err
    while cause is not None and not isinstance(cause, InvalidInputError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        return f"{type(cause).__name__}({str(cause).split(chr(10) * 2 + 'from user code:')[0]!r})"
    marker = "raised exception "
    text = str(err)
    assert marker in text, f"{type(err).__name__}: {text}"
    return text[text.index(marker) + len(marker):].splitlines()[0]


@pytest.mark.parametrize("name, inputs, heads, entries", CASES, ids=[case[0] for case in CASES])
def test_every_entry_raises_the_same_error(one_rank, name, inputs, heads, entries):
    q, k, v, keywords = inputs()
    mask = _mask(heads)
    expected = _raised(lambda: flex_attention(q, k, v, block_mask=mask, **keywords))
    assert type(expected) is InvalidInputError, f"{name}: {expected!r}"
    compiled = torch.compile(flex_attention, backend="eager", fullgraph=True, dynamic=False)
    got = _compiled_error(_raised(lambda: compiled(q, k, v, block_mask=mask, **keywords)))
    assert got == repr(expected), f"{name} under torch.compile: {got}"
    if "context_parallel" in entries:
        cp = one_rank(heads)
        got = _raised(lambda: cp.flex_attention(q, k, v, **keywords))
        assert repr(got) == repr(expected), f"{name} under context parallelism: {got!r}"


def test_context_parallelism_adds_its_own_checks_after_the_common_ones(one_rank):
    cp = one_rank(None)
    q, k, v = _qkv()
    with pytest.raises(InvalidInputError, match="^cp.flex_attention: query, key and value must have one dtype"):
        cp.flex_attention(q, k.to(torch.bfloat16), v)
    with pytest.raises(InvalidInputError, match=r"^cp.flex_attention: query has 32 positions .* pass cp.shard\(q\)"):
        cp.flex_attention(q[:, :, : L // 2], k, v)
