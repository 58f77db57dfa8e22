"""Batched time-embedding projections: one SiLU and one GEMM per UNet call for every ResNet block's
``time_emb_proj(silu(temb))``, conv1's bias included.

Every ``ResnetBlock2D`` of a diffusers UNet receives the same ``temb`` (B, T) and projects ``silu(temb)`` to its
own channel count C; with the norm pass (``sdfast.passes.norms``) that projection plus conv1's bias is norm2's
per-(batch, channel) bias. Block by block this is a SiLU, a (B x T) @ (T x C) GEMM and a bias add per block, each
too small to fill the GPU: SD1.5 runs 22 of each per step, SDXL 17.

This pass packs the blocks' ``time_emb_proj`` weights (sum C, T), their biases and conv1's biases (sum C) into
three tensors whose row slices *are* the blocks' parameters (``param.data`` becomes a view of the pack), so
in-place updates (``param.copy_``, a fused LoRA's ``weight.data += delta``) are seen. The UNet's first block (the
"leader": it runs first at every UNet call) computes ``F.linear(silu(temb), W, b_proj + b_conv)`` for every
block; each block then takes its column slice, (B, C) with row stride sum(C), as norm2's bias. This is
horizontal fusion of GEMMs that share an input, as TensorRT's horizontal layer fusion does.

When it does not apply, a block computes its own projection exactly as before (never a stale or partial bias):
- a block called with another ``temb`` than the one the leader saw last (a block run on its own);
- a block not in the pack: ``skip_time_act``, a ``time_emb_proj`` that is not a plain ``nn.Linear`` (a PEFT LoRA
  wrapper, a quantized linear), another dtype, device or input width than the pack's;
- the pack's state changed (a module or parameter replaced, ``module.to(...)``): it is repacked (and logged) before
  the next pipeline call's CUDA-graph check (``refresh``, from the optimizer), or else by the leader at its next
  call outside a capture (inside one, every block computes its own until then).

The pack keeps no reference to its packed weight: it sees it through the leader's parameter, so the storage is freed
with the parameters (after ``module.to(...)``, under model CPU offload).
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from sdfast.passes._modules import runs_as_its_class
from sdfast.passes.norms import folded_conv_bias
from sdfast.passes.state import BLOCK_TEMB, NORMS_FUSED, TEMB_PACK

log = logging.getLogger("sdfast")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


class TembPack:
    """The packed projections of ``blocks`` (ResnetBlock2D with a ``time_emb_proj``, in UNet call order: down, mid,
    up blocks)."""

    def __init__(self, blocks: list[nn.Module]):
        self.blocks = list(blocks)
        self.slices: dict[int, tuple[int, int]] = {}  # id(block) -> (first column, columns) in the pack
        self.leader: nn.Module | None = None
        self._state = None
        self._shape = (0, 0)  # the packed weight's (sum C, T); its storage is held by the blocks' parameters only
        self._storages: set[int] = set()  # storage pointers of the pack (to detach its views), no references
        self.b_proj = self.b_conv = None  # (sum C,) packed biases (zeros for a block without one)
        self._last = None  # (weakref to the temb the leader saw last, its version, the packed result)
        self._repacks = 0
        self.pack()

    # ---- packing --------------------------------------------------------------------------------------
    def _usable(self, block: nn.Module, ref: torch.Tensor) -> bool:
        proj = block.time_emb_proj
        if block.skip_time_act or not runs_as_its_class(proj, nn.Linear):
            return False
        w, cb = proj.weight, folded_conv_bias(block.conv1)
        same = (w.dtype, w.device, w.shape[1]) == (ref.dtype, ref.device, ref.shape[1])
        return same and all(t is None or (t.dtype, t.device) == (w.dtype, w.device) for t in (proj.bias, cb))

    def state(self) -> tuple:
        """What the pack depends on: each block's modules and the storage of the parameters it packs."""
        out = []
        for b in self.blocks:
            proj, cb = b.time_emb_proj, folded_conv_bias(b.conv1)
            plain = runs_as_its_class(proj, nn.Linear)
            w = proj.weight if plain else None
            out.append((id(proj), id(b.conv1), plain, b.skip_time_act, _ptr(w), _ptr(getattr(proj, "bias", None)),
                        _ptr(cb), None if w is None else (w.dtype, w.device)))
        return tuple(out)

    def pack(self) -> int:
        """(Re)build the pack from the blocks' current parameters; returns how many blocks it holds. Parameters stay
        ordinary tensors under ``torch.inference_mode``, as stock's do."""
        with torch.inference_mode(False), torch.no_grad():
            self._detach()
            self.slices, self.leader, self._last = {}, None, None
            self.b_proj = self.b_conv = None
            self._storages, self._shape = set(), (0, 0)
            plain = [b for b in self.blocks if runs_as_its_class(b.time_emb_proj, nn.Linear)]
            members = [b for b in self.blocks if plain and self._usable(b, plain[0].time_emb_proj.weight)]
            if len(members) >= 2:
                self._pack(members)
                self.leader = members[0]
        self._state = self.state()
        return len(self.slices)

    def _pack(self, members: list[nn.Module]) -> None:
        ws, bp, bc = [], [], []
        for b in members:
            proj, cb = b.time_emb_proj, folded_conv_bias(b.conv1)
            ws.append(proj.weight.detach())
            zeros = proj.weight.new_zeros(proj.out_features)
            bp.append(zeros if proj.bias is None else proj.bias.detach())
            bc.append(zeros if cb is None else cb.detach())
        weight, self.b_proj, self.b_conv = torch.cat(ws), torch.cat(bp), torch.cat(bc)
        self._shape = tuple(weight.shape)
        self._storages = {t.untyped_storage().data_ptr() for t in (weight, self.b_proj, self.b_conv)}
        first = 0
        for b in members:
            n = b.time_emb_proj.out_features
            proj, cb = b.time_emb_proj, folded_conv_bias(b.conv1)
            proj.weight.data = weight[first:first + n]
            if proj.bias is not None:
                proj.bias.data = self.b_proj[first:first + n]
            if cb is not None:
                cb.data = self.b_conv[first:first + n]
            self.slices[id(b)] = (first, n)
            first += n

    def unpack(self) -> int:
        """Give every packed parameter its own storage again; returns how many blocks were packed."""
        n = len(self.slices)
        with torch.inference_mode(False), torch.no_grad():
            self._detach()
        self.slices, self.leader, self._last, self.b_proj, self.b_conv = {}, None, None, None, None
        return n

    def _detach(self) -> None:
        """Clone every parameter of the blocks' projections and conv1s (wrapped ones too), and every buffer of conv1
        (a quantized conv's bias is one), that is a view of the pack, so that a dropped pack's storage is freed."""
        for b in self.blocks if self._storages else ():
            for t in (*b.time_emb_proj.parameters(), *b.conv1.parameters(), *b.conv1.buffers()):
                if t.untyped_storage().data_ptr() in self._storages:
                    t.data = t.data.clone()

    def _weight(self) -> torch.Tensor:
        """The packed (sum C, T) weight, seen through the leader's parameter (a view at the start of the pack: the
        state check guarantees it). No reference of the pack's own: the storage lives as long as the parameters."""
        w0 = self.leader.time_emb_proj.weight.detach()
        return w0.as_strided(self._shape, (self._shape[1], 1), w0.storage_offset())

    def refresh(self) -> bool:
        """Repack now if a module or parameter changed (outside a CUDA-graph capture); True if it repacked. The
        optimizer calls it before each pipeline call's graph check, so that the check sees the new parameter
        storage at once and one capture follows, not two."""
        if self.state() == self._state or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            return False
        n = self.pack()
        # INFO once, then DEBUG: a model offloaded to the CPU between calls moves (repacks) at every call
        log.log(logging.DEBUG if self._repacks else logging.INFO,
                "sdfast: time-embedding projections repacked (a module or parameter changed): %d blocks", n)
        self._repacks += 1
        return True

    # ---- per call -------------------------------------------------------------------------------------
    def lookup(self, block: nn.Module, temb: torch.Tensor) -> torch.Tensor | None:
        """``block``'s ``time_emb_proj(silu(temb))`` + conv1's folded bias, (B, C), a column slice of the packed
        result; None when the block must compute its own (see the module docstring)."""
        if block is self.leader or (self.leader is None and block is self.blocks[0]):
            last = (weakref.ref(temb), _version(temb), self._compute(temb))
            self._last = last
        else:
            last = self._last  # one read: (key, result) stay paired even if another thread's leader runs
            if last is None or last[0]() is not temb or last[1] != _version(temb):
                return None
        if last[2] is None or id(block) not in self.slices:
            return None
        first, n = self.slices[id(block)]
        return last[2][:, first:first + n]

    def _compute(self, temb: torch.Tensor) -> torch.Tensor | None:
        if self.state() != self._state and not self.refresh():
            return None  # changed inside a capture: no new parameter storage there; each block computes its own
        if self.leader is None or temb.dim() != 2:
            return None
        return F.linear(F.silu(temb), self._weight(), self.b_proj + self.b_conv)


def _call_order(unet: nn.Module) -> list[nn.Module]:
    """``unet``'s modules with its down, mid and up blocks in the order a UNet call runs them (``modules()`` lists
    the up blocks before the mid block), then any others."""
    parts = [getattr(unet, n, None) for n in ("down_blocks", "mid_block", "up_blocks")]
    ordered = [m for p in parts if isinstance(p, nn.Module) for m in p.modules()]
    seen = {id(m) for m in ordered}
    return ordered + [m for m in unet.modules() if id(m) not in seen]


def apply(unet: nn.Module) -> int:
    """Pack the time-embedding projections of ``unet``'s norm-fused ResNet blocks (``sdfast.passes.norms``
    first). Returns the blocks packed (0 when fewer than two can share one GEMM, or already applied)."""
    from diffusers.models.resnet import ResnetBlock2D

    if TEMB_PACK.get(unet) is not None:
        return 0
    blocks = [m for m in _call_order(unet) if isinstance(m, ResnetBlock2D) and NORMS_FUSED.get(m, False)
              and m.time_emb_proj is not None]
    pack = TembPack(blocks)
    if not pack.slices:
        return 0
    TEMB_PACK.set(unet, pack)
    for b in blocks:
        BLOCK_TEMB.set(b, pack)
    return len(pack.slices)


def refresh(unet: nn.Module) -> bool:
    """Repack ``unet``'s time-embedding projections if they changed (``TembPack.refresh``); False when not applied."""
    pack = TEMB_PACK.get(unet)
    return pack is not None and pack.refresh()


def undo(unet: nn.Module) -> int:
    """Unpack (each parameter its own storage again, same values). Returns the blocks that were packed."""
    pack = TEMB_PACK.clear(unet)
    if pack is None:
        return 0
    for b in pack.blocks:
        BLOCK_TEMB.clear(b)
    return pack.unpack()
