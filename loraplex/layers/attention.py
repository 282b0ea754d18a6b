"""Paged causal self-attention: the layer models use, and the backends that compute it.

A backend owns the KV cache layout: `allocate_kv_cache` makes one cache per layer and `forward`
writes a step's new keys/values into it and attends over each sequence's cached context. The plain
PyTorch backend here runs on CPU and CUDA; GPU kernels plug in as other backends.

Encoder-decoder models use two more kinds (layers/encoder_attention.py): `encoder_forward`, bidirectional
attention within each sequence of encoder rows (no cache), and `cross_forward`, decoder rows attending to
their own request's cross-attention states, which live in KV blocks of the same cache (see
`EncoderMetadata`).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.environment import torch_attention_forced
from loraplex.layers.forward_context import AttentionMetadata, get_forward_context
from loraplex.layers.kernels import fused_kernels_wanted
from loraplex.layers.kv_quant import LayerKVCache, as_bytes, is_fp8, kv_as_cached, layer_cache, quantize, read_kv
from loraplex.layers.masks import visible_keys
from loraplex.layers.prefill_runs import fresh_prompts, put_rows, resumed_prompts


class AttentionBackend(Protocol):
    # Whether decode rows are attended over keys padded to their group's longest (then the runner groups them by
    # length, engine/worker/runner.py) rather than read from the paged cache in place, any lengths in one launch.
    pads_decode_groups: bool

    def allocate_kv_cache(
        self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> list[object]: ...

    def clear_blocks(self, kv_caches: list[object], block_ids: Sequence[int]) -> None:
        """Zero these blocks in every layer's cache (they change owner: nothing may carry over)."""
        ...

    def forward(
        self, layer: "PagedAttention", q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        kv_cache: object, md: AttentionMetadata,
    ) -> torch.Tensor: ...

    def encoder_forward(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Encoder rows (md.encoder.query_start_loc): each sequence attends to all of its own rows."""
        ...

    def cross_forward(
        self, layer, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, kv_cache: object,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        """Step rows attend to their sequence's cross-attention states; `k`/`v` (encoder rows, or None)
        are states computed this step, stored first at md.encoder.slot_mapping."""
        ...


class PagedAttention(nn.Module):
    """q [T, H, D], k/v [T, Hkv, D] for the step's new tokens -> output [T, H, D].

    Optional score modifiers: `sliding_window` (keys more than that many positions back are hidden),
    `alibi_slopes` [H] (ALiBi: `slope[h] * (key_pos - query_pos)` added to head h's scores, from absolute
    positions), `position_bias` (a callable mapping `key_pos - query_pos` [...] to a float32 bias
    [..., H]: T5's relative position buckets) and `softcap` (scaled scores s become softcap * tanh(s / softcap)
    before any bias or mask: Gemma 2). Without them a backend takes its plain causal path.
    """

    def __init__(
        self, layer_index: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
        sliding_window: int | None = None, alibi_slopes: torch.Tensor | None = None,
        position_bias: Callable[[torch.Tensor], torch.Tensor] | None = None, softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.softcap = softcap
        self.layer_index = layer_index
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        if alibi_slopes is not None and tuple(alibi_slopes.shape) != (num_heads,):
            raise ValueError(f"alibi_slopes must have shape ({num_heads},), got {tuple(alibi_slopes.shape)}")
        # A plain attribute, not a buffer: derived from the config, never loaded, and it must survive
        # building the model on the meta device (as RotaryEmbedding.inv_freq). Float32 on the CPU until used.
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.detach().float().cpu()
        assert alibi_slopes is None or position_bias is None, "one kind of position bias per layer"
        self.position_bias = position_bias

    @property
    def has_score_bias(self) -> bool:
        return self.alibi_slopes is not None or self.position_bias is not None

    def score_bias(self, distance: torch.Tensor) -> torch.Tensor:
        """Float32 bias [..., H] added to the scores, for `key_pos - query_pos` [...] (int64)."""
        if self.alibi_slopes is not None:
            return distance[..., None].to(torch.float32) * self.alibi_on(distance.device)
        assert self.position_bias is not None, "score_bias called on a layer without one"
        return self.position_bias(distance)

    def alibi_on(self, device: torch.device) -> torch.Tensor:
        """The slopes on `device` (moved there once)."""
        if self.alibi_slopes.device != device:
            self.alibi_slopes = self.alibi_slopes.to(device)
        return self.alibi_slopes

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        return ctx.backend.forward(self, q, k, v, ctx.kv_caches[self.layer_index], ctx.attn_metadata)


class TorchAttentionBackend:
    """Reference backend: scaled_dot_product_attention over keys gathered from the block table.

    Decode rows (one new token per sequence) are batched into one SDPA call over a padded gather;
    prefill sequences are computed one at a time (a fresh prompt needs no gather at all).
    Cache layout per layer: a LayerKVCache, keys and values each [num_blocks, block_size, Hkv, D], views of one pool
    [layers, 2, num_blocks, ...] per allocation (so that `clear_blocks` zeroes a block in every layer at once), and
    for an FP8 cache its scales (layers/kv_quant.py): every write quantizes, every read dequantizes.
    """

    pads_decode_groups = True

    def __init__(self) -> None:
        self._pools: list[torch.Tensor] = []

    def allocate_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        pool = torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        self._pools.append(pool)
        scales = torch.ones(num_layers, 2, num_kv_heads, dtype=torch.float32, device=device) if is_fp8(dtype) else None
        return [LayerKVCache(pool[i, 0], pool[i, 1], None if scales is None else scales[i]) for i in range(num_layers)]

    def clear_blocks(self, kv_caches, block_ids):
        if not block_ids:
            return
        device = kv_caches[0][0].device
        # Pinned and copied asynchronously on CUDA: a blocking copy would wait for the steps in flight (the engine
        # launches decode steps ahead, engine/worker/overlap.py), and the GPU would then wait for the host.
        index = torch.tensor(list(block_ids), dtype=torch.long, pin_memory=device.type == "cuda")
        index = index.to(device, non_blocking=True)
        pool = self._pool_of(kv_caches)
        if pool is not None:  # one launch for every layer
            as_bytes(pool).index_fill_(2, index, 0)
            return
        for key_cache, value_cache, *_ in kv_caches:
            as_bytes(key_cache).index_fill_(0, index, 0)
            as_bytes(value_cache).index_fill_(0, index, 0)

    def _pool_of(self, kv_caches) -> torch.Tensor | None:
        """The pool `kv_caches` are all the layers of, if they are (as `allocate_kv_cache` returned them)."""
        pool = kv_caches[0][0]._base
        if (any(pool is p for p in self._pools) and pool.shape[0] == len(kv_caches)
                and all(k._base is pool and v._base is pool for k, v, *_ in kv_caches)):
            return pool
        return None

    def forward(self, layer, q, k, v, kv_cache, md):
        key_cache, value_cache, scales = layer_cache(kv_cache)
        self._write_kv(key_cache, value_cache, md.slot_mapping, k, v, scales)

        groups = md.decode_groups
        if len(groups) == 1 and groups[0].in_order and not md.prefill_seqs:  # every row decodes, in order
            return self._decode(layer, q, key_cache, value_cache, md, 0, scales)  # (a CUDA graph's step): no gather
        out = torch.empty_like(q)
        for g, group in enumerate(groups):
            out[group.rows] = self._decode(layer, q[group.rows], key_cache, value_cache, md, g, scales)
        self._prefill_seqs(layer, q, k, v, key_cache, value_cache, md, md.prefill_seqs, out, scales)
        return out

    @staticmethod
    def _write_kv(key_cache, value_cache, slots, k, v, scales=None) -> None:
        """Row i of k and v into the caches' flat slot slots[i] (quantized first when the cache has scales)."""
        num_kv_heads, head_dim = key_cache.shape[2:]
        if scales is not None:
            k, v = quantize(k, scales[0]), quantize(v, scales[1])
        as_bytes(key_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, as_bytes(k))
        as_bytes(value_cache).view(-1, num_kv_heads, head_dim).index_copy_(0, slots, as_bytes(v))

    def _prefill_seqs(self, layer, q, k, v, key_cache, value_cache, md, seqs, out, scales=None) -> None:
        """Attention for the rows of `seqs` (prompts, chunks, resumed requests), written into `out`."""
        for s in seqs:
            start, end = md.query_start_loc[s], md.query_start_loc[s + 1]
            seq_len = md.seq_lens[s]
            if seq_len == end - start:  # nothing cached before this step: the new k/v, as the cache holds them
                keys, values = kv_as_cached(k[start:end], v[start:end], scales)
            else:
                keys, values = self._gather(key_cache, value_cache, md.block_tables[s : s + 1], seq_len, scales,
                                            q.dtype)
                keys, values = keys[0], values[0]
            out[start:end] = self._prefill(layer, q[start:end], keys, values, seq_len, md, s)

    def encoder_forward(self, layer, q, k, v, md):
        enc = md.encoder
        out = torch.empty_like(q)
        gqa = layer.num_heads != layer.num_kv_heads
        for s in range(len(enc.query_start_loc) - 1):
            start, end = enc.query_start_loc[s], enc.query_start_loc[s + 1]
            qh, kh, vh = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
            mask = None
            if layer.has_score_bias:  # [1, H, L, L]
                pos = torch.arange(end - start, device=q.device)
                bias = _step_bias(layer, md, ("encoder", end - start), lambda: pos[None, :] - pos[:, None])
                mask = bias.permute(2, 0, 1)[None].to(q.dtype)
            attended = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
            out[start:end] = attended[0].transpose(0, 1)
        return out

    def cross_forward(self, layer, q, k, v, kv_cache, md):
        enc = md.encoder
        key_cache, value_cache, scales = layer_cache(kv_cache)
        if k is not None:
            TorchAttentionBackend._write_kv(key_cache, value_cache, enc.slot_mapping, k, v, scales)
        # Rows of sequences without states stay zero.
        out = torch.zeros_like(q) if 0 in enc.lens else torch.empty_like(q)
        # Decode rows in groups of similar state count, each over its own states padded to the group's
        # longest and masked: no sequence ever reads another's states, and padding stays small.
        for group in enc.decode_groups:
            keys, values = self._gather(key_cache, value_cache, enc.block_tables[group.seqs], group.max_len, scales,
                                        q.dtype)
            position = torch.arange(group.max_len, device=q.device)[None, :]
            if enc.row_first is None:
                visible = position < group.seq_lens[:, None]
            else:
                visible = (position >= enc.row_first[group.rows, None]) & (position < enc.row_end[group.rows, None])
            batch = keys.shape[0]
            attended = F.scaled_dot_product_attention(
                q[group.rows].view(batch, layer.num_kv_heads, -1, layer.head_dim), keys.transpose(1, 2),
                values.transpose(1, 2), attn_mask=visible[:, None, None, :], scale=layer.scale,
            )
            out[group.rows] = attended.reshape(batch, layer.num_heads, layer.head_dim)
        gqa = layer.num_heads != layer.num_kv_heads
        for s in md.prefill_seqs:  # several rows of one sequence (a prompt, or a request resumed)
            if enc.lens[s] == 0:
                continue
            start, end = md.query_start_loc[s], md.query_start_loc[s + 1]
            keys, values = self._gather(key_cache, value_cache, enc.block_tables[s : s + 1], enc.lens[s], scales,
                                        q.dtype)
            mask = None
            if enc.row_first is not None:  # [1, 1, rows, states]
                position = torch.arange(enc.lens[s], device=q.device)[None, :]
                mask = (position >= enc.row_first[start:end, None]) & (position < enc.row_end[start:end, None])
                mask = mask[None, None]
            attended = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None], keys[0].transpose(0, 1)[None], values[0].transpose(0, 1)[None],
                attn_mask=mask, scale=layer.scale, enable_gqa=gqa,
            )
            out[start:end] = attended[0].transpose(0, 1)
        if enc.rows_seeing is not None:  # rows that see no state: zero (SDPA's output for a fully masked row varies)
            out.masked_fill_(~enc.rows_seeing[:, None, None], 0.0)
        return out

    @staticmethod
    def _gather(key_cache, value_cache, block_tables, max_len, scales=None, dtype=None):
        """[B, blocks] -> keys/values [B, max_len, Hkv, D] (padding rows hold stale data; mask them); an FP8
        cache's read back in `dtype`."""
        batch = block_tables.shape[0]
        num_blocks, block_size, heads, dim = key_cache.shape
        nb = -(-max_len // block_size)
        flat_table = block_tables[:, :nb].reshape(-1)

        def blocks(cache):  # index_select on whole blocks: one contiguous copy per block, cheaper than indexing
            picked = as_bytes(cache).index_select(0, flat_table).view(cache.dtype)
            return picked.view(batch, nb * block_size, heads, dim)[:, :max_len]

        return read_kv(blocks(key_cache), blocks(value_cache), scales, dtype)

    def _decode(self, layer, q, key_cache, value_cache, md, g, scales=None):
        group = md.decode_groups[g]
        seq_lens, max_len = group.seq_lens, group.max_len
        keys, values = self._gather(key_cache, value_cache, md.block_tables[group.seqs], max_len, scales, q.dtype)
        key_pos = torch.arange(max_len, device=q.device)
        visible = key_pos[None, :] < seq_lens[:, None]
        if layer.sliding_window is not None:
            visible &= key_pos[None, :] >= (seq_lens[:, None] - layer.sliding_window)
        # The query heads sharing a KV head ride as that head's query positions ([Bd, Hkv, H/Hkv, D]):
        # no copy of K/V per query head, and one mask row fits them all.
        batch = q.shape[0]
        mask = visible[:, None, None, :]
        if layer.has_score_bias:  # one mask row per query head: [Bd, Hkv, H/Hkv, max_len]
            # The query sits at seq_len - 1.
            bias = _step_bias(layer, md, ("decode", g), lambda: key_pos[None, :] - (seq_lens[:, None] - 1))
            bias = bias.permute(0, 2, 1).reshape(batch, layer.num_kv_heads, -1, max_len)
            mask = _biased_mask(bias, mask, q.dtype)
        out = _attend(layer, q.reshape(batch, layer.num_kv_heads, -1, layer.head_dim), keys.transpose(1, 2),
                      values.transpose(1, 2), mask)
        return out.reshape(batch, layer.num_heads, layer.head_dim)

    def _prefill(self, layer, q, keys, values, seq_len, md, s):
        num_new = q.shape[0]
        context = seq_len - num_new
        # 4-D [1, H, T, D]: with a batch dimension, SDPA takes its fused CPU kernel (3-D falls back to math).
        qh, kh, vh = q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        gqa = layer.num_heads != layer.num_kv_heads
        if context == 0 and layer.sliding_window is None and not layer.has_score_bias and layer.softcap is None:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=layer.scale, enable_gqa=gqa)
        else:
            visible = visible_keys(num_new, seq_len, layer.sliding_window, q.device)
            mask = visible
            if layer.has_score_bias:  # [1, H, new, seq_len]
                q_pos = torch.arange(context, seq_len, device=q.device)[:, None]
                distance = lambda: torch.arange(seq_len, device=q.device)[None, :] - q_pos  # noqa: E731
                bias = _step_bias(layer, md, ("prefill", s), distance).permute(2, 0, 1)[None]
                mask = _biased_mask(bias, visible[None, None], q.dtype)
            if gqa and layer.softcap is not None:  # (SDPA repeats the KV heads itself)
                kh, vh = (t.repeat_interleave(layer.num_heads // layer.num_kv_heads, dim=1) for t in (kh, vh))
            out = _attend(layer, qh, kh, vh, mask, gqa)
        return out[0].transpose(0, 1)


def _step_bias(layer, md: AttentionMetadata, key: tuple, distance) -> torch.Tensor:
    """`layer.score_bias(distance())` [..., H]. A bias that every layer of a stack shares (T5's) is computed
    once per step and kept in the step's metadata; ALiBi's slopes are per layer and cheap: computed each time."""
    if layer.position_bias is None:
        return layer.score_bias(distance())
    shared = (id(layer.position_bias), *key)
    if shared not in md.step_cache:
        md.step_cache[shared] = layer.score_bias(distance())
    return md.step_cache[shared]


def _attend(layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            gqa: bool = False) -> torch.Tensor:
    """SDPA over [..., L, D] with a boolean or float mask, or, for a soft-capped layer (which SDPA cannot do), the
    same product written out as transformers' eager Gemma 2 computes it: scores in the inputs' dtype, capped, masked,
    softmax in float32. (k and v then carry every query head.)"""
    if layer.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=gqa)
    scores = torch.matmul(q, k.transpose(-1, -2)) * layer.scale
    scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _biased_mask(bias: torch.Tensor, visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float SDPA mask: the float32 score bias where visible, -inf elsewhere (broadcast shapes), cast to
    the scores' dtype (MPT adds its float32 ALiBi bias to the scores; T5 its bias in the weights' dtype)."""
    return bias.masked_fill(~visible, float("-inf")).to(dtype)


class TritonAttentionBackend(TorchAttentionBackend):
    """CUDA: decode rows attend to the paged cache in place (`layers/kernels/paged_decode.py`: GQA, sliding
    windows, ALiBi), with no gather into a padded copy; fresh prompts attend in one variable-length FlashAttention
    launch per layer, prompts resumed over cached context in another (`layers/kernels/varlen_prefill.py`). Score
    biases, encoder and cross-attention, and decode under T5's relative position bias are the torch reference's.

    An eager step's decode rows come in one group whatever their lengths: each group costs a kernel pair and a
    gather and scatter of its rows per layer (five groups were ~750 of an online prompt step's ~2,000 launches),
    and the kernel reads each row's own length. (Under T5's bias the reference then pads to the longest.)"""

    pads_decode_groups = False

    @staticmethod
    def _write_kv(key_cache, value_cache, slots, k, v, scales=None) -> None:
        if fused_kernels_wanted(k.device) and k.stride(-1) == v.stride(-1) == 1:  # one launch, not two
            from loraplex.layers.kernels.kv_write import write_kv

            return write_kv(key_cache, value_cache, slots, k, v, scales)
        TorchAttentionBackend._write_kv(key_cache, value_cache, slots, k, v, scales)

    def _prefill_seqs(self, layer, q, k, v, key_cache, value_cache, md, seqs, out, scales=None) -> None:
        """Fresh prompts (nothing cached before them) in one variable-length launch and prompts resumed over cached
        context in another, where the kernel runs and the layer adds no score bias; the others as the reference
        does."""
        from loraplex.layers.kernels.varlen_prefill import causal_varlen, resumed_varlen_usable, varlen_usable

        if not seqs or layer.has_score_bias or layer.softcap is not None or not varlen_usable(q, layer.num_kv_heads):
            return super()._prefill_seqs(layer, q, k, v, key_cache, value_cache, md, seqs, out, scales)
        window = layer.sliding_window
        fresh = fresh_prompts(md, q.device)
        if fresh is not None:
            rows, cu = fresh.rows, fresh.cu_seqlens
            keys, values = kv_as_cached(k[rows], v[rows], scales)
            put_rows(out, rows, causal_varlen(q[rows], keys, values, cu, cu, fresh.max_len, fresh.max_len,
                                              layer.scale, window))
        others = fresh.others if fresh is not None else list(seqs)
        if others and resumed_varlen_usable(q, layer.num_kv_heads):
            resumed = resumed_prompts(md, others, key_cache.shape[1], q.device)
            keys, values = read_kv(_slots_of(key_cache, resumed.key_slots), _slots_of(value_cache, resumed.key_slots),
                                   scales, q.dtype)
            put_rows(out, resumed.rows, causal_varlen(q[resumed.rows], keys, values, resumed.cu_seqlens_q,
                                                      resumed.cu_seqlens_k, resumed.max_len_q, resumed.max_len_k,
                                                      layer.scale, window))
            others = []
        super()._prefill_seqs(layer, q, k, v, key_cache, value_cache, md, others, out, scales)

    def _decode(self, layer, q, key_cache, value_cache, md, g, scales=None):
        if layer.position_bias is not None:
            return super()._decode(layer, q, key_cache, value_cache, md, g, scales)
        from loraplex.layers.kernels.paged_decode import paged_decode

        group = md.decode_groups[g]
        slopes = layer.alibi_on(q.device) if layer.alibi_slopes is not None else None
        tables = md.block_tables if group.in_order else md.block_tables[group.seqs]
        return paged_decode(q, key_cache, value_cache, tables, group.seq_lens,
                            layer.scale, layer.sliding_window, slopes, group.max_len, scales, layer.softcap)


def _slots_of(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows [len(slots), Hkv, D] at these flat slots of a cache [num_blocks, block_size, Hkv, D]."""
    num_kv_heads, head_dim = cache.shape[2:]
    return as_bytes(cache).view(-1, num_kv_heads, head_dim).index_select(0, slots).view(cache.dtype)


def default_backend(device: torch.device) -> AttentionBackend:
    """On CUDA with Triton, the Triton backend (decode reads the paged cache in place; CUDA graphs need it); the
    torch reference elsewhere, or when LORAPLEX_ATTENTION_BACKEND=torch. Outside a graph a kernel call costs more
    host time than the torch decode (`python -m benchmarks.paged_decode --op-only` measures it), which CUDA graphs
    remove."""
    from loraplex.kernels import triton_available

    if not triton_available(device) or torch_attention_forced():
        return TorchAttentionBackend()
    return TritonAttentionBackend()
