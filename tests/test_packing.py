"""Token-budget batching: FFD packing against a plain reference, the batch sampler and ragged collate in a real
DataLoader, the capacity probe under a simulated memory limit, and padding overhead."""

import functools
import gc
import logging
import warnings
import weakref
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from autoragged import RaggedTensor
from autoragged.packing import (
    CapacityProbe,
    OversizeSequenceWarning,
    TokenBudgetBatchSampler,
    ffd_pack,
    fixed_size_batches,
    length_sorted_batches,
    padding_overhead,
    probe_capacity,
    ragged_collate,
)


def _aligned(n, a):
    return -(-n // a) * a


def ref_ffd(lengths, max_tokens, align):
    """First fit decreasing as the textbook writes it: O(n * bins), longest first, ties by index."""
    bins, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        size = _aligned(lengths[i], align)
        for j, r in enumerate(room):
            if r >= size:
                bins[j].append(i)
                room[j] -= size
                break
        else:
            bins.append([i])
            room.append(max_tokens - size)
    return bins


def _pack(lengths, max_tokens, align):
    """ffd_pack, returning (bins, oversize warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bins = ffd_pack(lengths, max_tokens, align)
    return bins, [w for w in caught if issubclass(w.category, OversizeSequenceWarning)]


# -- ffd_pack -----------------------------------------------------------------------------------
pack_case = st.tuples(
    st.lists(st.integers(0, 300), min_size=0, max_size=60),
    st.integers(1, 700),
    st.sampled_from([1, 2, 4, 8, 16, 32]),
)


@settings(max_examples=300, deadline=None)
@given(pack_case)
def test_ffd_matches_reference(case):
    lengths, max_tokens, align = case
    bins, _ = _pack(lengths, max_tokens, align)
    assert bins == ref_ffd(lengths, max_tokens, align)


@settings(max_examples=300, deadline=None)
@given(pack_case)
def test_ffd_invariants(case):
    lengths, max_tokens, align = case
    bins, caught = _pack(lengths, max_tokens, align)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every index exactly once
    oversize = [i for i, n in enumerate(lengths) if _aligned(n, align) > max_tokens]
    for b in bins:
        cost = sum(_aligned(lengths[i], align) for i in b)
        assert cost <= max_tokens or (len(b) == 1 and b[0] in oversize)
    assert all(b for b in bins)
    firsts = [lengths[b[0]] for b in bins]
    assert firsts == sorted(firsts, reverse=True)  # bins are opened longest first
    assert len(caught) == (1 if oversize else 0)
    if oversize:
        msg = str(caught[0].message)
        assert f"max_tokens={max_tokens}" in msg
        for i in sorted(oversize, key=lambda i: (-lengths[i], i))[:5]:  # the longest are named
            assert f"index {i} (length {lengths[i]}, {_aligned(lengths[i], align)} aligned)" in msg
    again, _ = _pack(lengths, max_tokens, align)
    assert again == bins


def test_ffd_medium_input_matches_reference():
    rng = np.random.default_rng(1)
    lengths = rng.integers(0, 520, 3000).tolist() + [5000, 0, 0]
    bins, caught = _pack(lengths, 4096, 16)
    assert bins == ref_ffd(lengths, 4096, 16)
    assert len(caught) == 1 and "index 3000 (length 5000, 5008 aligned)" in str(caught[0].message)


def test_ffd_large_input_invariants():
    rng = np.random.default_rng(2)
    lengths = (80 + 432 * rng.beta(2.5, 2.5, 100_000)).round().astype(np.int64)
    bins, caught = _pack(lengths, 16384, 16)
    assert not caught
    assert np.array_equal(np.sort(np.concatenate([np.asarray(b) for b in bins])), np.arange(len(lengths)))
    costs = [int(_aligned(lengths[b], 16).sum()) for b in bins]
    assert max(costs) <= 16384
    assert sum(c <= 16384 // 2 for c in costs) <= 1  # first fit leaves at most one bin half empty


def test_ffd_edge_cases():
    assert ffd_pack([], 10) == []
    assert ffd_pack([0, 0, 0], 1, align=1) == [[0, 1, 2]]
    assert ffd_pack([5, 5, 5], 10, align=1) == [[0, 1], [2]]
    assert ffd_pack([5, 5, 5], 10, align=8) == [[0], [1], [2]]  # 8 + 8 > 10
    assert ffd_pack((3, 7, 3, 7), 10, align=1) == [[1, 0], [3, 2]]  # ties by index
    with pytest.warns(OversizeSequenceWarning, match=r"max_tokens=20 \(align=16\): index 1 \(length 30, 32 aligned\)"):
        assert ffd_pack([4, 30, 0], 20, align=16) == [[1], [0, 2]]
    with pytest.warns(OversizeSequenceWarning, match="7 sequences exceed.* and 2 more") as record:
        assert ffd_pack([50] * 7, 20, align=1) == [[i] for i in range(7)]
    assert record[0].filename == __file__


def test_ffd_accepts_numpy_and_cpu_tensors():
    lengths = [7, 130, 64, 65, 1, 0, 250]
    expected = ffd_pack(lengths, 256)
    assert ffd_pack(np.asarray(lengths, dtype=np.int32), 256) == expected
    assert ffd_pack(torch.tensor(lengths), 256) == expected
    assert ffd_pack(lengths, np.int64(256)) == expected


@pytest.mark.parametrize(
    "lengths, max_tokens, align, err, match",
    [
        ([3, -2], 10, 16, ValueError, r"lengths\[1\] = -2"),
        ([3, 2.5], 10, 16, TypeError, "2.5"),
        (np.array([1.0, 2.0]), 10, 16, TypeError, "float64"),
        (torch.tensor([1.0]), 10, 16, TypeError, "float32"),
        (np.ones((2, 2), dtype=np.int64), 10, 16, ValueError, r"1-D, got shape \(2, 2\)"),
        ("abc", 10, 16, TypeError, "str"),
        ([3], 0, 16, ValueError, "max_tokens must be a positive int, got 0"),
        ([3], -5, 16, ValueError, "got -5"),
        ([3], 1.5, 16, TypeError, "1.5"),
        ([3], True, 16, TypeError, "True"),
        ([3], 10, 3, ValueError, "power of two.*3"),
        ([3], 10, 0, ValueError, "power of two.*0"),
    ],
)
def test_ffd_rejects_bad_input(lengths, max_tokens, align, err, match):
    with pytest.raises(err, match=match):
        ffd_pack(lengths, max_tokens, align)


# -- sampler ------------------------------------------------------------------------------------
def _lengths(n=200, seed=3, high=90):
    return np.random.default_rng(seed).integers(0, high, n).tolist()


def test_sampler_len_and_order_are_the_ffd_bins():
    lengths = _lengths()
    sampler = TokenBudgetBatchSampler(lengths, 512, align=16)
    bins = ffd_pack(lengths, 512, 16)
    assert len(sampler) == len(bins) > 10
    assert list(sampler) == bins == sampler.bins
    assert list(sampler) == bins  # a second epoch is the same


def test_sampler_shuffle_is_reproducible_per_seed_and_epoch():
    lengths = _lengths()
    bins = ffd_pack(lengths, 512, 16)

    def order(seed, epoch):
        s = TokenBudgetBatchSampler(lengths, 512, align=16, shuffle=True, seed=seed)
        s.set_epoch(epoch)
        return list(s)

    e0, e1 = order(0, 0), order(0, 1)
    assert sorted(e0) == sorted(bins) and sorted(e1) == sorted(bins)  # same bins, contents untouched
    assert e0 != bins and e0 != e1 and e0 != order(1, 0)
    assert e0 == order(0, 0) and e1 == order(0, 1)
    assert order(0, 1) == order(1, 0)  # the generator is seeded with seed + epoch
    sampler = TokenBudgetBatchSampler(lengths, 512, align=16, shuffle=True, seed=0)
    sampler.set_epoch(1)
    assert list(sampler) == list(sampler) == e1


def test_sampler_hands_out_copies():
    sampler = TokenBudgetBatchSampler([5, 6, 7], 100, align=1)
    next(iter(sampler)).append(99)
    sampler.bins[0].append(98)
    assert list(sampler) == [[2, 1, 0]]


def test_sampler_rejects_bad_arguments():
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBudgetBatchSampler([1, 2], 0)
    with pytest.raises(TypeError, match="shuffle"):
        TokenBudgetBatchSampler([1, 2], 10, shuffle="yes")
    with pytest.raises(TypeError, match="epoch"):
        TokenBudgetBatchSampler([1, 2], 10, align=1).set_epoch(1.5)
    with pytest.warns(OversizeSequenceWarning, match="index 1") as record:
        assert len(TokenBudgetBatchSampler([1, 40], 16)) == 2
    assert record[0].filename == __file__  # the warning points at the caller, not into autoragged


def test_dataloader_round_trip():
    rng = np.random.default_rng(4)
    dataset = [torch.randn(int(n), 3, 2) for n in rng.integers(0, 70, 150)]
    lengths = [len(t) for t in dataset]
    sampler = TokenBudgetBatchSampler(lengths, 384, align=16, shuffle=True, seed=7)
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=functools.partial(ragged_collate, align=16))
    seen = []
    for rt, idx in zip(loader, sampler):
        assert isinstance(rt, RaggedTensor) and rt.align == 16
        assert rt.lengths == tuple(lengths[i] for i in idx)
        assert rt.values.shape[0] <= 384  # the budget is what the ragged batch really occupies
        for k, i in enumerate(idx):
            assert torch.equal(rt.select(k), dataset[i])
        seen += idx
    assert len(loader) == len(sampler) and sorted(seen) == list(range(len(dataset)))


def test_dataloader_with_labels():
    dataset = [(torch.full((n, 4), float(n)), n % 3) for n in range(1, 40)]
    sampler = TokenBudgetBatchSampler([len(x) for x, _ in dataset], 64, align=1)
    for (rt, labels), idx in zip(DataLoader(dataset, batch_sampler=sampler, collate_fn=ragged_collate), sampler):
        assert torch.equal(labels, torch.tensor([dataset[i][1] for i in idx]))
        assert [rt.select(k)[0, 0].item() for k in range(len(idx))] == [float(dataset[i][0].shape[0]) for i in idx]


# -- collate ------------------------------------------------------------------------------------
@pytest.mark.parametrize("align", [1, 16])
def test_collate_round_trip(align):
    samples = [torch.randn(n, 5) for n in (3, 0, 17, 1, 16)]
    rt = ragged_collate(samples, align=align)
    assert isinstance(rt, RaggedTensor)
    assert rt.lengths == (3, 0, 17, 1, 16) and rt.align == align
    assert rt.offsets.tolist() == [0] + np.cumsum([_aligned(n, align) for n in rt.lengths]).tolist()
    for k, s in enumerate(samples):
        assert torch.equal(rt.select(k), s)
    real = torch.zeros(rt.values.shape[0], dtype=torch.bool)
    for k, n in enumerate(rt.lengths):
        real[rt.layout.offsets[k] : rt.layout.offsets[k] + n] = True
    assert torch.all(rt.values[~real] == 0)  # alignment gaps are zeros


def test_collate_1d_token_ids():
    rt = ragged_collate([torch.tensor([5, 6, 7]), torch.tensor([8])])
    assert rt.values.tolist() == [5, 6, 7, 8] and rt.lengths == (3, 1)


def test_collate_tuples_and_dicts():
    xs = [torch.randn(n, 2) for n in (4, 2, 7)]
    rt, labels = ragged_collate([(x, i) for i, x in enumerate(xs)])
    assert rt.lengths == (4, 2, 7) and torch.equal(labels, torch.tensor([0, 1, 2]))
    weights, rt2, ys = ragged_collate([(float(i), x, torch.tensor([i, -i])) for i, x in enumerate(xs)], key=1)
    assert torch.equal(weights, torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64))
    assert torch.equal(ys, torch.tensor([[0, 0], [1, -1], [2, -2]]))
    assert all(torch.equal(rt2.select(k), x) for k, x in enumerate(xs))
    out = ragged_collate([{"tokens": x, "label": i} for i, x in enumerate(xs)], align=16, key="tokens")
    assert set(out) == {"tokens", "label"} and out["tokens"].align == 16
    assert all(torch.equal(out["tokens"].select(k), x) for k, x in enumerate(xs))
    assert torch.equal(out["label"], torch.tensor([0, 1, 2]))


@pytest.mark.parametrize(
    "samples, kwargs, err, match",
    [
        ([], {}, ValueError, "empty batch"),
        (torch.randn(3, 4), {}, TypeError, "sequence"),
        ([torch.randn(2, 3), [1, 2]], {}, TypeError, r"samples\[1\] is a list"),
        ([torch.randn(2, 3), torch.tensor(1.0)], {}, ValueError, r"samples\[1\] is a 0-d"),
        ([torch.randn(2, 3), torch.randn(2, 4)], {}, ValueError, "features"),
        ([np.zeros((2, 3))], {}, TypeError, "ndarray"),
        ([torch.randn(2, 3)], {"key": "x"}, TypeError, "key='x'"),
        ([(torch.randn(2, 3), 0), (torch.randn(1, 3),)], {}, TypeError, r"samples\[1\] is a 1-field tuple"),
        ([(torch.randn(2, 3), 0), torch.randn(1, 3)], {}, TypeError, r"samples\[1\] is Tensor"),
        ([(1, torch.randn(2, 3))], {}, TypeError, r"samples\[0\]\[0\] is a int"),
        ([(torch.randn(2, 3), 0)], {"key": 2}, TypeError, "key must be an int index"),
        ([{"x": torch.randn(2, 3)}], {}, TypeError, r"key=\.\.\..*\['x'\]"),
        ([{"x": torch.randn(2, 3)}], {"key": "y"}, KeyError, "'y'"),
        ([{"x": torch.randn(2, 3)}, {"z": torch.randn(2, 3)}], {"key": "x"}, TypeError, r"samples\[1\] is a dict"),
        ([torch.randn(2, 3)], {"align": 12}, ValueError, "power of two"),
    ],
)
def test_collate_rejects_bad_input(samples, kwargs, err, match):
    with pytest.raises(err, match=match):
        ragged_collate(samples, **kwargs)


# -- probe_capacity -----------------------------------------------------------------------------
class MemoryLimited(torch.nn.Module):
    """A Linear that 'runs out of memory' above `limit` tokens, the way the CUDA allocator reports it."""

    def __init__(self, limit, exc=torch.OutOfMemoryError):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.limit, self.exc, self.grad_seen = limit, exc, []

    def forward(self, x, scale=1.0):
        tokens = x.total if isinstance(x, RaggedTensor) else x.shape[0]
        self.grad_seen.append(torch.is_grad_enabled())
        if tokens > self.limit:
            raise self.exc(f"CUDA out of memory. Tried to allocate {tokens * 8 * 4} bytes")
        return self.linear(x.values if isinstance(x, RaggedTensor) else x) * scale


@pytest.mark.parametrize("exc", [torch.OutOfMemoryError, torch.cuda.OutOfMemoryError, RuntimeError])
def test_probe_finds_largest_fitting(exc, caplog):
    model = MemoryLimited(333, exc)
    with caplog.at_level(logging.INFO, logger="autoragged"):
        probe = probe_capacity(model, lambda t: torch.randn(t, 8), start=100, step=50)
    assert isinstance(probe, CapacityProbe)
    assert probe.tried == [(100, True), (150, True), (200, True), (250, True), (300, True), (350, False)]
    assert probe.max_tokens == 300 and probe.safe_tokens == 270 and not probe.reached_cap
    assert model.grad_seen == [False] * 6
    assert "350 tokens: out of memory" in caplog.text and "max_tokens=300" in caplog.text


def test_probe_tuple_args_ragged_batch_and_safety_rule():
    model = MemoryLimited(1000)

    def make_batch(tokens):
        return (RaggedTensor.from_list([torch.randn(tokens - tokens // 3, 8), torch.randn(tokens // 3, 8)]), 2.0)

    probe = probe_capacity(model, make_batch, start=64, step=128, safety=0.75)
    assert [t for t, _ in probe.tried] == [64, 192, 320, 448, 576, 704, 832, 960, 1088]
    assert [ok for _, ok in probe.tried] == [True] * 8 + [False]
    assert probe.max_tokens == 960 and probe.safe_tokens == 720
    probe = probe_capacity(model, make_batch, start=100, step=1, safety=0.29, max_tokens=100)
    assert probe.safe_tokens == 29  # floor(100 * 0.29), not 28 from 100 * 0.29 = 28.999999999999996


def test_probe_max_tokens_caps_growth():
    probe = probe_capacity(MemoryLimited(10**9), lambda t: torch.randn(t, 8), start=100, step=70, max_tokens=300)
    assert probe.tried == [(100, True), (170, True), (240, True), (300, True)]
    assert probe.max_tokens == 300 and probe.safe_tokens == 270 and probe.reached_cap


def test_probe_start_too_big_raises():
    with pytest.raises(RuntimeError, match="even start=400 tokens does not fit.*lower start"):
        probe_capacity(MemoryLimited(333), lambda t: torch.randn(t, 8), start=400, step=50)


def test_probe_oom_in_make_batch_counts():
    def make_batch(tokens):
        if tokens > 250:
            raise torch.OutOfMemoryError("CUDA out of memory while building the batch")
        return torch.randn(tokens, 8)

    probe = probe_capacity(MemoryLimited(10**9), make_batch, start=100, step=100)
    assert probe.tried == [(100, True), (200, True), (300, False)]


def test_probe_releases_the_failed_batch():
    refs = []

    def make_batch(tokens):
        x = torch.randn(tokens, 8)
        refs.append(weakref.ref(x))
        return x

    probe_capacity(MemoryLimited(333), make_batch, start=100, step=200)
    gc.collect()
    assert len(refs) == 3 and all(r() is None for r in refs)


def test_probe_other_errors_propagate():
    def broken(x):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        probe_capacity(broken, lambda t: torch.randn(t, 8), start=10, step=10)
    with pytest.raises(ValueError, match="boom"):
        probe_capacity(lambda x: (_ for _ in ()).throw(ValueError("boom")), lambda t: t, start=10, step=10)


@pytest.mark.parametrize(
    "kwargs, err, match",
    [
        ({"start": 0, "step": 1}, ValueError, "start must be a positive int, got 0"),
        ({"start": 1, "step": 0}, ValueError, "step must be a positive int, got 0"),
        ({"start": 1, "step": 1, "safety": 0}, ValueError, "safety.*got 0"),
        ({"start": 1, "step": 1, "safety": 1.5}, ValueError, "safety.*1.5"),
        ({"start": 10, "step": 1, "max_tokens": 5}, ValueError, "max_tokens=5 is below start=10"),
    ],
)
def test_probe_rejects_bad_arguments(kwargs, err, match):
    with pytest.raises(err, match=match):
        probe_capacity(MemoryLimited(100), lambda t: torch.randn(t, 8), **kwargs)


# -- padding overhead ---------------------------------------------------------------------------
def test_padding_overhead_exact_values():
    lengths = [3, 1, 2, 4]  # 10 real tokens
    batches = [[0, 1], [2, 3]]
    assert padding_overhead(batches, lengths) == pytest.approx(0.4)  # 2 * 3 + 2 * 4 = 14
    assert padding_overhead(batches, lengths, align=4) == pytest.approx(0.6)  # 2 * 4 + 2 * 4 = 16
    assert padding_overhead(batches, lengths, ragged=True) == 0.0
    assert padding_overhead(batches, lengths, ragged=True, align=4) == pytest.approx(0.6)  # 4 * 4
    assert padding_overhead([[0, 1, 2, 3]], lengths) == pytest.approx(0.6)  # 4 * 4 = 16
    assert padding_overhead([[0, 1], [], [2, 3]], lengths) == pytest.approx(0.4)  # empty batches cost nothing
    assert padding_overhead([[1, 3], [1]], lengths) == pytest.approx(0.5)  # 2 * 4 + 1 = 9 for 1 + 4 + 1 real
    assert padding_overhead([[0, 2], [1]], [3, 1, 2], ragged=True, align=2) == pytest.approx(2 / 6)
    assert padding_overhead([[0, 1]], [0, 0]) == 0.0
    assert padding_overhead([], lengths) == 0.0
    assert padding_overhead([np.array([0, 1])], np.array([5, 1])) == pytest.approx(4 / 6)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(1, 200), min_size=1, max_size=40),
    st.integers(1, 8),
    st.sampled_from([1, 8, 16]),
)
def test_padding_overhead_ragged_never_exceeds_padded(lengths, batch_size, align):
    batches = fixed_size_batches(len(lengths), batch_size)
    padded = padding_overhead(batches, lengths, align=align)
    ragged = padding_overhead(batches, lengths, ragged=True, align=align)
    assert 0.0 <= ragged <= padded
    assert padding_overhead(batches, lengths, ragged=True) == 0.0


def test_padding_overhead_rejects_bad_input():
    with pytest.raises(ValueError, match="batch index 4 is out of range for 3 lengths"):
        padding_overhead([[0, 4]], [1, 2, 3])
    with pytest.raises(ValueError, match="batch index -1"):
        padding_overhead([[-1]], [1, 2, 3])
    with pytest.raises(TypeError, match="1.0"):
        padding_overhead([[1.0]], [1, 2, 3])
    with pytest.raises(TypeError, match=r"batches\[0\]"):
        padding_overhead([3], [1, 2, 3])


def test_baseline_batchings():
    assert fixed_size_batches(5, 2) == [[0, 1], [2, 3], [4]]
    assert fixed_size_batches(0, 4) == []
    assert length_sorted_batches([3, 1, 2, 3, 9], 2) == [[4, 0], [3, 2], [1]]
    with pytest.raises(ValueError, match="batch_size"):
        fixed_size_batches(5, 0)


def test_ffd_ragged_beats_sorted_beats_fixed_on_bimodal_lengths():
    # One fixed sample: FFD processed ragged (align 16) pays only alignment; length-sorted fixed batches pay
    # the batch that straddles the two modes; batches in data order pad nearly every short sequence to ~2000.
    rng = np.random.default_rng(0)
    n, batch_size = 1000, 64
    lengths = np.where(rng.random(n) < 0.5, rng.integers(45, 131, n), rng.integers(1820, 2001, n))
    ffd = padding_overhead(ffd_pack(lengths, batch_size * 2000, align=16), lengths, ragged=True, align=16)
    by_length = padding_overhead(length_sorted_batches(lengths, batch_size), lengths)
    fixed = padding_overhead(fixed_size_batches(n, batch_size), lengths)
    assert 0.0 < ffd < by_length < fixed
    assert ffd < 0.01 and by_length > 0.05 and fixed > 0.5


@pytest.mark.parametrize("world", [2, 3])
def test_a_distributed_sampler_gives_every_rank_the_same_steps_of_balanced_budgets(world):
    """Every rank the same number of steps; together they cover every sequence (the last step repeating the first
    bins); within a step the ranks' tokens differ by at most the step's largest bin; shuffling permutes steps alike."""
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 200, size=301).tolist()
    samplers = [TokenBudgetBatchSampler(lengths, 512, align=8, shuffle=True, seed=5, num_replicas=world, rank=r)
                for r in range(world)]  # fmt: skip
    for s in samplers:
        s.set_epoch(2)
    steps = [list(s) for s in samplers]
    assert len({len(s) for s in samplers}) == 1 and all(len(st) == len(samplers[0]) for st in steps)
    assert len(samplers[0]) == -(-len(samplers[0].bins) // world)
    covered = {i for st in steps for b in st for i in b}
    assert covered == set(range(len(lengths)))
    aligned = lambda b: sum(-(-lengths[i] // 8) * 8 for i in b)  # noqa: E731
    # steps hold bins of neighbouring sizes: their budget ranges add up to at most the range of all the bins (a
    # random deal of the same bins would not; the step that repeats bins to fill up is left out)
    seen = Counter(tuple(b) for st in steps for b in st)
    dealt = [step for step in zip(*steps) if all(seen[tuple(b)] == 1 for b in step)]
    assert len(dealt) >= len(steps[0]) - 2  # (the repeated bins' own step, and the one that repeats them)
    spans = [max(aligned(b) for b in step) - min(aligned(b) for b in step) for step in dealt]
    every = [aligned(b) for b in samplers[0].bins]
    assert sum(spans) <= max(every) - min(every), (spans, max(every), min(every))
    alone = TokenBudgetBatchSampler(lengths, 512, align=8, shuffle=True, seed=5)
    alone.set_epoch(2)
    assert len(alone) == len(alone.bins) and sorted(map(tuple, alone)) == sorted(map(tuple, alone.bins))


def test_a_sampler_with_fewer_bins_than_ranks_repeats_them():
    samplers = [TokenBudgetBatchSampler([5, 3], 64, align=1, num_replicas=4, rank=r) for r in range(4)]
    assert [list(s) for s in samplers] == [[[0, 1]]] * 4
    with pytest.raises(ValueError, match="rank must be in"):
        TokenBudgetBatchSampler([5], 64, num_replicas=2, rank=2)
