"""MLA post-load derivation: ``w_kc`` / ``w_vc`` from ``kv_b_proj`` (DeepSeek-V3 absorption).

sglang's DeepseekV2 attention never multiplies by ``kv_b_proj`` at decode time: after loading
it splits the weight per head into the key part ``w_kc[h, nope, kv_lora]`` (absorbed into the
query: ``q_nope @ w_kc`` lives in the latent space) and the value part
``w_vc[h, kv_lora, v]`` (applied to the attention output in the latent space). Both are
*derived* tensors: a weight update never writes them, the engine recomputes them in
``end_weight_update`` from the freshly written ``kv_b_proj`` (dequantized first when fp8).

Legend: ``h`` local heads, ``nope`` qk_nope_head_dim, ``v`` v_head_dim, ``c`` kv_lora_rank.
"""

from __future__ import annotations

import torch

from weightsync.quant.fp8 import dequantize_block_fp8


def split_kv_b(kv_b: torch.Tensor, qk_nope_head_dim: int, v_head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of ``kv_b_proj.weight`` as ``(w_kc, w_vc)``.

    Args:
        kv_b: ``[h * (nope + v), c]`` (a rank's heads, each head's nope rows then its v rows).
        qk_nope_head_dim: ``nope``.
        v_head_dim: ``v``.

    Returns:
        ``w_kc [h, nope, c]`` and ``w_vc [h, c, v]`` (views, not copies).

    Raises:
        ValueError: the row count is not a multiple of ``nope + v``.
    """
    per_head = qk_nope_head_dim + v_head_dim
    if kv_b.dim() != 2 or kv_b.shape[0] % per_head:
        raise ValueError(f"kv_b_proj of shape {tuple(kv_b.shape)} is not [heads * {per_head}, kv_lora_rank]")
    w = kv_b.unflatten(0, (-1, per_head))
    return w[:, :qk_nope_head_dim, :], w[:, qk_nope_head_dim:, :].transpose(1, 2)


def derive_w_kc_w_vc(
    kv_b: torch.Tensor,
    w_kc: torch.Tensor,
    w_vc: torch.Tensor,
    *,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale_inv: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> None:
    """Recompute ``w_kc`` and ``w_vc`` in place from ``kv_b_proj`` (their storage is kept).

    Args:
        kv_b: the local ``kv_b_proj.weight`` (bf16, or float8_e4m3fn with ``scale_inv``).
        w_kc: destination ``[h, nope, c]``.
        w_vc: destination ``[h, c, v]``.
        qk_nope_head_dim: ``nope``.
        v_head_dim: ``v``.
        scale_inv: per-block scales when ``kv_b`` is fp8.
        block: the fp8 block size when ``kv_b`` is fp8.

    Raises:
        ValueError: an fp8 ``kv_b`` without ``scale_inv``/``block``, or mismatched shapes.
    """
    if kv_b.dtype == torch.float8_e4m3fn:
        if scale_inv is None or block is None:
            raise ValueError("an fp8 kv_b_proj needs its weight_scale_inv and block size to derive w_kc/w_vc")
        kv_b = dequantize_block_fp8(kv_b, scale_inv, block, dtype=w_kc.dtype)
    kc, vc = split_kv_b(kv_b, qk_nope_head_dim, v_head_dim)
    if kc.shape != w_kc.shape or vc.shape != w_vc.shape:
        raise ValueError(
            f"w_kc {tuple(w_kc.shape)} / w_vc {tuple(w_vc.shape)} do not match kv_b_proj "
            f"{tuple(kv_b.shape)} (expected {tuple(kc.shape)} / {tuple(vc.shape)})"
        )
    w_kc.copy_(kc)
    w_vc.copy_(vc)
