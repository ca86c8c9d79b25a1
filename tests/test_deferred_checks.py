"""The deferred out-of-range check of device inputs (stof_tvm.deferred_checks): a count is raised for once it
has arrived, never waited for by a call, always by synchronize(); counts read at once raise at once."""
import numpy as np
import pytest

from stof_tvm.deferred_checks import DeferredRangeChecks

CHECKS = [{"name": "input_ids", "low": 0, "high": 1000}, {"name": "attention_mask", "low": 0, "high": 2}]


class FakeEvent:
    """Stands for a CUDA event: ``query()`` says whether the copy has arrived; ``synchronize()`` makes it so."""

    def __init__(self):
        self.done = False
        self.waited = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited = True
        self.done = True


class GpuLike(DeferredRangeChecks):
    """The deferred path with the copy and the event replaced (no GPU here): every count counts as on the GPU."""

    def __init__(self, depth=3):
        super().__init__(CHECKS, depth)
        self.events = []

    @staticmethod
    def _on_gpu(counts):
        return True

    def _copy_back(self, counts):
        self.events.append(FakeEvent())
        return np.asarray(counts), self.events[-1]


def test_a_bad_count_raises_only_once_it_has_arrived():
    checks = GpuLike()
    checks.record([0, 0], ("input_ids",))
    checks.record([3, 0], ("input_ids",))
    checks.raise_arrived()                         # nothing arrived yet: no wait, no error
    checks.events[0].done = True
    checks.raise_arrived()                         # the good one arrived
    assert not any(event.waited for event in checks.events)
    checks.events[1].done = True
    with pytest.raises(ValueError, match=r"input 'input_ids'.*3 value\(s\) outside.*call 2 of this model"):
        checks.raise_arrived()


def test_synchronize_waits_for_every_pending_count():
    checks = GpuLike()
    checks.record([0, 0], ("input_ids",))
    checks.record([0, 5], ("input_ids", "attention_mask"))
    with pytest.raises(ValueError, match="attention_mask"):
        checks.synchronize()
    assert all(event.waited for event in checks.events)


def test_counts_of_inputs_given_on_the_host_are_ignored():
    checks = GpuLike()
    checks.record([0, 4], ("input_ids",))          # attention_mask came from the host: checked there
    checks.synchronize()


def test_the_oldest_count_is_waited_for_when_too_many_are_pending():
    checks = GpuLike(depth=2)
    for _ in range(3):
        checks.record([0, 0], ("input_ids",))
    assert [event.waited for event in checks.events] == [True, False, False]


def test_counts_not_on_the_gpu_raise_at_once():
    torch = pytest.importorskip("torch")
    checks = DeferredRangeChecks(CHECKS)
    checks.record(torch.tensor([0, 0]), ("input_ids",))
    with pytest.raises(ValueError, match="input 'input_ids'") as error:
        checks.record(torch.tensor([7, 0]), ("input_ids",))
    assert "of this model" not in str(error.value)


def test_load_refuses_an_unknown_check_mode():
    from stof_tvm.runtime import CompiledModel

    with pytest.raises(ValueError, match="check_values"):
        CompiledModel(None, {}, {}, None, {}, check_values="later")
