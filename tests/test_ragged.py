"""RaggedTensor, the prelude and strip/restore padding: one suite run on every backend (Triton kernels,
compiled on CUDA or interpreted on CPU, and the PyTorch reference)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoragged
from autoragged import RaggedTensor, restore_padding, strip_padding


def _padded(lengths, features=(3,), dtype=torch.float32, device="cpu", extra=2):
    L = max(lengths, default=0) + extra
    return torch.randn(len(lengths), L, *features, dtype=torch.float64).to(dtype=dtype, device=device)


def _aligned(n, a):
    return -(-n // a) * a


# -- round trips ------------------------------------------------------------------------------
lengths_st = st.lists(st.integers(0, 70), min_size=0, max_size=6)


@pytest.mark.parametrize("align", [1, 8, 16, 64])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=lengths_st, dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_round_trip_identity(backend, align, lengths, dtype):
    x = _padded(lengths, (2, 3), dtype, backend)
    rt = RaggedTensor.from_padded(x, lengths, align=align)
    # offsets: prefix sum of aligned lengths, on the values' device, int32
    expected = np.concatenate([[0], np.cumsum([_aligned(n, align) for n in lengths])]).astype(np.int64)
    assert rt.offsets.dtype == torch.int32 and rt.offsets.device == x.device
    assert rt.offsets.cpu().tolist() == expected.tolist() == list(rt.layout.offsets)
    assert rt.values.shape == (int(expected[-1]), 2, 3)
    assert rt.lengths == tuple(lengths) and rt.total == sum(lengths) and rt.max_len == max(lengths, default=0)
    # gap rows are zero, real rows are the tokens
    covered = torch.zeros(rt.values.shape[0], dtype=torch.bool)
    for i, n in enumerate(lengths):
        assert torch.equal(rt.select(i), x[i, :n])
        covered[expected[i] : expected[i] + n] = True
    assert (rt.values[~covered.to(x.device)] == 0).all()
    # back: identity on real tokens, pad value elsewhere
    back = rt.to_padded(pad_value=7.0)
    assert back.shape == (len(lengths), max(lengths, default=0), 2, 3)
    for i, n in enumerate(lengths):
        assert torch.equal(back[i, :n], x[i, :n])
        assert (back[i, n:] == 7).all()


@pytest.mark.parametrize("lengths", [(5, 0, 3), (1,), (70, 2, 9, 33)])
def test_spare_rows_follow_the_components_as_zeros(backend, lengths):
    """`ragged_from_padded(rows=)`, the eager arm's cuBLAS rung (`cublas_rows`): the components keep their packed
    offsets, the rows past them are zeros in no component, and unpacking gives the tokens back."""
    from autoragged.planning.buckets import cublas_rows
    from autoragged.ragged.tensor import ragged_from_padded

    x = _padded(lengths, (4,), torch.float32, backend)
    rows = cublas_rows(sum(lengths))
    assert rows >= max(256, sum(lengths))
    rt = ragged_from_padded(x, lengths, 1, 1, rows)
    assert rt.values.shape == (rows, 4) and rt.layout.rows == rows
    assert list(rt.layout.offsets) == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert (rt.values[sum(lengths) :] == 0).all()
    back = rt.to_padded()
    for i, n in enumerate(lengths):
        assert torch.equal(back[i, :n], x[i, :n])
    # aligned layouts, and rows the packing fills anyway, are left as they were
    assert ragged_from_padded(x, lengths, 8, 1, rows).layout.rows == sum(_aligned(n, 8) for n in lengths)
    assert ragged_from_padded(x, lengths, 1, 1, 1).layout.rows == sum(lengths)


@settings(max_examples=25, deadline=None)
@given(lengths=lengths_st, block_m=st.sampled_from([1, 16, 32, 64]), align=st.sampled_from([1, 8, 16, 64]))
def test_prelude_covers_exactly_the_real_blocks(lengths, block_m, align):
    rt = RaggedTensor.from_padded(_padded(lengths), lengths, align=align)
    grid_mapping, block_offsets = rt.prelude(block_m)
    counts = [math.ceil(n / block_m) for n in lengths]
    assert block_offsets.tolist() == [0, *np.cumsum(counts).tolist()]
    assert grid_mapping.tolist() == [b for b, c in enumerate(counts) for _ in range(c)]
    # every real row is in exactly one program's block, and no program is empty
    seen = set()
    for p, b in enumerate(grid_mapping.tolist()):
        j = p - block_offsets[b].item()
        rows = range(j * block_m, min((j + 1) * block_m, lengths[b]))
        assert len(rows) > 0
        seen.update((b, r) for r in rows)
    assert seen == {(b, r) for b, n in enumerate(lengths) for r in range(n)}
    assert rt.prelude(block_m)[0] is grid_mapping  # cached


def test_prelude_is_cached_per_layout():
    a = RaggedTensor.from_padded(torch.randn(2, 5, 4), [3, 5])
    b = RaggedTensor.from_padded(torch.randn(2, 5, 4), [3, 5])
    assert a.layout is b.layout and a.prelude(16)[0] is b.prelude(16)[0]


def test_seq_first_strip_restore(backend):
    lengths = [5, 0, 9, 1]
    x = torch.randn(10, 4, 6, device=backend)  # (L, B, D)
    vts_mask = torch.arange(10)[None, :] < torch.tensor(lengths)[:, None]
    vts_mask[0, 7] = True  # after the first 0: ignored by VTS's convention
    rt = strip_padding(x, vts_mask.to(backend), axis=0)
    assert rt.lengths == tuple(lengths)
    for i, n in enumerate(lengths):
        assert torch.equal(rt.select(i), x[:n, i])
    back = restore_padding(rt, axis=0, pad_value=-2.0, max_len=10)
    assert back.shape == x.shape
    for i, n in enumerate(lengths):
        assert torch.equal(back[:n, i], x[:n, i]) and (back[n:, i] == -2).all()


def test_strip_padding_key_padding_convention(backend):
    lengths = [3, 6]
    x = torch.randn(2, 6, 4, device=backend)
    pad = torch.arange(6)[None, :] >= torch.tensor(lengths)[:, None]  # True = pad
    a = strip_padding(x, pad.to(backend), key_padding=True)
    b = strip_padding(x, (~pad).to(backend))
    assert a.lengths == b.lengths == (3, 6)
    assert torch.equal(a.values, b.values)


def test_from_mask_matches_from_padded(backend):
    lengths = [4, 1, 0, 7]
    x = torch.randn(4, 7, 5, device=backend)
    pad = (torch.arange(7)[None, :] >= torch.tensor(lengths)[:, None]).to(backend)
    a = RaggedTensor.from_mask(x, pad, align=8)
    b = RaggedTensor.from_padded(x, lengths, align=8)
    assert a.lengths == tuple(lengths) and torch.equal(a.values, b.values)


@settings(max_examples=200, deadline=None)
@given(
    B=st.integers(0, 6),
    data=st.data(),
    width=st.sampled_from([0, 1, 7, 16, 33, 5000]),
    as_int=st.booleans(),
)
def test_mask_lengths_counts_and_finds_the_first_row_that_is_not_right_padded(B, data, width, as_int):
    """The runtime's mask read (one weighted sum per row): each row's real tokens, and the first row whose real
    tokens are not a prefix, for any pattern, long rows included (exact integer sums)."""
    from autoragged.ragged.tensor import mask_lengths

    kinds = data.draw(st.lists(st.sampled_from(["prefix", "random", "left"]), min_size=B, max_size=B))
    pad = torch.ones(B, width, dtype=torch.bool)
    for i, kind in enumerate(kinds):
        n = data.draw(st.integers(0, width))
        if kind == "prefix":
            pad[i, :n] = False
        elif kind == "left":
            pad[i, width - n :] = False
        else:
            pad[i] = torch.tensor(data.draw(st.lists(st.booleans(), min_size=width, max_size=width)), dtype=torch.bool)
    real = ~pad
    want_lengths = tuple(int(r.sum()) for r in real)
    bad = [i for i, r in enumerate(real) if not bool(r[: int(r.sum())].all())]
    got = mask_lengths(pad.to(torch.int32) if as_int else pad)
    assert got == (want_lengths, bad[0] if bad else None)


def test_integer_mask_is_accepted():
    x = torch.randn(2, 4, 3)
    rt = strip_padding(x, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    assert rt.lengths == (2, 4)


def test_from_list_and_unbind(backend):
    parts = [torch.randn(n, 3, device=backend) for n in (4, 0, 17, 1)]
    rt = RaggedTensor.from_list(parts, align=16)
    assert rt.lengths == (4, 0, 17, 1) and rt.layout.offsets == (0, 16, 16, 48, 64)
    for a, b in zip(parts, rt.unbind()):
        assert torch.equal(a, b)
    assert (rt.values[4:16] == 0).all()


def test_from_values_offsets_is_a_view(device):
    values = torch.randn(10, 3, device=device)
    rt = RaggedTensor.from_values_offsets(values, torch.tensor([0, 4, 4, 10], device=device))
    assert rt.values.data_ptr() == values.data_ptr()
    assert rt.lengths == (4, 0, 6)
    values[5] = 42.0
    assert (rt.select(2)[1] == 42).all()


def test_from_values_offsets_with_holes(device):
    values = torch.randn(12, 2, device=device)
    rt = RaggedTensor.from_values_offsets(values, torch.tensor([0, 5, 12], device=device), lengths=[3, 6])
    assert rt.lengths == (3, 6) and not rt.layout.canonical
    assert torch.equal(rt.select(1), values[5:11])
    padded = rt.to_padded()
    assert torch.equal(padded[0, :3], values[:3]) and (padded[0, 3:] == 0).all()


def test_nested_round_trip(device):
    parts = [torch.randn(n, 4, device=device) for n in (3, 5, 1)]
    rt = RaggedTensor.from_list(parts)
    nt = rt.to_nested()
    assert nt.is_nested and [t.shape[0] for t in nt.unbind()] == [3, 5, 1]
    back = RaggedTensor.from_nested(nt)
    assert back.lengths == (3, 5, 1) and torch.equal(back.values, rt.values)
    strided = torch.nested.nested_tensor(parts)
    assert RaggedTensor.from_nested(strided).lengths == (3, 5, 1)


def test_nested_with_gaps_keeps_lengths():
    rt = RaggedTensor.from_list([torch.randn(3, 2), torch.randn(5, 2)], align=4)
    nt = rt.to_nested()
    assert [t.shape[0] for t in nt.unbind()] == [3, 5]
    assert torch.equal(nt.unbind()[1], rt.select(1))


def test_elementwise_ops_keep_structure_and_zero_gaps():
    a = RaggedTensor.from_list([torch.randn(3, 2), torch.randn(5, 2)], align=4)
    b = a * 2.0 + 1.0
    assert b.layout is a.layout
    assert torch.allclose(b.select(1), a.select(1) * 2 + 1)
    assert (b.values[3] == 0).all() and (b.values[13:] == 0).all()
    c = a + b
    assert torch.allclose(c.select(0), a.select(0) * 3 + 1)
    d = (-a).to(torch.float64)
    assert d.dtype == torch.float64 and torch.equal(d.select(0), -a.select(0).double())
    assert torch.allclose((a * torch.tensor([1.0, -1.0])).select(0)[:, 1], -a.select(0)[:, 1])


def test_empty_batch_is_valid(backend):
    x = torch.empty(0, 0, 4, device=backend)
    rt = RaggedTensor.from_padded(x, [])
    assert rt.batch_size == 0 and rt.total == 0 and rt.values.shape == (0, 4)
    assert rt.to_padded().shape == (0, 0, 4)
    gm, bo = rt.prelude(32)
    assert gm.numel() == 0 and bo.tolist() == [0]
    assert strip_padding(x, torch.zeros(0, 0, dtype=torch.bool, device=backend)).batch_size == 0


def test_all_zero_lengths(backend):
    x = torch.randn(3, 4, 2, device=backend)
    rt = RaggedTensor.from_padded(x, [0, 0, 0], align=16)
    assert rt.values.shape == (0, 2) and rt.to_padded(max_len=4).abs().sum() == 0


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: RaggedTensor.from_padded(torch.randn(5), [1]), ValueError, "at least 2 dims"),
        (lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), [1]), ValueError, "got 1 lengths for a batch of 2"),
        (lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), [1, -2]), ValueError, "lengths[1] = -2 is negative"),
        (
            lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), [1, 5]),
            ValueError,
            "lengths[1] = 5 exceeds the padded length 4",
        ),
        (lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), [1, 2.5]), TypeError, "2.5"),
        (lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), torch.tensor([1.0, 2.0])), TypeError, "integers"),
        (
            lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), torch.tensor([1, 2], device="meta")),
            TypeError,
            "on the host",
        ),
        (lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), [1, 2], align=3), ValueError, "power of two"),
        (lambda: RaggedTensor.from_padded([[1.0]], [1]), TypeError, "torch.Tensor"),
        (
            lambda: RaggedTensor.from_values_offsets(torch.randn(6, 2), torch.tensor([0, 4, 2, 6])),
            ValueError,
            "offsets decrease at 1",
        ),
        (
            lambda: RaggedTensor.from_values_offsets(torch.randn(6, 2), torch.tensor([0, 4, 9])),
            ValueError,
            "offsets[-1] = 9 but values has only 6 rows",
        ),
        (
            lambda: RaggedTensor.from_values_offsets(torch.randn(6, 2), torch.tensor([0, 4, 6]), [5, 2]),
            ValueError,
            "lengths[0] = 5 exceeds",
        ),
        (
            lambda: RaggedTensor.from_values_offsets(torch.randn(6, 2), torch.tensor([0.0, 6.0])),
            TypeError,
            "int32/int64",
        ),
        (
            lambda: RaggedTensor.from_mask(
                torch.randn(2, 4, 3), torch.tensor([[False, True, False, True], [False] * 4])
            ),
            ValueError,
            "row 0",
        ),
        (
            lambda: RaggedTensor.from_mask(torch.randn(2, 4, 3), torch.zeros(2, 5, dtype=torch.bool)),
            ValueError,
            "(2, 5)",
        ),
        (lambda: RaggedTensor.from_mask(torch.randn(2, 4, 3), torch.zeros(2, 4)), TypeError, "bool or integer"),
        (
            lambda: strip_padding(torch.randn(2, 4), torch.ones(2, 4, dtype=torch.bool), axis=2),
            ValueError,
            "axis must be",
        ),
        (
            lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), [1, 2]).to_padded(max_len=1),
            ValueError,
            "max_len = 1 is shorter",
        ),
        (
            lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), [1, 2]).select(2),
            IndexError,
            "component 2 out of range",
        ),
        (
            lambda: RaggedTensor.from_list([torch.randn(2, 3), torch.randn(2, 4)]),
            ValueError,
            "tensors[1] has features (4,)",
        ),
        (lambda: RaggedTensor.from_list([]), ValueError, "at least one tensor"),
        (
            lambda: (
                RaggedTensor.from_padded(torch.randn(2, 4, 3), [1, 2])
                + RaggedTensor.from_padded(torch.randn(2, 4, 3), [2, 1])
            ),
            ValueError,
            "layouts differ",
        ),
        (
            lambda: RaggedTensor.from_padded(torch.randn(2, 4, 3), [1, 2]) * torch.randn(4, 3),
            ValueError,
            "broadcasts over one component",
        ),
        (lambda: RaggedTensor.from_nested(torch.randn(2, 3)), TypeError, "nested tensor"),
        (lambda: restore_padding(torch.randn(2, 3)), TypeError, "RaggedTensor"),
    ],
)
def test_bad_input_is_named(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


def test_public_surface():
    assert set(autoragged.__all__) >= {"RaggedTensor", "strip_padding", "restore_padding", "KernelConfig"}
    for name in autoragged.__all__:
        assert getattr(autoragged, name) is not None
