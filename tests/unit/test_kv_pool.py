"""The KV cache's layers are views of one pool per allocation: fresh blocks are zeroed in every layer (by one launch
when the caches handed over are a whole pool, else layer by layer), and nothing else is touched."""

import torch

from loraplex.layers.attention import TorchAttentionBackend


def filled(backend, layers=3, blocks=5):
    caches = backend.allocate_kv_cache(layers, blocks, 4, 2, 8, torch.float32, torch.device("cpu"))
    for i, (k, v, _) in enumerate(caches):
        k.fill_(1.0 + i)
        v.fill_(-1.0 - i)
    return caches


def zeroed_blocks(cache: torch.Tensor) -> list[int]:
    return [b for b in range(cache.shape[0]) if not cache[b].any()]


def test_a_whole_pool_is_cleared_in_one_launch_and_only_its_fresh_blocks():
    backend = TorchAttentionBackend()
    caches = filled(backend)
    assert backend._pool_of(caches) is not None
    backend.clear_blocks(caches, [1, 3])
    for i, (k, v, _) in enumerate(caches):
        assert zeroed_blocks(k) == zeroed_blocks(v) == [1, 3]
        assert (k[[0, 2, 4]] == 1.0 + i).all() and (v[[0, 2, 4]] == -1.0 - i).all()


def test_some_layers_of_a_pool_are_cleared_layer_by_layer():
    backend = TorchAttentionBackend()
    caches = filled(backend)
    assert backend._pool_of(caches[1:]) is None
    backend.clear_blocks(caches[1:], [0])
    assert zeroed_blocks(caches[0][0]) == [] and zeroed_blocks(caches[0][1]) == []
    assert all(zeroed_blocks(k) == zeroed_blocks(v) == [0] for k, v, _ in caches[1:])
