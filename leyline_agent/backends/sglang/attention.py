"""``--attention-backend leyline_cpu``: SGLang's ``torch_native`` backend, with an extend path that
attends from the new tokens only.

What it fixes. ``TorchNativeAttnBackend._run_sdpa_forward_extend``
(``sglang/srt/layers/attention/torch_native_backend.py``, SGLang 0.5.23) pads each request's
queries to the whole sequence (``per_req_query_redudant``, ``[heads, seq_len, qk_dim]``) and runs
causal SDPA over ``seq_len x seq_len``, then keeps the last ``extend_len`` rows. An extend of a few
tokens after a long cached prefix therefore costs as much as prefilling the whole sequence, which
is exactly the case a splice (and every turn of a cached conversation) produces.

What it does instead. :meth:`LeylineCpuAttnBackend._run_sdpa_forward_extend` replaces that
method, with the same signature and the same results; everything else (``forward_extend``,
writing the new K/V to the pool, sliding-window masks) is inherited. Per request:

- queries: the request's ``extend_len`` new tokens, ``[q_heads, extend_len, qk_dim]``;
- keys / values: prefix + new tokens gathered from the KV pool through ``req_to_token``,
  ``[kv_heads, seq_len, qk_dim]`` and ``[kv_heads, seq_len, v_dim]``;
- mask: query ``i`` sits at position ``prefix_len + i`` and sees keys ``0 .. prefix_len + i``
  (the lower-right causal mask, ``[extend_len, seq_len]``), intersected with the sliding window
  when the layer has one; plain ``is_causal`` when there is no prefix; none when the layer is not
  causal (cross-attention, encoder-only).

The work per request drops from ``seq_len^2`` to ``extend_len * seq_len``. Extend and decode
(``_run_sdpa_forward_decode``, otherwise the parent's) call SDPA through :func:`grouped_sdpa`,
which stacks the query heads of one KV head as query rows: CPU SDPA with ``enable_gqa`` and a mask
was 50 ms per layer call at 20k keys, 7 ms stacked (MLA absorbed: 4 query heads on 1 KV head). Measured with
``experiments/backend/bench_cpu_attention.py`` (one layer call, bf16, MLA absorbed widths, 8 new
tokens, one thread on a busy 2-core machine): seq_len 1024 / 4096 / 8192 took 0.07 / 1.8 / 9.4 s
padded and 0.9 / 7.9 / 12.7 ms here, with identical outputs.

Shapes it handles, as the parent does: MHA and GQA (``enable_gqa`` when query and KV head counts
differ), and MLA absorbed, where the key buffer is ``[slots, 1, kv_lora_rank + rope_dim]`` and the
value buffer is a view of its first ``kv_lora_rank`` columns (``MLATokenToKVPool``), so ``v_dim``
differs from ``qk_dim``. Scaling is ``layer.scaling``. Like ``torch_native``, it does not apply
``layer.logit_cap`` (no soft cap).

DeepSeek models choose their attention forward method per backend name
(``AttentionBackendRegistry`` in ``sglang/srt/models/deepseek_common``); the factory maps
``leyline_cpu`` to the absorbed MLA path, the layout the KV cache ``[c_kv | k_pe]`` is built for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.nn.functional import scaled_dot_product_attention

from leyline_agent.backends.sglang.compat import TorchNativeAttnBackend

if TYPE_CHECKING:
    from leyline_agent.backends.sglang.compat import ModelRunner

BACKEND_NAME = "leyline_cpu"
FOLD_MAX_QUERIES = 64  # grouped_sdpa stacks query heads up to this many queries per request


class LeylineCpuAttnBackend(TorchNativeAttnBackend):
    """``torch_native`` with an extend that attends from the new tokens only (module docstring)."""

    @staticmethod
    def _offset_causal_mask(
        *, q_len: int, kv_len: int, query_offset: int, device: torch.device
    ) -> torch.Tensor:
        """``[q_len, kv_len]`` bool, True where query ``i`` (at ``query_offset + i``) may attend."""
        q_pos = torch.arange(query_offset, query_offset + q_len, device=device).unsqueeze(1)
        k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
        return k_pos <= q_pos

    def _run_sdpa_forward_extend(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_prefix_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None,
        enable_gqa: bool = False,
        causal: bool = False,
        is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:
        """Extend attention, new-token queries only; same arguments and result as the parent.

        Args:
            query: ``[num_new_tokens, q_heads, qk_dim]``, requests one after another.
            output: ``[num_new_tokens, q_heads, v_dim]``, written in place.
            k_cache: ``[slots, kv_heads, qk_dim]``; v_cache: ``[slots, kv_heads, v_dim]``.
            req_to_token: ``[max_reqs, max_context_len]`` slot of each request's tokens.
            req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens: ``[num_reqs]``;
                ``seq_lens = extend_prefix_lens + extend_seq_lens``.
            encoder_lens: ``[num_reqs]`` or None (encoder-decoder models).

        Returns:
            ``output``.
        """
        n = seq_lens.shape[0]
        assert extend_prefix_lens.shape[0] == n and extend_seq_lens.shape[0] == n
        seq_lens_l = seq_lens.tolist()
        prefix_lens_l = extend_prefix_lens.tolist()
        extend_lens_l = extend_seq_lens.tolist()
        encoder_lens_l = encoder_lens.tolist() if encoder_lens is not None else None
        window = sliding_window_size if sliding_window_size is not None else -1

        # [num_tokens, heads, dim] -> [heads, num_tokens, dim]
        query = query.movedim(0, query.dim() - 2)
        start_q = 0
        for i in range(n):
            extend_len, prefix_len, seq_len_kv = extend_lens_l[i], prefix_lens_l[i], seq_lens_l[i]
            end_q = start_q + extend_len
            if extend_len == 0:
                continue
            per_req_query = query[:, start_q:end_q, :]
            per_req_key, per_req_value = _request_kv(
                k_cache, v_cache, req_to_token[req_pool_indices[i]], seq_len_kv,
                encoder_lens_l[i] if encoder_lens_l is not None else None, is_cross_attn,
                per_req_query.dtype,
            )  # fmt: skip
            kv_len = per_req_key.shape[1]

            attn_mask, is_causal = None, False
            if causal and window > -1:
                attn_mask = self._make_sliding_window_mask(
                    q_len=extend_len,
                    kv_len=kv_len,
                    sliding_window_size=window,
                    device=per_req_query.device,
                    query_offset=prefix_len,
                )
            elif causal and prefix_len > 0:
                attn_mask = self._offset_causal_mask(
                    q_len=extend_len,
                    kv_len=kv_len,
                    query_offset=prefix_len,
                    device=per_req_query.device,
                )
            elif causal:
                is_causal = True  # no prefix: the ordinary (upper-left) causal mask

            per_req_out = grouped_sdpa(
                per_req_query, per_req_key, per_req_value, attn_mask, is_causal, scaling
            )
            output[start_q:end_q, :, :] = per_req_out.movedim(query.dim() - 2, 0)
            start_q = end_q
        return output

    def _run_sdpa_forward_decode(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None,
        enable_gqa: bool = False,
        causal: bool = False,
        is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:
        """Decode attention (one query per request); same arguments and result as the parent's,
        through :func:`grouped_sdpa`.

        Args:
            query, output: ``[num_reqs, q_heads, dim]``; the rest as for the extend.
        """
        query = query.movedim(0, query.dim() - 2)
        seq_lens_l = seq_lens.tolist()
        encoder_lens_l = encoder_lens.tolist() if encoder_lens is not None else None
        for i, seq_len_kv in enumerate(seq_lens_l):
            per_req_query = query[:, i : i + 1, :]
            per_req_key, per_req_value = _request_kv(
                k_cache, v_cache, req_to_token[req_pool_indices[i]], seq_len_kv,
                encoder_lens_l[i] if encoder_lens_l is not None else None, is_cross_attn,
                per_req_query.dtype,
            )  # fmt: skip
            attn_mask, is_causal = None, causal
            if sliding_window_size is not None and sliding_window_size > -1:
                attn_mask = self._make_sliding_window_mask(
                    q_len=1,
                    kv_len=seq_len_kv,
                    sliding_window_size=sliding_window_size,
                    device=per_req_query.device,
                    query_offset=seq_len_kv - 1,
                )
                is_causal = False
            per_req_out = grouped_sdpa(
                per_req_query, per_req_key, per_req_value, attn_mask, is_causal, scaling
            )
            output[i : i + 1, :, :] = per_req_out.movedim(query.dim() - 2, 0)
        return output


def _request_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    row: torch.Tensor,
    seq_len: int,
    encoder_len: int | None,
    is_cross_attn: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's keys and values, ``[kv_heads, kv_len, dim]`` in ``dtype``, gathered from the
    pool through its ``req_to_token`` ``row``: its ``seq_len`` tokens (after the encoder's, for an
    encoder-decoder model), or the encoder's for cross-attention (as the parent's loops do)."""
    if encoder_len is None:
        start, end = 0, seq_len
    elif is_cross_attn:
        start, end = 0, encoder_len
    else:
        start, end = encoder_len, encoder_len + seq_len
    tokens = row[start:end]
    key, value = k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1)
    if not (dtype == key.dtype == value.dtype):
        key, value = key.to(dtype), value.to(dtype)
    return key, value


def grouped_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` of one request, GQA folded into the query length.

    Args:
        q: ``[q_heads, q_len, qk_dim]``; k: ``[kv_heads, kv_len, qk_dim]``; v: ``[kv_heads,
            kv_len, v_dim]``; ``q_heads`` a multiple of ``kv_heads`` (query head ``h`` reads KV
            head ``h // group``, SGLang's and ``enable_gqa``'s convention).
        mask: ``[q_len, kv_len]`` bool (True: may attend) or None; is_causal: the upper-left
            causal mask (``q_len == kv_len``), only without ``mask``.

    Returns:
        ``[q_heads, q_len, v_dim]``.

    Why: with ``enable_gqa`` (or KV heads expanded) and a mask, CPU SDPA takes its math path per
    query head over the whole key length; measured here (one thread, bf16, 4 query heads on one KV
    head, MLA absorbed widths, 8 queries) 9 ms at 10k keys and 50 ms at 20k. The ``group`` query
    heads of one KV head are instead stacked as ``group * q_len`` query rows against that head
    (the mask repeated), which is the same arithmetic row by row: 3.3 and 7 ms, identical output;
    decode (one query, no mask) 5.3 -> 1.2 ms at 10k keys. Only up to ``FOLD_MAX_QUERIES`` queries
    (beyond it stacking was slower), and a causal call without a mask (a prefill with no cached
    prefix) keeps SDPA's fused causal kernel (4,000 tokens: 0.79 s against 1.0 s stacked).
    """
    hq, n, _ = q.shape
    hk = k.shape[0]
    # NOTE: the fused causal kernel beats a stacked explicit mask; stacking pays off for few
    # queries only (measured, bf16, 4 heads on 1: 64 queries 8 vs 20 ms at 4k keys, 256 queries
    # 44 vs 41 ms, 2,000 queries 1.37 vs 1.07 s at 10k keys)
    if hq == hk or is_causal or n > FOLD_MAX_QUERIES:
        out = scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=mask, scale=scale, is_causal=is_causal, enable_gqa=hq != hk,
        )  # fmt: skip
        return out.squeeze(0)
    group = hq // hk
    stacked = q.reshape(hk, group * n, q.shape[-1])
    out = scaled_dot_product_attention(
        stacked.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
        attn_mask=mask.repeat(group, 1) if mask is not None else None, scale=scale,
    )  # fmt: skip
    return out.squeeze(0).reshape(hq, n, v.shape[-1])


def register_deepseek_forward_method() -> None:
    """Map ``leyline_cpu`` to DeepSeek's absorbed MLA forward method (idempotent).

    Without a handler DeepSeek falls back to ``triton``'s, which picks the MHA prefill path for
    prefix-free extends; that path does not match the MLA KV layout this backend reads.
    """
    from leyline_agent.backends.sglang.compat import AttentionBackendRegistry, AttnForwardMethod

    AttentionBackendRegistry.register(BACKEND_NAME, lambda *args: AttnForwardMethod.MLA)


def create_leyline_cpu_backend(runner: ModelRunner) -> LeylineCpuAttnBackend:
    """The ``ATTENTION_BACKENDS`` factory. It runs in the scheduler (the process that runs the
    model), before the first forward, so the DeepSeek handler is registered where it is read."""
    register_deepseek_forward_method()
    return LeylineCpuAttnBackend(runner)


def register_backend() -> None:
    """Make ``--attention-backend leyline_cpu`` valid (idempotent).

    Adds the factory to SGLang's ``ATTENTION_BACKENDS`` (``attention_registry.py``) and the name
    to ``ATTENTION_BACKEND_CHOICES``, the list object the ``--attention-backend`` /
    ``--prefill-attention-backend`` / ``--decode-attention-backend`` argparse choices hold.
    ``launch_server`` calls ``load_plugins()`` before it parses the command line, so the name is
    accepted there, and every SGLang process that builds a model finds the factory.
    """
    from leyline_agent.backends.sglang.compat import (
        ATTENTION_BACKEND_CHOICES,
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    if ATTENTION_BACKENDS.get(BACKEND_NAME) is not create_leyline_cpu_backend:
        register_attention_backend(BACKEND_NAME)(create_leyline_cpu_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        ATTENTION_BACKEND_CHOICES.append(BACKEND_NAME)
