"""Work before admission is bounded (issue 37): a prompt too long for the model's input is refused by its length in
characters before any tokenizer sees it, and tokenization and /tokenize's answer run on the validation workers,
so six 10 MB prompts and a 10 MB /tokenize neither hold up a concurrent GET /info nor blow up the server's memory."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from loraplex.server.validation import NORMALIZER_SLACK, InputTooLong, Validation
from tests.helpers import live_server_process

BIG = "word " * 2_000_000  # 10 MB: under the 32 MiB body limit
# Tokenizing one 10 MB prompt on the event loop would hold /info for many seconds; parsing eight 10 MB bodies
# beside the test's own eight client threads on two cores was measured to hold it up to 0.6 s.
INFO_DELAY_S = 1.5
RSS_GROWTH_MB = 600  # six 10 MB bodies parsed at once, each a str and its JSON: stated bound on the peak's rise


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_the_character_bound_is_the_input_length_times_the_longest_token():
    bound = Validation(1, max_input_length=10, longest_token_chars=7)
    assert bound.max_chars == 10 * 7 * NORMALIZER_SLACK
    bound.check_length("x" * bound.max_chars, "inputs")
    with pytest.raises(InputTooLong, match="inputs has 141 characters, more than 10 tokens") as refused:
        bound.check_length("x" * 141, "inputs")
    assert refused.value.param == "inputs"
    bound.close()


def test_huge_inputs_are_refused_at_once_and_delay_nothing(embedded):
    with live_server_process("--max-concurrent-requests", "16") as (url, proc):
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/info").status_code == 200
            small = client.post("/tokenize", json={"inputs": "Hello world"})
            assert [t["text"] for t in small.json()] == ["Hello", " world"]
            before = peak_rss_mb(proc.pid)
            answers, delays, done = [], [], threading.Event()

            def send(path: str, body: dict) -> None:
                with httpx.Client(base_url=url, timeout=60) as own:
                    answers.append((path, own.post(path, json=body)))

            def watch_info() -> None:
                with httpx.Client(base_url=url, timeout=60) as own:
                    while not done.is_set():
                        started = time.monotonic()
                        assert own.get("/info").status_code == 200
                        delays.append(time.monotonic() - started)
                        time.sleep(0.02)

            watcher = threading.Thread(target=watch_info)
            watcher.start()
            senders = [threading.Thread(target=send, args=("/generate", {"inputs": BIG})) for _ in range(6)]
            senders.append(threading.Thread(target=send, args=("/tokenize", {"inputs": BIG})))
            senders.append(threading.Thread(target=send, args=("/v1/completions", {"model": "x", "prompt": BIG})))
            for sender in senders:
                sender.start()
            for sender in senders:
                sender.join(timeout=120)
            done.set()
            watcher.join(timeout=60)
            grown = peak_rss_mb(proc.pid) - before
            assert len(answers) == 8
            for path, answer in answers:
                assert answer.status_code == (400 if path.startswith("/v1/") else 422), (path, answer.text[:200])
                assert "characters, more than 4095 tokens (max input length)" in answer.text, answer.text[:200]
            assert delays and max(delays) < INFO_DELAY_S, f"/info waited {max(delays):.2f} s"
            huge_delay = max(delays)
            assert grown < RSS_GROWTH_MB, f"peak RSS rose {grown:.0f} MB"
            # A long input under the bounds (4095 tokens: more is refused) is tokenized on a worker while /info
            # still answers at once; past them it is refused, naming the limit.
            long = " ".join(["word"] * 4_000)
            delays.clear()
            done.clear()
            watcher = threading.Thread(target=watch_info)
            watcher.start()
            for _ in range(10):  # a few: each is quick, and /info is watched meanwhile
                tokens = client.post("/tokenize", json={"inputs": long})
                assert tokens.status_code == 200 and len(tokens.json()) == 4_000
            done.set()
            watcher.join(timeout=60)
            assert max(delays, default=0.0) < INFO_DELAY_S, f"/info waited {max(delays):.2f} s behind /tokenize"
            longer = client.post("/tokenize", json={"inputs": " ".join(["word"] * 40_000)})
            assert longer.status_code == 422 and "more than 4095 (max input length)" in longer.text
    print(f"/info's longest wait: {huge_delay:.3f} s beside the 10 MB inputs, {max(delays, default=0.0):.3f} s beside the "
          f"4k-token /tokenizes; peak RSS rise {grown:.0f} MB")
