"""A corrupted ``SharedHits`` for negative controls (``tests/core/test_shared_hits.py``, the engine test).

:class:`ReleasingEveryMark` takes back, after every allocation, every mark of the step, also those
of states the step itself computes: a prompt then starts on a state no row has written yet.
"""

from __future__ import annotations

from boundary_checkpoints.core.shared_hits import SharedHits


class ReleasingEveryMark(SharedHits):
    def marks_to_release(self, request, kwargs):
        return [(set(), None)]  # non-empty, so the manager calls allocated()

    def allocated(self, request, releases):
        for _, marks, _ in self._groups:
            marks.clear()
