"""The step timer's GPU clock (backends/cuda_clock.py): phases hold the device work queued inside them (CUDA GPU).

A phase that only queues a long product and returns, followed by a phase that waits for the device: on the host's
clock the second phase would hold the product's time; on CUDA events the first one does.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (GPU tests need cupy-cuda12x or cupy-cuda13x)")
if not cupy.cuda.is_available():
    pytest.skip("CuPy finds no CUDA GPU", allow_module_level=True)

from colibri_stream.backends.cupy_backend import CupyBackend  # noqa: E402
from colibri_stream.timing import StepTimer  # noqa: E402

pytestmark = pytest.mark.gpu


def test_a_phase_holds_the_device_work_it_queued():
    backend = CupyBackend()
    timer = StepTimer(backend.clock())
    records = []
    timer.add_sink(records.append)
    a = cupy.asarray(np.random.default_rng(0).standard_normal((4096, 4096), dtype=np.float32))
    (a @ a).sum().item()  # compiled and warm
    with timer.phase("step"):
        with timer.device_phase("experts"):
            for _ in range(20):
                a = (a @ a) * np.float32(1e-2)  # queued: returns long before the device is done
        with timer.device_phase("routing"):
            backend.synchronize()  # waits for the products
    seconds = records[0].phase_seconds()
    assert seconds["experts"] > 0.01  # 20 products of 4096^3 take tens of milliseconds
    assert seconds["routing"] < 0.2 * seconds["experts"]
    spans = {span.name: span for span in records[0].spans}
    assert spans["experts"].track == "gpu"
    assert spans["step"].start <= spans["experts"].start <= spans["experts"].end <= spans["routing"].end + 1e-3


def test_marks_inside_a_graph_capture_fall_back_to_the_host():
    clock = CupyBackend().clock()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        inside = clock.mark()
        graph = stream.end_capture()
    assert isinstance(inside, float)
    assert graph is not None
    outside = clock.mark()
    assert clock.seconds([inside]) == [inside]
    assert len(clock.seconds([outside, clock.mark()])) == 2
