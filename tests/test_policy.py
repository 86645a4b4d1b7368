"""The policy (runtime/policy.py): predicted costs, scaled by how far the prediction was off (timed / predicted on
the shape once an arm is timed there, the module's other shapes until then); the cheapest ready arm runs and a cheaper graph that is not ready is asked for; close arms are tried; the runner-up is timed anew on a
schedule. Pure host logic: no model, no device."""

from __future__ import annotations

import math

import pytest
from autoragged.tuning_db import BatchStats

from autoragged.runtime import policy
from autoragged.runtime.policy import (
    MIN_SAMPLES,
    RETRY_EVERY,
    TRY_WITHIN,
    ShapeKey,
    ShapeState,
    choose,
    new_shape,
    observe,
)

ALL = {"padded", "ragged", "ragged_graph"}


def run(state, predicted, ready=ALL, sample_every=32, times=None):
    """One batch: the choice, and its timing fed back where the batch is timed (times: kind -> ms)."""
    choice = choose(state, predicted, set(ready), sample_every)
    if choice.timed and times is not None:
        observe(state, choice.kind, times[choice.kind], predicted[choice.kind])
    return choice


def test_until_timed_the_cheapest_prediction_runs_and_is_timed():
    state = ShapeState()
    choice = run(state, {"padded": 3.0, "ragged": 1.0, "ragged_graph": 2.0})
    assert choice.kind == "ragged" and choice.timed and choice.want is None and choice.why == "predicted"


def test_a_cheaper_graph_that_is_not_ready_is_asked_for_and_the_best_ready_arm_runs():
    state = ShapeState()
    choice = run(state, {"padded": 3.0, "ragged": 1.0, "ragged_graph": 0.5}, ready={"padded", "ragged"})
    assert choice.kind == "ragged" and choice.want == "ragged_graph"
    choice = run(state, {"padded": 3.0, "ragged": 1.0, "ragged_graph": 0.5})  # captured meanwhile
    assert choice.kind == "ragged_graph" and choice.want is None


def test_timed_costs_overrule_predictions_and_untimed_arms_are_scaled_like_the_timed():
    """The prior said the graph (0.5) beats the eager arm (1.0); timed, the graph takes 2.0. The eager arm, not
    timed yet, costs its prediction scaled by how far the model was off (4x): 4.0, so the graph keeps running;
    once the eager arm is timed at 1.5, it runs."""
    state = ShapeState()
    predicted = {"padded": 10.0, "ragged": 1.0, "ragged_graph": 0.5}
    for _ in range(MIN_SAMPLES):
        assert run(state, predicted, times={"ragged_graph": 2.0}).kind == "ragged_graph"
    assert policy.costs(state, predicted) == {"padded": 40.0, "ragged": 4.0, "ragged_graph": 2.0}
    for _ in range(MIN_SAMPLES):
        observe(state, "ragged", 1.5, predicted["ragged"])
    assert run(state, predicted).kind == "ragged"


def test_an_untimed_arm_within_try_within_is_tried_for_min_samples_batches_then_the_faster_wins():
    state = ShapeState()
    predicted = {"padded": 1.2, "ragged": 1.0, "ragged_graph": math.inf}
    times = {"padded": 0.8, "ragged": 1.0}
    kinds = [run(state, predicted, times=times).kind for _ in range(2 * MIN_SAMPLES + 2)]
    assert kinds[:MIN_SAMPLES] == ["ragged"] * MIN_SAMPLES  # the running arm gets its timings first
    assert kinds[MIN_SAMPLES : 2 * MIN_SAMPLES] == ["padded"] * MIN_SAMPLES  # 1.2 <= 1.3 x 1.0: tried
    assert kinds[2 * MIN_SAMPLES :] == ["padded", "padded"]  # timed faster: it runs from now on


def test_a_trial_ends_once_its_timings_price_the_arm_beyond_try_within():
    """An arm's first run on a shape can take hundreds of milliseconds (HF's padded forward took 553 ms on a new
    shape where the graph took 0.9): once a timing prices it out, the trial stops."""
    state = ShapeState()
    predicted = {"padded": 1.2, "ragged": 1.0, "ragged_graph": math.inf}
    times = {"padded": 500.0, "ragged": 1.0}
    kinds = [run(state, predicted, times=times).kind for _ in range(MIN_SAMPLES + 4)]
    assert kinds == ["ragged"] * MIN_SAMPLES + ["padded"] + ["ragged"] * 3
    assert state.trying is None


def test_a_tried_arm_timed_the_cheapest_runs_as_the_running_arm():
    state = ShapeState()
    predicted = {"padded": 1.2, "ragged": 1.0, "ragged_graph": math.inf}
    times = {"padded": 0.5, "ragged": 1.0}
    choices = [run(state, predicted, times=times) for _ in range(MIN_SAMPLES + 2)]
    assert [c.kind for c in choices] == ["ragged"] * MIN_SAMPLES + ["padded", "padded"]
    assert choices[-1].why == "timed on this device"  # not "trying it (the running arm is padded)"


def test_a_timing_still_on_its_way_does_not_cut_a_trial_short():
    """Timings land once the GPU ran the batch: a trial whose timings have not landed runs its MIN_SAMPLES batches."""
    state = ShapeState()
    predicted = {"padded": 1.2, "ragged": 1.0, "ragged_graph": math.inf}
    for _ in range(MIN_SAMPLES):
        run(state, predicted, times={"ragged": 1.0})
    assert [run(state, predicted).kind for _ in range(MIN_SAMPLES)] == ["padded"] * MIN_SAMPLES


def test_a_trial_batch_whose_host_time_alone_prices_the_arm_out_ends_the_trial_before_its_timing_lands():
    """A batch's cost is at least the host time its call took, known when the call returns: HF's padded forward
    took 0.5 s at its first call on a new shape, and its trial ran on while that timing waited behind the GPU."""
    state = ShapeState()
    predicted = {"padded": 1.2, "ragged": 1.0, "ragged_graph": math.inf}
    for _ in range(MIN_SAMPLES):
        run(state, predicted, times={"ragged": 1.0})
    assert run(state, predicted).kind == "padded"  # the trial's first batch: its timing is on its way
    policy.started(state, "padded", 500.0)
    assert [run(state, predicted).kind for _ in range(3)] == ["ragged"] * 3
    assert state.trying is None
    observe(state, "padded", 520.0, predicted["padded"])  # landed: the timing prices it
    assert policy.costs(state, predicted)["padded"] == pytest.approx(520.0)


def test_a_timed_arm_costs_at_least_the_median_host_time_of_its_recent_calls_on_the_shape():
    """Timed on the shape's long batches (15,000 tokens, where its GPU work decides), the eager arm's ratio would
    price a 5,000-token batch of the same shape at a third of that; but each of its calls there took 5 ms of host
    time (launches, the mask's read), which fewer tokens do not shrink: priced at 5 ms, the graph (2.5) runs."""
    state = ShapeState()
    long_, short = {"ragged": 10.0, "ragged_graph": 11.0}, {"ragged": 3.3, "ragged_graph": 4.4}
    for _ in range(MIN_SAMPLES):
        policy.started(state, "ragged", 5.0)
        observe(state, "ragged", 7.0, long_["ragged"])
        policy.started(state, "ragged_graph", 0.2)
        observe(state, "ragged_graph", 6.3, long_["ragged_graph"])
    cost = policy.costs(state, short)
    assert cost["ragged"] == 5.0 and cost["ragged_graph"] == pytest.approx(2.52)
    assert run(state, short).kind == "ragged_graph"
    policy.started(state, "ragged_graph", 40.0)  # one stalled call moves no median
    assert policy.costs(state, short)["ragged_graph"] == pytest.approx(2.52)


def test_the_retry_forgets_the_runner_ups_host_times_with_its_timings():
    """A first call's host time (HF's padded forward: 0.5 s on a new shape) prices the arm out until the retry,
    which forgets it: the arm is tried again on its prediction."""
    state = ShapeState()
    predicted = {"padded": 1.2, "ragged": 1.0}
    for _ in range(MIN_SAMPLES):
        run(state, predicted, times={"ragged": 1.0})
    assert run(state, predicted).kind == "padded"
    policy.started(state, "padded", 500.0)  # its timing never lands (a compile in the batch)
    kinds = [run(state, predicted, times={"ragged": 1.0, "padded": 1.1}).kind for _ in range(RETRY_EVERY)]
    assert kinds.index("padded") == RETRY_EVERY - 4  # the batch after the retry's (the shape's 512th)
    assert policy.costs(state, predicted)["padded"] == pytest.approx(1.1)


def test_an_arm_predicted_beyond_try_within_is_never_tried():
    state = ShapeState()
    predicted = {"padded": TRY_WITHIN * 1.01, "ragged": 1.0}
    kinds = {run(state, predicted, times={"ragged": 1.0, "padded": 0.1}).kind for _ in range(50)}
    assert kinds == {"ragged"}


def test_exploring_runs_each_arm_without_a_timing_on_the_shape_once_whatever_its_price():
    """Rule 5 (`warmup`): an arm priced 100x the running one, never tried in traffic, runs once; so does one
    whose first timing is still on its way; then the cheapest runs again, and traffic meets no trial."""
    state = ShapeState()
    predicted = {"padded": 100.0, "ragged": 10.0, "ragged_graph": 1.0}
    first = choose(state, predicted, ALL, 32, explore=True)
    assert first.kind == "ragged_graph" and first.timed  # untimed itself: it runs, timed
    policy.started(state, "ragged_graph", 0.1)
    second = choose(state, predicted, ALL, 32, explore=True)
    assert (second.kind, second.why, second.timed) == ("ragged", policy.EXPLORING, True)
    policy.started(state, "ragged", 10.0)  # its timing has not landed: it is not explored again
    assert choose(state, predicted, ALL, 32, explore=True).kind == "padded"
    policy.started(state, "padded", 100.0)
    assert choose(state, predicted, ALL, 32, explore=True).kind == "ragged_graph"
    assert state.explored == 2
    for kind in ALL:
        observe(state, kind, predicted[kind], predicted[kind])
    assert [choose(state, predicted, ALL, 32).kind for _ in range(2 * MIN_SAMPLES)] == ["ragged_graph"] * 6


def test_exploring_needs_timings_and_skips_arms_that_cannot_run():
    state = ShapeState()
    predicted = {"padded": 5.0, "ragged": math.inf, "ragged_graph": 1.0}
    choice = choose(state, predicted, {"padded", "ragged"}, 32, explore=True)  # the graph is not captured
    assert choice.kind == "padded" and choice.want == "ragged_graph"
    policy.started(state, "padded", 5.0)
    assert choose(state, predicted, {"padded", "ragged"}, 32, explore=True).why != policy.EXPLORING
    off = ShapeState()  # sample_every=0: nothing is timed, so nothing explores
    assert choose(off, {"padded": 5.0, "ragged": 1.0}, {"padded", "ragged"}, 0, explore=True).kind == "ragged"
    assert choose(off, {"padded": 5.0, "ragged": 1.0}, {"padded", "ragged"}, 0, explore=True).kind == "ragged"


def test_the_runner_up_is_timed_anew_every_retry_every_batches():
    """Streams drift: at the shape's RETRY_EVERY-th batch the runner-up within TRY_WITHIN runs MIN_SAMPLES batches
    with fresh timings; if it got faster meanwhile it takes over."""
    state = ShapeState()
    predicted = {"padded": 5.0, "ragged": 1.0, "ragged_graph": 1.1}
    times = {"ragged": 1.0, "ragged_graph": 1.2}
    kinds = [run(state, predicted, times=times).kind for _ in range(RETRY_EVERY - 1)]
    assert kinds.count("ragged_graph") == MIN_SAMPLES and kinds[-1] == "ragged"  # its first trial only
    times["ragged_graph"] = 0.7  # faster now: only a fresh timing can tell
    retry = [run(state, predicted, times=times).kind for _ in range(MIN_SAMPLES)]
    assert retry == ["ragged_graph"] * MIN_SAMPLES
    assert policy.costs(state, predicted)["ragged_graph"] == pytest.approx(0.7)  # the old timings were dropped
    assert len(state.timed["ragged_graph"]) == MIN_SAMPLES
    assert run(state, predicted).kind == "ragged_graph"


def test_an_arm_priced_out_by_one_slow_first_timing_is_tried_again_at_the_retry():
    """A trial cut short by a first run's one-time cost leaves the arm priced at that timing: at RETRY_EVERY every
    arm but the running one is priced anew, and one predicted close is tried again."""
    state = ShapeState()
    predicted = {"padded": 1.2, "ragged": 1.0, "ragged_graph": math.inf}
    times = {"padded": 500.0, "ragged": 1.0}
    kinds = [run(state, predicted, times=times).kind for _ in range(RETRY_EVERY - 1)]
    assert kinds.count("padded") == 1
    times["padded"] = 0.8  # its first run's cost is paid
    retry = [run(state, predicted, times=times).kind for _ in range(MIN_SAMPLES + 2)]
    assert retry == ["ragged", "padded", "padded", "padded", "padded"]
    assert policy.costs(state, predicted)["padded"] == pytest.approx(0.8)  # timed faster, it runs on, sampled
    assert len(state.timed["padded"]) == MIN_SAMPLES


def test_timing_follows_sample_every_once_an_arm_has_its_samples():
    state = ShapeState()
    predicted = {"padded": 5.0, "ragged": 1.0}
    timed = [run(state, predicted, sample_every=4, times={"ragged": 1.0}).timed for _ in range(12)]
    assert timed[:MIN_SAMPLES] == [True] * MIN_SAMPLES
    assert timed[MIN_SAMPLES:] == [(i + 1) % 4 == 0 for i in range(MIN_SAMPLES, 12)]
    never = ShapeState()
    assert not any(run(never, predicted, sample_every=0).timed for _ in range(5))


def test_one_slow_timing_does_not_overturn_a_choice():
    """The cost is the median of the recent timings: one call delayed on the host (a first cuBLAS call) does
    not decide."""
    state = ShapeState()
    for ms in (0.3, 40.0, 0.3):
        observe(state, "ragged_graph", ms, 1.0)
    for ms in (0.5, 0.5, 0.5):
        observe(state, "ragged", ms, 1.0)
    assert run(state, {"padded": 9.0, "ragged": 1.0, "ragged_graph": 1.0}).kind == "ragged_graph"


@pytest.mark.parametrize("bad", [math.inf])
def test_an_arm_without_a_usable_prediction_never_runs_untimed(bad):
    state = ShapeState()
    choice = run(state, {"padded": 2.0, "ragged": bad, "ragged_graph": bad})
    assert choice.kind == "padded" and choice.want is None


def test_a_graph_not_captured_yet_within_try_within_is_asked_for_at_once_then_tried_once_it_is_there():
    """The prior puts the graph a little behind the eager arm; both are close enough to time. The graph is not
    ready: its capture is asked for at the shape's first batch (it is captured while the eager arm gets its
    timings), and it is tried once it is there."""
    state = ShapeState()
    predicted = {"padded": 9.0, "ragged": 1.0, "ragged_graph": 1.2}
    times = {"ragged": 1.0, "ragged_graph": 0.4}
    first = [run(state, predicted, ready={"padded", "ragged"}, times=times) for _ in range(MIN_SAMPLES + 1)]
    assert [c.kind for c in first] == ["ragged"] * (MIN_SAMPLES + 1)
    assert [c.want for c in first] == ["ragged_graph"] * (MIN_SAMPLES + 1)
    tried = [run(state, predicted, times=times).kind for _ in range(MIN_SAMPLES + 2)]
    assert tried == ["ragged_graph"] * (MIN_SAMPLES + 2)  # tried, and timed faster it stays


def test_a_trial_whose_graph_cannot_be_captured_is_dropped():
    state = ShapeState()
    predicted = {"padded": 9.0, "ragged": 1.0, "ragged_graph": 1.2}
    for _ in range(MIN_SAMPLES + 1):
        run(state, predicted, ready={"padded", "ragged"}, times={"ragged": 1.0})
    without = {"padded": 9.0, "ragged": 1.0}  # its capture failed: no longer a candidate
    choice = run(state, without, times={"ragged": 1.0})
    assert choice.kind == "ragged" and choice.want is None


def test_timings_on_batches_of_one_content_price_a_batch_of_another_by_the_prediction():
    """Batches of one shape (batch size, width rung) can hold very different token counts: 128 rows of 128 real
    tokens, then 128 rows of 40. Timed on the full rows, the eager arm and the graph tie (6.6 and 6.7 ms); on the
    short rows the prior puts the graph well ahead, and each arm's timings scale its prediction there, so the graph
    runs (raw timings would have kept the eager arm: 6.6 < 6.7)."""
    state = ShapeState()
    full = {"padded": 9.0, "ragged": 6.0, "ragged_graph": 6.5}
    for kind, ms in (("ragged", 6.6), ("ragged_graph", 6.7)):
        for _ in range(MIN_SAMPLES):
            observe(state, kind, ms, full[kind])
    assert run(state, full).kind == "ragged"
    short = {"padded": 4.0, "ragged": 2.6, "ragged_graph": 1.9}
    cost = policy.costs(state, short)
    assert cost["ragged"] == pytest.approx(2.86) and cost["ragged_graph"] == pytest.approx(1.9 * 6.7 / 6.5)
    assert run(state, short).kind == "ragged_graph"


def test_an_arms_cost_is_its_recent_timings_however_many_came_before():
    """Devices and streams drift: the cost is the median of an arm's last WINDOW timings. The graph ran slowly for
    20 batches, then fast for WINDOW: it is the fast arm again (the median of all its timings says 0.6)."""
    state = ShapeState()
    for _ in range(MIN_SAMPLES):
        observe(state, "padded", 0.45, 1.0)
    for _ in range(20):
        observe(state, "ragged_graph", 0.6, 1.0)
    predicted = {"padded": 1.0, "ragged_graph": 1.0}
    assert run(state, predicted).kind == "padded"
    for _ in range(policy.WINDOW):
        observe(state, "ragged_graph", 0.3, 1.0)
    assert policy.costs(state, predicted)["ragged_graph"] == 0.3
    assert run(state, predicted).kind == "ragged_graph"


def test_an_arm_untimed_on_a_shape_costs_what_the_modules_other_shapes_say_of_it():
    """The module's timings of an arm scale its prediction on a new shape, and its calls' least host time bounds it
    from below: an eager arm whose launches took 12 ms of host time on long rows is not tried on a short row where
    the graph takes 1.6 ms, however little GPU work the prior predicts for it there."""
    from autoragged.runtime.policy import Scales

    scales = Scales()
    for _ in range(3):
        scales.observe("ragged", 20.0, 19.0, 12.0)  # a long row: the GPU's time decides, the prior is close
    state = ShapeState()
    predicted = {"padded": 30.0, "ragged": 1.2, "ragged_graph": 1.1}
    for _ in range(MIN_SAMPLES):
        observe(state, "ragged_graph", 1.6, predicted["ragged_graph"])
    cost = policy.costs(state, predicted, scales)
    assert cost["ragged"] == 12.0 and cost["ragged_graph"] == pytest.approx(1.6)
    kinds = {choose(state, predicted, ALL, 32, scales).kind for _ in range(20)}
    assert kinds == {"ragged_graph"}
    assert scales.estimate("padded", 2.0, 1.5) == 3.0  # not timed anywhere: this shape's scale


def test_in_training_an_arm_timed_nowhere_takes_the_timed_arms_scale():
    """Training timings hold the backward the forward-only prior leaves out, every arm's alike: an arm the module never
    timed is scaled as the timed ones are, so a new shape runs the arm the prior ranks first (priced bare, the padded
    arm looked cheaper than a ragged arm timed at 3x its prior). Inference keeps each arm's own scale."""
    from autoragged.runtime.policy import Scales

    predicted = {"padded": 20.0, "ragged": 10.0}
    for shared, want in ((True, "ragged"), (False, "padded")):
        scales = Scales(shared=shared)
        for _ in range(3):
            scales.observe("ragged", 30.0, 10.0, 5.0)
        state = ShapeState()
        assert choose(state, predicted, {"padded", "ragged"}, 32, scales).kind == want, shared
        assert policy.costs(ShapeState(), predicted, scales)["padded"] == (60.0 if shared else 20.0)


def test_a_mask_only_shapes_first_stats_are_its_batch_sizes_nearest_width_scaled_to_fit():
    """Before its first read, a mask-only shape is predicted with the latest stats of the same batch size at the
    nearest width (and the same mode), every length scaled down where the longest does not fit its padded length."""

    def known(lengths, L):
        state = ShapeState()
        state.stats = BatchStats.from_lengths(lengths, padded_len=L)
        return state

    shapes = {
        ShapeKey(4, 128, True): known((100, 50, 50, 20), 112),
        ShapeKey(4, 256, True): known((200, 10, 10, 10), 200),
        ShapeKey(4, 96, False): known((90, 90, 90, 90), 96),  # lengths came: another mode
        ShapeKey(8, 96, True): known((90,) * 8, 96),  # another batch size
    }
    fitted = new_shape(shapes, ShapeKey(4, 96, True), 80).stats
    want = BatchStats.from_lengths((80, 40, 40, 16), padded_len=80)  # (100, 50, 50, 20) scaled by 0.8
    assert fitted.batch == 4 and fitted.max_len == 80 and fitted.total == want.total and fitted.sum_sq == want.sum_sq
    assert fitted.mean == pytest.approx(want.mean) and fitted.std == pytest.approx(want.std)
    assert fitted.pad_fraction == pytest.approx(want.pad_fraction)
    same = new_shape(shapes, ShapeKey(4, 96, True), 104).stats  # fits: only the padding changes
    assert (same.max_len, same.total) == (100, 220) and same.pad_fraction == pytest.approx(1 - 220 / 416)
    assert new_shape(shapes, ShapeKey(2, 96, True), 80).stats is None  # no width of B=2 known
    assert new_shape(shapes, ShapeKey(4, 64, False), 60).stats is None  # lengths come with the call: read them
