"""The out-of-range check of device inputs, read without making the call wait for the GPU.

A module counts, on the device, the token ids of each checked input that fall outside their table (and clamps
them, so nothing is read out of bounds). Reading that count right after the call would wait for the whole
forward pass: the host could no longer prepare the next call while the GPU runs this one, which on the H200 cost
80-230 us per call at batch 1-8 (BENCHMARKS.md, session 6). So the count is copied into pinned host memory on the
call's own stream and an event marks when it is there; the next call looks at the counts that have arrived
(without waiting) and raises for the first bad one, naming the input and how many calls ago it was given.
:meth:`DeferredRangeChecks.synchronize` waits for every pending count and raises likewise: call it where a
result must be known good before it is used (the end of a batch of requests, before returning to a client).

Counts that are not torch CUDA tensors (TVM tensors, host tensors) are read at once, as before.
"""
from __future__ import annotations

import collections

from stof_tvm.call_inputs import count_error, is_torch, read_counts

DEPTH = 8        # pending counts kept before the oldest is waited for (8 forward passes in flight is plenty)


class DeferredRangeChecks:
    """Pending out-of-range counts of earlier calls, oldest first.

    ``checks``: the manifest's value checks (``name``, ``low``, ``high``), in the order of the count output.
    """

    def __init__(self, checks: list[dict], depth: int = DEPTH):
        self.checks = checks
        self.depth = depth
        self.calls = 0                       # calls recorded so far (to say how long ago a bad one was)
        self._pending = collections.deque()  # (call number, names given on the device, host counts, event)
        self._free = []                      # pinned host buffers no pending count uses

    def record(self, counts, on_device: tuple) -> None:
        """Take the module's count output of this call (inputs ``on_device`` were given as device tensors)."""
        self.calls += 1
        if not self._on_gpu(counts):
            message = count_error(self.checks, read_counts(counts), on_device)
            if message is not None:
                raise ValueError(message)
            return
        if len(self._pending) >= self.depth:
            self._finish(self._pending.popleft(), wait=True)
        self._pending.append((self.calls, on_device, *self._copy_back(counts)))

    def _copy_back(self, counts) -> tuple:
        """Start copying ``counts`` (a torch CUDA tensor) into pinned host memory on the current stream; returns
        the host tensor and the event that marks its arrival."""
        import torch

        host = self._free.pop() if self._free else torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def _on_gpu(counts) -> bool:
        return is_torch(counts) and counts.is_cuda

    def raise_arrived(self) -> None:
        """Raise for the first count that has arrived and is not zero; never waits for the GPU."""
        while self._pending and self._pending[0][3].query():
            self._finish(self._pending.popleft(), wait=False)

    def synchronize(self) -> None:
        """Wait for every pending count; raise for the first one that is not zero."""
        while self._pending:
            self._finish(self._pending.popleft(), wait=True)

    def _finish(self, entry, wait: bool) -> None:
        call, on_device, host, event = entry
        if wait:
            event.synchronize()
        numbers = host.tolist()
        self._free.append(host)
        message = count_error(self.checks, numbers, on_device)
        if message is not None:
            raise ValueError(f"{message} (in call {call} of this model, of {self.calls} so far; that call's "
                             f"outputs used the nearest table rows)")
