"""Graph warm-ups off the traffic's path: one background thread per process runs the graphs' warm-up runs.

Making a graph is a warm-up run (it compiles the Triton kernels, makes handles and allocates: tens to hundreds of
milliseconds of host time) and then the capture, which only records. The warm-up runs here, on a stream of its own,
while the caller's batches go on on arms that are ready; the cache records the graph on the caller's thread
afterwards (graphs/cache.py). A job is a callable that makes and returns a graph; its result (the graph, or the
exception) goes to the job's `done` callback, called on this thread.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading

import torch

__all__ = ["CaptureWorker", "worker"]

log = logging.getLogger("autoragged")


class CaptureWorker:
    """A thread that runs capture jobs one after another (see the module docstring)."""

    def __init__(self):
        self.changes = 0  # bumped when a job starts and when it ends (`busy_since`)
        self.busy = False
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._streams: dict[tuple[int, str], torch.cuda.Stream] = {}

    def stream(self, device, purpose: str = "warm") -> torch.cuda.Stream:
        """The stream on `device` for the graphs' warm-up runs (`purpose` "warm", this thread's) or for their
        captures ("capture", the callers' threads): two streams, since a capture takes in whatever any thread
        queues on its stream meanwhile (a warm-up run queued there broke the capture of another graph)."""
        index = torch.device(device).index
        index = torch.cuda.current_device() if index is None else index
        stream = self._streams.get((index, purpose))
        if stream is None:
            stream = self._streams[(index, purpose)] = torch.cuda.Stream(index)
        return stream

    def note(self) -> None:
        """One-time work on the caller's thread (a training graph's warm-up and capture): like a job's start, it
        makes the batch that ran it no timing of its arm (`runtime.records.quiet_mark`)."""
        self.changes += 1

    def submit(self, make, done) -> None:
        """Run `make()` on the worker thread, then `done(graph, None)` or `done(None, exception)`."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="autoragged-capture", daemon=True)
                self._thread.start()
        self._jobs.put((make, done))

    def drain(self) -> None:
        """Return once every job submitted so far has run (`autoragged.warmup`, the tuner, tests)."""
        if self._thread is not None:
            self._jobs.join()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            make, done = job
            self.busy, self.changes = True, self.changes + 1
            try:
                graph, error = make(), None
            except Exception as e:  # noqa: BLE001 - any failure: the batch's key runs eagerly, and says why
                graph, error = None, e
            finally:
                self.busy, self.changes = False, self.changes + 1
            try:
                done(graph, error)
            finally:
                self._jobs.task_done()

    def stop(self) -> None:
        """End the thread once the queued jobs are done (at interpreter exit: no capture is cut off mid-way)."""
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=30)


worker = CaptureWorker()
atexit.register(worker.stop)
