"""A decode graph whose capture fails (a layer reads the device from the host, as LLM.int8's outlier check does)
leaves nothing broken: that bucket's steps run eagerly with the tokens they would have had, and other buckets are
still captured afterwards, into a fresh pool (CUDA only: `python -m pytest tests/gpu`)."""

import pytest
import torch

from loraplex.params import SamplingParams
from tests.gpu.test_gpu_decode_graphs import llama, prompts
from tests.gpu.test_gpu_parity import DEVICE
from tests.helpers import engine_for

if not torch.cuda.is_available():
    pytest.fail("tests/gpu needs a CUDA device", pytrace=False)


class HostReadUnderCapture(torch.nn.Module):
    """Wraps a layer: while `armed`, reads a device value on the host during a capture (which CUDA refuses)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.armed = inner, True

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        if self.armed and torch.cuda.is_current_stream_capturing():
            bool((out[0] if isinstance(out, tuple) else out).isfinite().all())  # a device-to-host read
        return out


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_failed_capture_runs_eagerly_and_does_not_poison_later_captures(overlap, caplog):
    ours, config = llama(torch.float32)
    ours.model.layers[0].mlp = trap = HostReadUnderCapture(ours.model.layers[0].mlp)
    graphed = engine_for(ours, config, device=DEVICE, dtype=torch.float32, max_num_seqs=16, overlap_steps=overlap)
    eager = engine_for(ours, config, device=DEVICE, dtype=torch.float32, max_num_seqs=16, cuda_graphs=False)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    batch = prompts(3, config.vocab_size)  # bucket 4
    with caplog.at_level("WARNING"):
        trapped = [r.token_ids for r in graphed.generate(batch, params)]
    graphs = graphed.runner.decode_graphs
    assert graphs.num_captured == 0 and not graphs.can_replay(3, [None] * 3)
    assert sum("could not be captured" in r.message for r in caplog.records) == 1
    trap.armed = False
    assert trapped == [r.token_ids for r in eager.generate(batch, params)]
    # Another bucket captures (the pool and the stream were left clean), the failed one stays eager.
    solo = [graphed.generate([p], params)[0].token_ids for p in batch[:2]]
    assert graphs.num_captured >= 1 and graphs.can_replay(1, [None])
    assert solo == [r.token_ids for r in eager.generate(batch[:2], params)]
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
