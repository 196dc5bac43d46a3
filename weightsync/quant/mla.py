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

from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass(frozen=True, kw_only=True, slots=True)
class MlaLayer:
    """One layer's ``kv_b_proj`` (and its fp8 scales) and the derived tensors it feeds."""

    kv_b: torch.Tensor
    w_kc: torch.Tensor
    w_vc: torch.Tensor
    scale_inv: torch.Tensor | None = None


def derive_all(
    layers: Sequence[MlaLayer],
    *,
    qk_nope_head_dim: int,
    v_head_dim: int,
    block: tuple[int, int] | None = None,
    use_kernel: bool | None = None,
) -> None:
    """:func:`derive_w_kc_w_vc` for every layer, as one Triton launch per kind of layer on the GPU.

    Layers of one (heads, dtype) kind go into one table of offsets; each program derives one
    head's column block of one layer (:mod:`weightsync.quant._mla_kernel`), bit-identical to the
    per-layer reference, which runs instead on the CPU or without Triton.

    Args:
        layers: the layers to derive (all on one device).
        qk_nope_head_dim: ``nope``.
        v_head_dim: ``v``.
        block: the fp8 block size when ``kv_b`` is fp8.
        use_kernel: force (True) or refuse (False) the kernel; default: on CUDA when Triton imports.

    Raises:
        ValueError: as :func:`derive_w_kc_w_vc`.
    """
    if use_kernel is None:
        use_kernel = bool(layers) and layers[0].kv_b.is_cuda and _triton_importable()
    groups: dict[tuple[object, ...], list[MlaLayer]] = {}
    for item in layers:
        kc, vc = split_kv_b(item.kv_b, qk_nope_head_dim, v_head_dim)
        fp8 = item.kv_b.dtype == torch.float8_e4m3fn
        if fp8 and (item.scale_inv is None or block is None):
            raise ValueError("an fp8 kv_b_proj needs its weight_scale_inv and block size to derive w_kc/w_vc")
        if kc.shape != item.w_kc.shape or vc.shape != item.w_vc.shape:
            raise ValueError(
                f"w_kc {tuple(item.w_kc.shape)} / w_vc {tuple(item.w_vc.shape)} do not match kv_b_proj "
                f"{tuple(item.kv_b.shape)} (expected {tuple(kc.shape)} / {tuple(vc.shape)})"
            )
        ok = use_kernel and item.w_kc.is_contiguous() and item.w_vc.is_contiguous() and item.kv_b.is_contiguous()
        if not ok:
            derive_w_kc_w_vc(item.kv_b, item.w_kc, item.w_vc, qk_nope_head_dim=qk_nope_head_dim,
                             v_head_dim=v_head_dim, scale_inv=item.scale_inv, block=block)
            continue
        key = (tuple(item.kv_b.shape), item.kv_b.dtype, item.w_kc.dtype, item.w_vc.dtype,
               None if item.scale_inv is None else tuple(item.scale_inv.shape))
        groups.setdefault(key, []).append(item)
    for items in groups.values():
        _derive_group(items, qk_nope_head_dim, v_head_dim, block)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _derive_group(items: list[MlaLayer], nope: int, v: int, block: tuple[int, int] | None) -> None:
    from weightsync.quant import _mla_kernel

    first = items[0]
    fp8 = first.kv_b.dtype == torch.float8_e4m3fn
    device = first.kv_b.device
    tensors = {
        "kv": [i.kv_b for i in items],
        "sc": [i.scale_inv if i.scale_inv is not None else i.kv_b for i in items],
        "kc": [i.w_kc for i in items],
        "vc": [i.w_vc for i in items],
    }
    refs = {k: min(ts, key=lambda t: t.data_ptr()) for k, ts in tensors.items()}
    offsets = []
    for i in range(len(items)):
        row = []
        for k, ts in tensors.items():
            off = ts[i].data_ptr() - refs[k].data_ptr()
            if off % ts[i].element_size():
                raise ValueError(f"{k} tensors of the MLA layers are not aligned to their element size")
            row.append(off // ts[i].element_size())
        offsets.append(row)
    table = torch.tensor(offsets, dtype=torch.int64, device=device)
    heads = first.kv_b.shape[0] // (nope + v)
    _mla_kernel.launch(table, refs["kv"], refs["sc"], refs["kc"], refs["vc"], layers=len(items), heads=heads,
                       nope=nope, v=v, rank=first.kv_b.shape[1], block=block or (1, 1), fp8=fp8)


def mla_layers(derived_names: Sequence[str], get: Callable[[str], torch.Tensor | None]) -> list[MlaLayer]:
    """The MLA layers of an engine's parameters: each derived ``...w_kc`` with its ``w_vc``, the
    ``kv_b_proj.weight`` they come from and its ``weight_scale_inv`` when there is one.

    Args:
        derived_names: names of the derived tensors.
        get: parameter by name (None when absent).

    Raises:
        ValueError: a ``w_kc`` without its ``w_vc`` or ``kv_b_proj.weight``.
    """
    out = []
    for name in derived_names:
        if not name.endswith(".w_kc"):
            continue
        prefix = name.removesuffix("w_kc")
        kv_b, w_kc, w_vc = get(prefix + "kv_b_proj.weight"), get(name), get(prefix + "w_vc")
        if kv_b is None or w_kc is None or w_vc is None:
            raise ValueError(f"{name} needs {prefix}w_vc and {prefix}kv_b_proj.weight beside it")
        out.append(MlaLayer(kv_b=kv_b, w_kc=w_kc, w_vc=w_vc, scale_inv=get(prefix + "kv_b_proj.weight_scale_inv")))
    return out
