"""benchmarks/step_trace.py's summary of a trace, on a hand-made one (the tracer itself needs CUDA)."""

from benchmarks.step_trace import MARKER, _covered, device_kind, summarise


def _call(name, ts, dur, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def _kernel(name, ts, dur, correlation):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def test_steps_are_cut_at_the_markers_and_summed_by_kind():
    events = [
        _call("cudaLaunchKernel", 0, 1, 1), _kernel(MARKER, 1, 1, 1),  # step 0 ("run") starts at 0
        _call("cuLaunchKernelEx", 10, 5, 2), _kernel("_tile_shrink_kernel", 20, 30, 2),
        _call("cudaStreamSynchronize", 20, 60, 3),
        _call("cudaLaunchKernel", 100, 1, 4), _kernel(MARKER, 101, 1, 4),  # step 1 ("launched") starts at 100
        _call("cudaGraphLaunch", 110, 10, 5), _kernel("_row_expand_kernel", 150, 20, 5),
        _kernel("ampere_bf16_gemm", 160, 40, 5),  # overlaps the expand: busy counts 150..200 once
        _call("cudaLaunchKernel", 300, 1, 6), _kernel(MARKER, 301, 1, 6),  # the end
    ]
    summary = summarise({"traceEvents": events}, ["run", "launched"])
    run, launched = summary["run"], summary["launched"]
    assert (run.steps, run.wall_ms, launched.wall_ms) == (1, 0.1, 0.2)
    assert run.calls["cudaStreamSynchronize"] == [1, 0.06]
    assert dict(run.device_ms) == {"lora tiles": 0.03}
    assert dict(launched.device_ms) == {"lora rows": 0.02, "matmuls": 0.04}
    assert abs(run.busy_ms - 0.03) < 1e-9  # the shrink; markers do not count
    assert abs(launched.busy_ms - 0.05) < 1e-9
    text = "\n".join(run.describe("run"))
    assert "cudaStreamSynchronize: 1.0 calls, 0.06 ms" in text


def test_covered_is_the_union_within_the_window():
    intervals = [(0.0, 10.0), (5.0, 20.0), (30.0, 40.0)]
    assert _covered(intervals, 8.0, 35.0, 15.0) == 12.0 + 5.0
    assert _covered(intervals, 50.0, 60.0, 15.0) == 0.0


def test_device_kinds_tell_tiles_from_rows():
    assert device_kind("_tile_expand_kernel") == "lora tiles"
    assert device_kind("_row_shrink_kernel") == "lora rows"
    assert device_kind("nvjet_tst_64x8") == "matmuls"


def test_the_tracer_times_every_steps_phases_and_puts_the_methods_back(make_engine, tmp_path):
    import gc

    from benchmarks.step_trace import StepTracer
    from loraplex.params import SamplingParams

    engine = make_engine()
    schedule = engine.scheduler.schedule

    def collecting_schedule():  # an instance attribute before the tracer's: it must be put back
        gc.collect()
        return schedule()

    engine.scheduler.schedule = collecting_schedule
    engine.add_request([1, 2, 3, 4], SamplingParams(max_new_tokens=4, ignore_eos=True))
    with StepTracer(engine, first=10**6, count=1, path=str(tmp_path / "never.json.gz")) as tracer:
        while engine.has_unfinished:
            engine.step()
    assert "step" not in vars(engine) and engine.scheduler.schedule is collecting_schedule
    assert not (tmp_path / "never.json.gz").exists()  # the window was never reached: no profiler, no trace
    steps = sum(tracer.phase_steps.values())
    assert steps >= 4 and tracer.phase_steps["run"] >= 1
    run = tracer.phase_ms["run"]
    assert {"schedule", "forward", "sample", "update", "gc (generation 2)"} <= set(run)
    assert sum(v for k, v in run.items() if k not in ("step", "schedule")) <= run["step"]
    assert "gc (generation 2)" in "\n".join(tracer.describe_phases())
