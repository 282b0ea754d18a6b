"""When waiting requests join running ones (engine/scheduling/joins.py, LoRAX's max-waiting-tokens and waiting-served-ratio):
the rule, the scheduler that follows it, and the engine that turns it on only where decode steps are graphs."""

import pytest

from loraplex.engine.scheduling.joins import WaitingJoins
from loraplex.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from tests.unit.test_scheduler import make_request, run_step


def decoding(scheduler: Scheduler, count: int, prefix: str = "r") -> None:
    """`count` requests admitted and past their prompts (each step from now on is decode-only)."""
    for i in range(count):
        scheduler.add(make_request(f"{prefix}{i}", 4, max_new=100))
    run_step(scheduler)
    assert len(scheduler.running) == count and not scheduler.waiting


def waiting_scheduler(max_waiting_steps: int = 3, ratio: float = 1.5, **config) -> Scheduler:
    s = Scheduler(SchedulerConfig(num_blocks=400, block_size=4, **config))
    s.joins = WaitingJoins(max_waiting_steps, ratio)
    return s


def test_by_default_a_waiting_request_joins_at_the_next_step():
    s = Scheduler(SchedulerConfig(num_blocks=100, block_size=4))
    decoding(s, 4)
    s.add(make_request("late", 3))
    assert run_step(s)["late"] == 3


def test_a_lone_arrival_waits_until_the_steps_run_out_then_joins():
    s = waiting_scheduler(max_waiting_steps=3)
    decoding(s, 4)  # that step admitted them: the count starts again
    s.add(make_request("late", 3))
    for _ in range(3):  # 1 waiting < 1.5 x 4 running: decode-only steps
        assert run_step(s) == {f"r{i}": 1 for i in range(4)}
    assert run_step(s)["late"] == 3  # no join for 3 steps: it joins
    assert run_step(s) == {**{f"r{i}": 1 for i in range(4)}, "late": 1}


def test_a_long_queue_joins_at_once():
    s = waiting_scheduler(max_waiting_steps=50, ratio=1.5)
    decoding(s, 2)
    s.add(make_request("a", 3))
    s.add(make_request("b", 3))
    assert "a" not in run_step(s)  # 2 waiting < 1.5 x 2 running
    s.add(make_request("c", 3))  # 3 waiting >= 3: all join
    assert {k: v for k, v in run_step(s).items() if k in "abc"} == {"a": 3, "b": 3, "c": 3}


def test_a_step_that_runs_a_prompt_chunk_anyway_takes_waiting_requests():
    s = waiting_scheduler(max_waiting_steps=1, max_batch_prefill_tokens=10)
    decoding(s, 2)
    s.add(make_request("long", 15))
    assert "long" not in run_step(s)  # 1 waiting < 1.5 x 2 running, no step waited yet
    assert run_step(s)["long"] == 10  # waited a step: joins, its prompt chunked
    s.add(make_request("late", 3))
    step = run_step(s)  # "long" computes its last chunk, so the step is eager anyway: "late" joins, not waiting
    assert (step["long"], step["late"]) == (5, 3)


def test_with_nothing_running_a_request_joins_at_once_and_after_a_quiet_stretch_too():
    s = waiting_scheduler(max_waiting_steps=3)
    s.add(make_request("first", 3, max_new=20))
    assert run_step(s) == {"first": 3}
    for _ in range(5):  # a quiet stretch: no one waits
        run_step(s)
    s.add(make_request("late", 3))
    assert run_step(s)["late"] == 3  # 5 steps without a join >= 3


@pytest.mark.parametrize("waiting,running,eager,steps,due", [
    (1, 0, False, 0, True),  # nothing running
    (1, 4, True, 0, True),  # the step is eager anyway
    (6, 4, False, 0, True),  # 6 >= 1.5 x 4
    (5, 4, False, 0, False),
    (5, 4, False, 2, False),
    (5, 4, False, 3, True),  # waited its steps
])
def test_the_rule(waiting, running, eager, steps, due):
    joins = WaitingJoins(3, 1.5, steps_waited=steps)
    assert joins.due(waiting, running, eager) is due
    assert WaitingJoins(0, 1.5).due(waiting, running, eager)  # 0: at every step


def test_an_engine_without_decode_graphs_lets_requests_join_at_every_step(make_engine):
    engine = make_engine(max_waiting_tokens=7, waiting_served_ratio=2.0)  # CPU: every step is eager
    assert engine.runner.decode_graphs is None and engine.scheduler.joins.max_waiting_steps == 0
    # Where graphs replay decode steps (tests/gpu/test_gpu_decode_graphs.py), the engine takes the config's.


def test_the_cli_flags_reach_the_engine_config():
    from loraplex.cli import _engine_config, build_parser

    args = build_parser().parse_args(["serve", "--max-waiting-tokens", "5", "--waiting-served-ratio", "0.5"])
    config = _engine_config(args)
    assert (config.max_waiting_tokens, config.waiting_served_ratio) == (5, 0.5)
    for bad in (["--max-waiting-tokens", "-1"], ["--waiting-served-ratio", "0"], ["--waiting-served-ratio", "nan"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", *bad])
