"""bench/memory_at_peak.py's replay of the caching allocator's trace, on a hand-made trace: the peak, the blocks
live at it and their grouping by the allocating line of this repository."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from memory_at_peak import group_by_site, live_at_peak, site  # noqa: E402

MODEL = [{"filename": "/x/torch/nn/functional.py", "line": 9, "name": "linear"},
         {"filename": "/repo/launch/model.py", "line": 120, "name": "forward"}]
HEAD = [{"filename": "/repo/kernels/lm_head/fused.py", "line": 77, "name": "group"}]
TORCH = [{"filename": "/x/torch/autograd/graph.py", "line": 5, "name": "_engine_run_backward"}]


def ev(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_site_is_the_innermost_frame_of_this_repository():
    assert site(MODEL) == "launch/model.py:120 forward"
    assert site(HEAD) == "kernels/lm_head/fused.py:77 group"
    assert site(TORCH) == "/x/torch/autograd/graph.py:5 _engine_run_backward"
    assert site([]) == "(no frame)"


def test_replay_finds_the_peak_and_what_is_live_at_it():
    # baseline 100; +40 (140) +30 (170) -40 (130) +50 (180: the peak, at event 4) -30 -50; a pre-trace block's
    # free (-60) and a later smaller rise (+60 → 110) do not move it; segment events are ignored
    trace = [ev("segment_alloc", 0, 1000), ev("alloc", 1, 40, MODEL), ev("alloc", 2, 30, HEAD),
             ev("free_requested", 1, 40, MODEL), ev("alloc", 3, 50, MODEL), ev("free_completed", 1, 40),
             ev("free_requested", 2, 30), ev("free_requested", 3, 50), ev("free_requested", 9, 60),
             ev("alloc", 4, 60, TORCH)]
    peak, at, live = live_at_peak(trace, baseline=100)
    assert (peak, at) == (180, 4)
    assert sorted(live) == [2, 3]
    assert group_by_site(live) == [("launch/model.py:120 forward", 50, 1),
                                   ("kernels/lm_head/fused.py:77 group", 30, 1)]


def test_a_trace_that_never_rises_above_its_baseline_peaks_at_the_baseline():
    peak, at, live = live_at_peak([ev("free_requested", 1, 10), ev("alloc", 2, 5, MODEL)], baseline=20)
    assert (peak, at, live) == (20, -1, {})
