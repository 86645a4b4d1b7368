"""Mask-only batches whose lengths are never read: the verdicts, the probes and the unread arms.

A batch that comes with a CUDA key padding mask alone must read its lengths (a device->host copy, a sync)
before any arm that needs them can run. `UnreadShapes`, a part of `Runtime` (runtime/core.py), keeps per
shape (B and the padded graph's length bucket) whether an arm that needs no lengths (padded, padded graph,
the ragged graph fed the mask) keeps winning with the read's cost counted against the others, runs the
trusted shapes' batches on the mask itself, judges them again one batch behind, and lets timings settle
a verdict: revoked where they contradict it, kept where they confirm it.
"""

from __future__ import annotations

import logging
import time
import weakref

import torch

from .._buckets import mask_rungs_fit, mask_width, padded_bucket
from .._costmodel import PADDED, PADDED_GRAPH, Arm
from .._device import device_key
from .._planner import Plan
from .records import PadsRing, Record, timers

__all__ = ["UnreadShapes"]

log = logging.getLogger("autoragged")

# Mask-only batches: reading lengths from a mask costs a device->host copy and a sync. Once an arm that
# needs no lengths (padded, padded graph, the ragged graph fed the mask) won a shape _TRUST times in a row,
# counting that cost against the others, batches of the shape skip the read and run that arm on the mask
# itself: nothing synchronises. Every _REJUDGE-th unread batch of a shape judges it again from the stats of
# an earlier unread batch that have reached the host (one batch behind, no sync); a shape whose earlier
# batches' stats have not landed after _RECHECK batches reads its lengths.
# The verdicts come from predictions; on the GPU they are checked by timing: the judged batches that read
# lengths and the first _PROBES of a trusted shape run fed the mask are timed with CUDA events (harvested
# later, never blocking), and a shape whose unread arm measured slower than its read path plus the read is
# not trusted again (the mask graph can lose where the model says it wins: H100, Wiki512 B=64, 2026-11-23);
# one measured faster stays trusted whatever later predictions say (`_probe_result`).
# Runtime.mask_reads = "recheck" is the rule before one-batch-behind judging (2026-11-24): exact (B, L)
# shapes, trusted after 3 wins, every 16th batch reading its lengths, the read's cost its own time only.
_TRUST = 2
_TRUST_RECHECK = 3
_RECHECK = 16
_REJUDGE = 8
_MAX_SHAPES = 4096
_PROBES = 3
# Where this device has no calibration, a verdict weighs predictions of the analytic prior (its Triton linears
# run at a fixed 0.7x of cuBLAS) and, in a stream, the drained GPU's idle time that `read_cost_ms` estimates:
# two rough numbers. A mask shape whose mask graph is predicted within _EXPLORE of its read path plus the read
# is then trusted for the probes to settle (`_judge_entry`): once its read path is timed, they time the mask
# graph against it, and a shape whose mask graph measured slower reads from then on. Without it such a shape
# never ran its mask graph, so it was never timed: bert-base, MNLI B=128, predicted 4.3-4.9 ms against 3.3-3.9
# + a read of 0.2-0.5, read 17 of 64 batches (5.80 ms a batch) where the mask graph took 3.07 (H200,
# 2026-11-25, `verdict_trace_mnli_h200.json`). Exploring costs a capture (10-66 ms there) and a few batches on the
# slower arm if it is: a shape explores once its reads have cost _EXPLORE_AFTER_MS (what reading costs its
# batches is what not reading could save), not on first sight. At first sight, in a latency table (HF bert-base,
# 10 calls a batch), the mask graph ran most calls of 16 of 24 rows, up to 1.52x the best forced arm's time
# (MNLI B=64/128; `hf_table_explore_first_sight_h200.json`, same day and card).
# What exploring can win is bounded by what the read costs a batch (the mask graph does the read path's work, with
# Triton linears that rarely beat cuBLAS's), so a shape explores only where the read costs _EXPLORE_SHARE of its
# read path's batch or more; below that the prior's error swamps the gain. In a stream (the host ahead: `pipelined`)
# such a shape explores at its first close verdict, not after _EXPLORE_AFTER_MS: a read there cost the GPU 0.2-0.5
# ms of idle time (`read_cost_ms`, timed by events), so the rent reached 30 ms only after about a hundred reads,
# and the capture and the probes then fell inside a benchmark's timed stream (HF bert-base, RACE, Wiki512, SQuAD
# at B=64: 16-48 ms captures, 0.91-0.96x the eager ragged arm; CoRa RACE B=64, where the mask graph takes 0.96x
# the read path's time, 1.19x its time with lengths=; H100, 2026-11-26, `stream_table_*_full_rows_h100.json`). Where
# every call is synchronised (the latency table above, which first-sight exploring hurt) reads do not wait, and the
# rent applies; calls queued back to back without a sync (that table's three warm-up calls) are a stream.
# The reads' shares: 1-3% on bert-base's B=64 rows of 512 tokens (the mask graph as fast as reading: 11.95 ms
# against 11.97), 6% on SQuAD B=64 (slower: 6.70 against 6.38), 7% on CoRa RACE B=64 (faster: 2.61 against 2.73;
# `verdict_trace_{bert,cora}_rows_h100.json`), 5-14% on bert-base MNLI B=128 (faster, see above). With this rule
# every CoRa stream row met its goals; bert-base's B=64 rows of 384-512 tokens still took 0.90-0.99x the eager arm's
# time from run to run, as their exploring landed before or inside the timed stream
# (`stream_table_bert_full_explore{,2}_h100.json`). A trace of the timed stream itself showed why: a stream weighed
# the share at every close verdict, and the read's cost moves with the host (RACE B=64: 0.27-0.57 ms in the warm-up,
# 2-4% of its 14.3-14.9 ms predictions; 0.63 ms, 0.54 of it host time, at the 31st timed batch, which then explored: a
# capture and a lost probe inside the stream; SQuAD B=64 explored four times; `vt_long64_h100.json`, H100,
# 2026-11-26). So a stream weighs a shape once, at its first close verdict there, and a shape it weighed and left
# is not explored later by the rent either.
_EXPLORE = 1.35
_EXPLORE_AFTER_MS = 30.0
_EXPLORE_SHARE = 0.05
_READ = object()  # `_run_unread`: this batch takes the read path after all
# A mask-only batch that read its lengths, of a shape whose mask graph is kept (and not measured slower), whose
# planned ragged graph is not captured for its bucket: it replays the shape's mask graph (the same work, the
# lengths counted on the device) instead of running eagerly or capturing, until the bucket's _STAND_IN_SIGHTS-th
# sight. A trusted shape reads only when a close verdict flips, so its read path's buckets were rarely seen: on a
# stream of new batches they came once or twice and each paid an eager run or a capture (bert-base, CoLA
# B=128: 4-9 of 64 batches read, 2-3 captures of 20-35 ms; 1.3 ms a batch unread; H100, 2026-11-25).
_STAND_IN_SIGHTS = 8
STOOD_IN = "the read path's graph for this bucket is not captured yet: the shape's graph fed the mask ran"
# A mask read's cost on a GPU until one is timed: on the H100 host bert-base's reads (B 32-64) took 0.20-0.42 ms
# as `sync_ms` timed them, the least of each latency-table row's (2026-11-26, `table_calls_h100.json`).
_READ_PRIOR_MS = 0.2
_WAITED_MS = 0.05  # a read this much slower than the read's own cost waited for queued work: the host is ahead


def _shape_entry(
    streak: int = 0, arm: Arm = PADDED, predicted: dict | None = None, tokens: int = 0, capacity: int = 0,
    bucket: tuple[int, int] | None = None,
) -> list:  # fmt: skip
    """A mask_shapes entry (see Runtime.__init__): a shape judged `streak` times in a row for `arm`; `capacity`:
    the rows of its mask graph (B x mask width; 0: not known), which decide whether it has cuBLAS branches;
    `bucket`: (B, mask width): a timing of its mask graph on one of its shapes settles it for all of them
    (`mask_lost`, `_bucket_won`)."""
    probe = {
        "read": [],
        "unread": [],
        "left": _PROBES,
        "lost": False,
        "confirmed": False,
        "paid": 0.0,
        "explored": False,
        "weighed": False,
    }
    return [streak, arm, 0, predicted or {}, tokens, probe, None, None, capacity, bucket]


class UnreadShapes:
    """The mask-only part of `Runtime` (its state lives there: mask_shapes, sync_samples, read_events,
    prelaunch, pipelined, pads_ring; see Runtime.__init__)."""

    @property
    def sync_ms(self) -> float:
        """The read's own cost: the least of the recent reads' own times (`_read_timed`). A read also waits
        for the work queued before it (the first one for compiles and captures: 30-100 ms on the H100 host),
        which is not the read's doing; an average of those had every shape skip its reads. On a GPU before any
        read was timed, `_READ_PRIOR_MS`."""
        if self.sync_samples:
            return min(self.sync_samples)
        return _READ_PRIOR_MS if self.read_events is not None else 0.0

    def _read_begin(self, kpm: torch.Tensor) -> list | None:
        """Before a mask read on a GPU: CUDA events around it, the start recorded behind the queued work (so it
        fires when that work is done, not when the read is called), and the previous read's own time taken
        from its pair (they fired long since; `_read_timed`). None on a CPU."""
        if not kpm.is_cuda:
            return None
        events = self.read_events
        if events is None or events[2] != kpm.device:
            start, end = timers(kpm.device)
            events = self.read_events = [start, end, kpm.device, False]
        else:
            self._read_harvest()
        events[3] = False
        events[0].record()
        return events

    def _read_harvest(self) -> None:
        """The last read's own time into `sync_samples`, where its event pair has fired (no wait)."""
        events = self.read_events
        if events is not None and events[3] and events[1].query():
            self.sync_samples.append(events[0].elapsed_time(events[1]))
            events[3] = False

    def _read_timed(self, ms: float, cuda: bool, events: list | None = None) -> None:
        """A mask read took `ms` of host time; `events`: its pair from `_read_begin` (a GPU). On a CPU the host
        time is the read's own cost, and a slow read is the host's noise: nothing is queued. On a GPU a read
        waits for the batches queued before it, so its own cost is the time from their end (the start event)
        to the read's end, taken at the next read (`_read_begin`: no wait for the events here); a read whose host
        time exceeds that cost waited, so the host runs ahead of the GPU. Host times alone overstated the read in
        a stream: every read there waits for queued work, so the least of 16 was 0.3-1.8 ms where a read cost the
        stream 0.44 ms, and the mask graph won verdicts it lost by 3% (bert-base, SQuAD B=64; H100, 2026-11-26,
        `verdict_trace_bert_squad64_h100.json`). Until an event pair is in, the read costs `_READ_PRIOR_MS`.

        The module's first read on a GPU counts for nothing: it pays one-time costs (its kernels' first
        launches, the first batch's compiles queued before it), its events too. Taken as the read's cost (its
        host time then stood for it), it made every read cost 21 ms in a latency table, where each call is
        synchronised and no later read came before a shape's verdicts: the mask graph "won even counting the
        read" where it took 1.13x the cuBLAS graph fed lengths (HF bert-base, SQuAD B=64, its mask graph of
        Triton linears; H100, 2026-11-26, `table_calls_h100.json`)."""
        if not cuda:
            self.sync_samples.append(ms)
            self.pipelined = False
            return
        if not self.read_seen:
            self.read_seen = True  # (its pair is left unfinished: `_read_begin` takes no sample from it)
            self.pipelined = False
            return
        if events is not None:
            events[1].record()
            events[3] = True
        self.pipelined = ms > self.sync_ms + _WAITED_MS

    @property
    def read_cost_ms(self) -> float:
        """What reading a mask's lengths costs a batch: the read itself (`sync_ms`) and, while the host runs
        ahead of the GPU (the reads wait for queued work), the host time from the read to the arm's work
        queued, the least of the recent ones: the drained GPU idles meanwhile. With every call synchronised
        (a latency benchmark) the GPU idles then whichever arm runs, and only the read itself counts.
        The least, as for the read itself: the median of the host's times moved with its hiccups, 0.38-0.98 ms
        at four verdicts of one shape (bert-base, SQuAD B=64), where reading cost the stream 0.48 ms a batch
        (always reading against `lengths=`, two runs; H100, 2026-11-26, `vt_long64{,_once}_h100.json`), so
        the probes took a mask graph 5% slower than the read path for the faster one."""
        cost = self.sync_ms
        if self.pipelined and self.prelaunch:
            cost += min(self.prelaunch)
        return cost

    @property
    def trust(self) -> int:
        return _TRUST_RECHECK if self.mask_reads == "recheck" else _TRUST

    def _saw_mask(self, B: int, L: int) -> None:
        """Count a mask-only batch of B rows padded to L in `mask_tops` (how wide a new mask graph is made)."""
        top = self.mask_tops.get(B)
        if top is None:
            if len(self.mask_tops) >= _MAX_SHAPES:
                self.mask_tops.clear()
            self.mask_tops[B] = [L, 1, 1]
        elif L > top[0]:
            top[0], top[1], top[2] = L, 1, top[2] + 1
        else:
            top[1] += L == top[0]
            top[2] += 1

    def _adopt(self, B: int, L: int) -> list | None:
        """A mask shape's first batch, where a trusted shape of its batch size runs the mask graph (not timed
        slower, not on trial: `explored`) and that graph, kept, serves this batch's width: the new shape takes
        that verdict (entered trusted) and runs unread on the graph, with no read; one batch behind it is
        judged on its own stats (`_one_behind`). Without it each new shape read its mask once, and its read
        path's graph bucket, at first sight, ran eagerly or captured inside the stream (CoRa, XNLI B=64: a
        batch of L 103, a new shape beside L 110-127, all of mask width 128; CoLA B=32: L 33 after 20-32, 6.9
        ms of GPU time against 0.24 a batch; H100, 2026-11-26, `vt2_cora_short_h100.json`). Only while the host
        runs ahead of the GPU (`pipelined`), where a read drains the GPU: the new shape runs on a graph whose
        cuBLAS branches were cut for the other shape's tokens (its own are not known unread), and with calls
        synchronised, where a read costs only itself, a shape judged on its own got a graph fitted to its
        batches: the benchmark of record's CoRa MNLI B=64 took 0.58 ms a call adopting, 0.47-0.56 judged (H100,
        2026-11-26, `cora_ab3_*_h100.json`). None where no such shape is."""
        if self.mask_reads == "recheck" or self.graphs is None or not self.pipelined:
            return None
        width = mask_width(L)
        for entry in self.mask_shapes.values():
            kept, probe = entry[6], entry[5]
            if kept is None or entry[9] is None or entry[9][0] != B or entry[0] < self.trust:
                continue
            if not entry[1].mask_only or probe["lost"] or entry[9] in self.mask_lost:
                continue
            if probe["explored"] and not probe["confirmed"]:
                continue
            graph = kept[0]() if self.graphs.generation == kept[1] else None
            if graph is None or not width <= graph.width <= 2 * width:
                continue
            key = self._shape_key(B, L)
            if len(self.mask_shapes) >= _MAX_SHAPES:
                return None
            new = self.mask_shapes[key] = _shape_entry(
                self.trust, entry[1], entry[3], entry[4], B * width, (B, width)
            )  # fmt: skip
            return new
        return None

    def _shape_key(self, B: int, L: int) -> tuple[int, int]:
        """A mask-only shape: B and the padded bucket's length (the unread graphs' bucket), or (B, L) under
        mask_reads="recheck". Over 100 batches of each CoRa row but Wiki128 (whose lengths all reach 128), the
        batch's L took 10-56 values, the most common in 6-21% of the batches, so three verdicts in a row for one
        (B, L) were rare and nearly every mask was read; the bucket's length took 1-5 values."""
        return (B, L) if self.mask_reads == "recheck" else (B, padded_bucket(B, L)[1])

    def _read_known(self, shape: list, kpm: torch.Tensor) -> bool:
        """Where probes run (CUDA, sampling on), a trusted shape whose unread arm is a padded one runs unread
        only once its read path has been timed: the probes that revoke a wrong verdict (`_probe_result`)
        compare the unread arm against that time, and a read path that captured a graph was not timed.
        Without it a verdict from the prior that was wrong stood until the next scheduled read (HF bert-base,
        Wiki128 B=32: the padded arm, predicted faster, ran 6.3 ms a batch where the read path's graph took
        2.1; H100, 2026-11-24). The ragged graph fed the mask does the read path's work without the read, so
        its verdict does not wait: waiting cost the benchmark of record's short rows 5-10% (a latency table
        times calls 4-13 of a batch; old and new code alternated in one lease, `cora_ab_*.json`)."""
        explored = shape[5]["explored"] and not shape[5]["confirmed"]  # (an explored arm waits for the timing too)
        return (
            (shape[1].ragged and not explored) or bool(shape[5]["read"]) or not (kpm.is_cuda and self.sample_every > 0)
        )

    def _one_behind(self, device: torch.device, shape: list) -> None:
        """Judge a trusted shape again, without a sync, from the stats of its first unread batch since the last
        verdict, once they are on the host and _REJUDGE unread batches have run since (so they have landed).
        Not before a read was timed: the verdict weighs the read's cost (the last read's, if its events have
        fired: a trusted shape may read no more)."""
        record = shape[7]
        if record is None or shape[2] < _REJUDGE or self.mask_reads == "recheck":
            return
        self._read_harvest()
        if not self.sync_samples:
            return
        stats = record.peek()
        if stats is None:
            return
        ring = self.pads_ring
        if ring is not None and ring.device == device:  # is the previous unread batch still queued on the GPU?
            from .graphs import event_pending

            self.pipelined = event_pending(ring.events[ring.i])
        plan = self._plan(device, stats, None)
        mask_arm = self._mask_graph_arm(device, plan)
        self._judge_entry(shape, plan.predicted_ms, mask_arm, stats.total, self._explores(device))

    def _mask_graph_arm(self, device: torch.device, plan: Plan) -> Arm | None:
        """The ragged graph arm that can run a mask without its lengths (Triton linears: they stop at the
        rows the graph counts on the device) as `plan` (a `Plan`) predicted it, or None where graphs do not
        run. Fed the mask or the lengths it does the same work, so the batch's own prediction for it holds
        for either."""
        if not (self.graphs_enabled and device.type == "cuda" and self.body.mask_graph):
            return None
        return plan.mask_arm

    def _mask_graph_ms(self, predicted: dict[str, float], mask_arm: Arm, capacity: int = 0) -> float:
        """The prediction for the ragged graph fed the mask (of `capacity` rows; 0: not known): its Triton
        linears' (the planner's, for `mask_arm`), or, where its graph holds cuBLAS branches on rungs of rows
        (`mask_rungs`, a capacity `mask_rungs_fit` takes: the batches of a shape fill rows near the judged
        batch's, where the branches are), the cuBLAS graph's where that is less (the same work on the same
        rung, the lengths counted on the device)."""
        ms = predicted[mask_arm.label]
        if self.mask_rungs and mask_rungs_fit(capacity):
            cublas = Arm(mask_arm.kind, mask_arm.config.replace(backend="cublas")).label
            ms = min(ms, predicted.get(cublas, ms))
        return ms

    def _explores(self, device: torch.device) -> bool:
        """Whether close mask verdicts on `device` may be left to the probes (see _EXPLORE): probes run there
        (CUDA, sampling on) and its planner predicts from the analytic prior."""
        if not (device.type == "cuda" and self.sample_every > 0):
            return False
        planner = self.planners.get(device)
        return planner is not None and planner.model.name == "prior"

    def _judge_shape(
        self, B: int, L: int, predicted: dict[str, float], mask_arm: Arm | None = None, tokens=0, explore=False
    ):  # fmt: skip
        """Would an arm that needs no lengths (the padded arms, or `mask_arm` fed the mask) have won this
        mask-only batch of `tokens` real tokens, counting the read's cost against the arms that need them?
        Returns the shape's entry, updated. explore: see `_judge_entry`."""
        key = self._shape_key(B, L)
        if len(self.mask_shapes) >= _MAX_SHAPES and key not in self.mask_shapes:
            self.mask_shapes.clear()
            self.mask_lost.clear()
            self.mask_won.clear()
        entry = self.mask_shapes.get(key)
        if entry is None:
            width = mask_width(L)
            entry = self.mask_shapes[key] = _shape_entry(capacity=B * width, bucket=(B, width))
        return self._judge_entry(entry, predicted, mask_arm, tokens, explore)

    def _bucket_won(self, bucket: tuple[int, int] | None) -> bool:
        """Whether the probes of a shape of the (B, mask width) bucket, or of one up to 2x wider (whose graph
        serves this one's batches: `GraphCache.mask_serving`), timed the mask graph faster than the read path
        plus the read (`mask_won`), and none of this bucket timed it slower (`mask_lost`). Its other shapes then
        take the mask graph as that shape does, whatever the predictions: the same graph, batches of like
        sizes. Judged each on the predictions, they read their lengths: HF bert-base, SQuAD B=64 (shapes of
        L 321-336 and 337-368, one mask graph), one shape confirmed and on it, the other reading its lengths at
        each of its batches (about 12 of 64); and each new shape read once, which in a stream of short batches cost
        more than the other batches' difference: CoRa, XNLI B=64, the one batch of a new shape in 64 read, its
        capture took 10 ms, and the stream 1.13-1.26x its time with lengths= (H100, 2026-11-26)."""
        if bucket is None or not self.mask_won or bucket in self.mask_lost or self.mask_reads == "recheck":
            return False
        B, width = bucket
        return any(b == B and width <= w <= 2 * width for b, w in self.mask_won)

    def _judge_entry(
        self, entry: list, predicted: dict[str, float], mask_arm: Arm | None, tokens: int, explore: bool = False
    ) -> list:
        """The verdict of `_judge_shape` on `entry`. explore (`_explores`): a mask graph predicted to lose by
        less than _EXPLORE, of a shape whose read costs _EXPLORE_SHARE of its batch or more and whose reads cost
        _EXPLORE_AFTER_MS (in a stream: at its first close verdict there, and only then), wins while the shape's
        probes have not timed it, so that they do."""
        unread = {k: v for k, v in predicted.items() if k in ("padded", "padded_graph")}
        mask_label = mask_arm.label if mask_arm is not None else None
        # the arms the read path may run (the planner never runs the mask arm on read lengths: Arm.mask_only)
        needs_lengths = [v for k, v in predicted.items() if k not in unread and k != mask_label]
        if mask_label in predicted and entry[9] not in self.mask_lost:  # (timed slower on a shape of its bucket)
            unread[mask_label] = self._mask_graph_ms(predicted, mask_arm, entry[8])
        best = min(unread, key=unread.get) if unread else None
        read_ms = min(needs_lengths) + self.read_cost_ms if needs_lengths else None
        wins = best is not None and (read_ms is None or unread[best] <= read_ms)
        entry[2], entry[7] = 0, None  # a verdict: the unread batches since, and the one to judge from, start anew
        probe = entry[5]
        if probe["confirmed"] and not probe["lost"]:
            wins, best = True, None  # timed runs found the kept arm faster: predictions do not overrule them
        elif mask_label in unread and not probe["lost"] and self._bucket_won(entry[9]):
            wins, best = True, mask_label  # as a shape of its bucket, timed: trusted at this verdict
            entry[0] = max(entry[0], self.trust - 1)
        elif not wins and read_ms is not None:
            cost = self.read_cost_ms
            probe["paid"] += cost  # this batch reads
            close = mask_label in unread and len(probe["unread"]) < 2 and unread[mask_label] <= read_ms * _EXPLORE
            if explore and close:  # from the prior: the probes would time it and settle the shape
                # in a stream, weighed once, at the shape's first close verdict there; with calls synchronised,
                # once its reads paid the rent (unless a stream weighed it). Explored, it is trusted at once and
                # stays on trial (`on_trial`) until its probes have timed it: weighed once and trusted after two
                # verdicts, a stream's explored shape fell back at its next one and never ran the mask graph, so it
                # read every batch (CoRa, SQuAD B=64, 1.49 ms a batch where the mask graph took 1.41; H100,
                # 2026-11-26, `vt3_cora_short_h100.json`)
                on_trial = probe["explored"]
                weigh = not probe["weighed"] and (self.pipelined or probe["paid"] >= _EXPLORE_AFTER_MS)
                probe["weighed"] = probe["weighed"] or self.pipelined
                if on_trial or (weigh and cost >= _EXPLORE_SHARE * (read_ms - cost)):
                    wins, best = True, mask_label
                    probe["explored"] = True
                    entry[0] = max(entry[0], self.trust - 1)
        if wins and not probe["lost"]:
            entry[0] += 1
            arm = {"padded": PADDED, "padded_graph": PADDED_GRAPH}.get(best, mask_arm) if best else entry[1]
            if arm.mask_only and entry[1].mask_only:
                # the mask graph with other attention tiles (they follow the batch's max_len, which a mask
                # shape's batches do not share): the same arm for the shape, its graph and timings kept
                arm = entry[1]
            if arm != entry[1]:  # another arm: its timings start afresh, and its graph is not the one kept
                probe.update(
                    read=[], unread=[], left=_PROBES, confirmed=False, explored=best == mask_label and probe["explored"]
                )
                entry[6] = None
            entry[1] = arm
            entry[3], entry[4] = predicted, tokens
        else:
            entry[0] = 0
        return entry

    def _run_unread(self, module, call, shape: list):
        """A mask-only batch of a shape (its `mask_shapes` entry) where an arm that needs no lengths wins: run
        it on the mask, lengths never read. The record carries the predictions of the shape's last judged
        batch (of `tokens`). The shape's first `_PROBES` runs that replay (not capture) are timed for
        `_probe_result`, from after the call's prefetch, as the read path's runs are timed. Once the arm's
        graph ran, the entry keeps it for `_replay_unread`, which times the rest of those runs itself. `_READ`
        where the arm is the ragged graph and it is not captured (yet): the batch takes the read path, whose
        arm the verdict ranked just behind it, instead of the padded arm, which may be far behind (HF bert-base,
        CoLA B=32: 7 ms, the read path 1.9; H100, 2026-11-24)."""
        arm, predicted, tokens, probe = shape[1], shape[3], shape[4], shape[5]
        B, L = call.B, call.L
        why = f"{arm.kind} fed the mask wins on this (B, L) even counting the mask read; lengths not read"
        cuda = call.device.type == "cuda"
        timed = probe["left"] > 0 and cuda and self.sample_every > 0
        if timed:
            if not arm.ragged or call.graph_inputs() is None:  # (the embeddings in the graph: none to queue)
                call.prefetch()
            captures = self.graphs.captures if self.graphs is not None else 0
            start, end = timers(call.device)
            start.record()
            host0 = time.perf_counter()
        costs = None
        if self.capture_policy and arm.graph and "padded" in predicted and arm.label in predicted:
            costs = (predicted["padded"], predicted[arm.label])  # without the graph the padded arm runs the mask
        ran = self._execute_unread(module, call, arm, tokens, costs, read_instead=True)
        if ran is _READ:
            return _READ
        self.count += 1
        out, pads, width, note, graph = ran
        graphs = self.graphs
        if graphs is not None and graphs.deferred is not None:  # the batch's eager run is queued: capture now
            extra = graphs.capture_deferred()
            note = note and note + extra
        if timed and note is None and (self.graphs.captures if self.graphs is not None else 0) == captures:
            end.record()
            probe["left"] -= 1
            host_ms = (time.perf_counter() - host0) * 1e3
            self.pending.append((start, end, host_ms, None, call.device, False, (probe, B, L, "unread")))
        if note is not None:
            arm, why = PADDED, f"{why}; {note}"
        record = Record(None, arm, predicted, why, device_key(call.device), self.sig_key)
        if pads.is_cuda and (self.pads_ring is None or self.pads_ring.device != pads.device):
            self.pads_ring = PadsRing(pads.device)
        if graph is not None:
            shape[6] = (weakref.ref(graph), self.graphs.generation, why, record.device)
        if shape[7] is None:
            shape[7] = record  # the batch whose stats judge the shape again (`_one_behind`)
        return self._unread_done(record, pads, width, B, L, out)

    def _stand_in(self, module, call, shape: list):
        """(the shape's kept mask graph, the call's graph inputs) for a batch of the shape that read its lengths
        (see _STAND_IN_SIGHTS), or None: the shape's arm is not the mask graph, measured slower, or its graph is
        not kept or cannot take this call."""
        if shape[6] is None or not shape[1].mask_only or shape[5]["lost"] or self.graphs is None:
            return None
        if shape[9] in self.mask_lost:
            return None
        self.graphs._check_params(self._parameters(module))
        return self._kept_graph(call, shape)

    def _kept_graph(self, call, shape: list):
        """(the graph shape[6] keeps, the call's graph inputs or None) where it is still cached and can replay
        this call, else None."""
        ref, generation = shape[6][0], shape[6][1]
        graph = ref() if self.graphs.generation == generation else None
        if graph is None or call.kpm.shape != (call.B, call.L):
            return None
        inputs = call.graph_inputs() if shape[1].ragged else None
        if graph.inputs != (inputs[0] if inputs is not None else None):  # ids now, x then (or the reverse)
            return None
        return graph, inputs

    def _replay_unread(self, module, call, shape: list):
        """The hot path of a trusted mask-only shape whose arm's graph is captured (`shape[6]`): the fewest
        steps before the replay, because a short batch's latency is the host time before its replay plus
        the GPU's. One of the shape's first `_PROBES` runs is timed here (events around the replay, harvested
        later): through the general path, each took its graph lookup's host time too, 3 of a latency table's 7
        timed calls of a batch (HF bert-base, CoLA B=32: 0.907 ms a call, 0.826 replayed by this path alone;
        H100, 2026-11-26, `hf_table_adopt_h100.json`, `hf_table.py --host-profile`). None when this batch must
        take the general path instead: the shape is not trusted, it is due a read, or its read path must be
        timed first (`_read_known`), something differs (`_dynamic_reason`, the input), or the graph left the
        cache."""
        why, device = shape[6][2], shape[6][3]
        graphs = self.graphs
        since = shape[2] + 1
        probe = shape[5]
        timed = probe["left"] > 0 and self.sample_every > 0  # one of the shape's first runs, timed for the probes
        if (
            shape[0] < self.trust or since >= _RECHECK
            or (since >= _REJUDGE and shape[7] is not None and self.mask_reads != "recheck")  # `_one_behind` is due
            or graphs is None or graphs.generation != shape[6][1] or not self.graphs_enabled or self.policy != "auto"
            or call.passthrough is not None or call.ragged_in is not None or call.eager_only is not None
        ):  # fmt: skip
            return None
        if call.kpm.shape != (call.B, call.L):
            return None
        if timed and not (call.kpm.is_cuda and self._read_known(shape, call.kpm)):
            return None
        if self.static_reason or self._dynamic_reason(module, call) is not None:
            return None
        graphs._check_params(self._parameters(module))
        kept = self._kept_graph(call, shape)  # (parameters moved: the graphs are gone)
        if kept is None:
            return None
        graph, inputs = kept
        shape[2] += 1
        self.count += 1
        x = call.x if inputs is None else None  # (embeddings outside the graph: made before a timing starts)
        if timed:  # timed here, not by the general path: its host time (a graph lookup) is not the arm's
            start, end = timers(call.device)
            start.record()
            host0 = time.perf_counter()
        out = graph.run_mask(x, call.kpm) if inputs is None else graph.run_mask_ids(inputs[1], inputs[2], call.kpm)
        if timed:
            end.record()
            probe["left"] -= 1
            host_ms = (time.perf_counter() - host0) * 1e3
            self.pending.append((start, end, host_ms, None, call.device, False, (probe, call.B, call.L, "unread")))
        graphs.graphs.move_to_end(graph.key)  # most recently used
        graphs.touch(graph.key)  # its recurrence, for a recapture after an eviction
        record = Record(None, shape[1], shape[3], why, device, self.sig_key)
        if shape[7] is None:
            shape[7] = record
        return self._unread_done(record, graph.pads, graph.width, call.B, call.L, call.finish(out))

    def _execute_unread(self, module, call, arm: Arm, tokens: int = 0, costs=None, read_instead: bool = False):
        """(output, per-row pad counts, the columns they count over, None, the graph or None) of an arm run
        on the mask itself (a padded arm, or the ragged graph fed the mask, its tiles picked for `tokens`
        rows when > 0); the note says why it ran eagerly padded instead. costs: (padded ms, the graph's ms)
        for the capture policy (`GraphCache._get`). read_instead: `_READ`, having run nothing, where the
        ragged graph is not there to run."""
        note = None
        device = call.device
        if not arm.graph:
            pass
        elif not self.graphs_enabled:
            note = "graphs are off (wrap(graphs=False))"
        elif self._graph_cache(device) is None:
            note = "CUDA graphs need a GPU"
        elif call.eager_only is not None:
            note = call.eager_only
        else:
            B, L, dtype = call.B, call.L, self._param().dtype
            inputs = call.graph_inputs() if arm.ragged else None  # the embeddings inside the graph
            if arm.ragged:
                graph, note = self.graphs.ragged_mask(
                    self, module, arm.config, False, B, L, dtype, device, tokens or None, costs,
                    inputs[0] if inputs is not None else None, trusted=True,
                )  # fmt: skip
            else:
                graph, note = self.graphs.padded(self, module, B, L, dtype, device, io="mask", costs=costs)
            if graph is not None:
                if inputs is not None:
                    out = graph.run_mask_ids(inputs[1], inputs[2], call.kpm)
                else:
                    out = graph.run_mask(call.x, call.kpm)
                out = call.finish(out) if arm.ragged else call.finish_padded(out)
                return out, graph.pads, graph.width, None, graph
        if read_instead and arm.ragged and (self.graphs is None or self.graphs.deferred is None):
            return _READ  # (a capture deferred to after this batch's eager run keeps the padded arm: see `_get`)
        out = call.padded_mask(module)
        return out, call.kpm.sum(1, dtype=torch.int32), call.L, note, None

    def _probe_result(self, probe: dict, B: int, L: int, kind: str, ms: float) -> None:
        """One timed run of (B, L), `kind` "read" or "unread": once a read run and two unread ones are in, the
        timings judge the shape instead of the predictions. A shape whose unread arm took longer than its read
        path plus the read's cost loses its trust for good; one whose unread arm was faster keeps it
        (`_judge_entry`) whatever later predictions say, until a later timing says otherwise. Predictions
        alone flipped a close shape back and forth: bert-base, MNLI B=128, the mask graph predicted 4.3-4.9 ms
        against 3.1-3.9 for the cuBLAS graph plus a read of 1.0-1.3, so 8 of a stream's 64 batches read their
        lengths (and one captured a graph, 66 ms) where the mask graph took 3.20 ms a batch and reading every
        batch 3.85 (H100, 2026-11-25, `benchmarks/verdict_trace.py`). The read counts as in the verdicts
        (`read_cost_ms`): with the read's own time alone, a shape that read its lengths in a stream of new
        batches lost the drained GPU's idle time from the comparison, and the mask graph its trust."""
        probe[kind].append(ms)
        if len(probe["unread"]) < 2 or not probe["read"] or probe["lost"]:
            return
        unread, read = min(probe["unread"]), min(probe["read"])
        # the read's cost as the verdicts count it: a read path's run is timed from after its read, so in a
        # stream (the host ahead) it leaves out the drained GPU's idle time that `read_cost_ms` adds
        probe["confirmed"] = unread <= read + self.read_cost_ms
        entry = self.mask_shapes.get(self._shape_key(B, L))
        if probe["confirmed"] and entry is not None and entry[5] is probe and entry[1].mask_only and entry[9]:
            self.mask_won.add(entry[9])  # (its bucket's other shapes: `_bucket_won`)
        if not probe["confirmed"]:
            probe["lost"] = True
            if entry is not None and entry[5] is probe:
                entry[0] = 0
                if entry[1].mask_only and entry[9] is not None and self.mask_reads != "recheck":
                    # the mask graph of the shape's bucket lost: so it does for the bucket's other shapes (the
                    # same graph, batches of like sizes), which would each capture it, if not kept, and pay their
                    # own probes to find out (HF bert-base, SQuAD B=64: 28 batches of a 64-batch stream ran on it,
                    # and the stream took 1.15x its time with lengths=; H100, 2026-11-26)
                    self.mask_lost.add(entry[9])
            log.info(
                "autoragged %s: B=%d L=%d fed the mask took %.3f ms, reading lengths %.3f + %.3f ms: reading them",
                self.sig_key, B, L, unread, read, self.read_cost_ms,
            )  # fmt: skip
