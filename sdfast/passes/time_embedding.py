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
- the pack's state changed (a module or parameter replaced, ``module.to(...)``): the leader repacks at its next
  call outside CUDA-graph capture (inside one, every block computes its own until then), and logs it.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from sdfast.passes._modules import runs_as_its_class
from sdfast.passes.norms import folded_conv_bias

log = logging.getLogger("sdfast")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


class TembPack:
    """The packed projections of ``blocks`` (ResnetBlock2D with a ``time_emb_proj``, in UNet call order)."""

    def __init__(self, blocks: list[nn.Module]):
        self.blocks = list(blocks)
        self.slices: dict[int, tuple[int, int]] = {}  # id(block) -> (first column, columns) in the pack
        self.leader: nn.Module | None = None
        self._state = None
        self._key = None  # (weakref to the temb the leader saw last, its version)
        self._out: torch.Tensor | None = None
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
        """(Re)build the pack from the blocks' current parameters; returns how many blocks it holds."""
        self._detach()
        self.slices, self.leader, self._key, self._out = {}, None, None, None
        plain = [b for b in self.blocks if runs_as_its_class(b.time_emb_proj, nn.Linear)]
        members = [b for b in self.blocks if plain and self._usable(b, plain[0].time_emb_proj.weight)]
        if len(members) >= 2:
            with torch.no_grad():
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
        self.weight, self.b_proj, self.b_conv = torch.cat(ws), torch.cat(bp), torch.cat(bc)
        first = 0
        for b in members:
            n = b.time_emb_proj.out_features
            proj, cb = b.time_emb_proj, folded_conv_bias(b.conv1)
            proj.weight.data = self.weight[first:first + n]
            if proj.bias is not None:
                proj.bias.data = self.b_proj[first:first + n]
            if cb is not None:
                cb.data = self.b_conv[first:first + n]
            self.slices[id(b)] = (first, n)
            first += n

    def unpack(self) -> int:
        """Give every packed parameter its own storage again; returns how many blocks were packed."""
        n = len(self.slices)
        self._detach()
        self.slices, self.leader, self._key, self._out = {}, None, None, None
        return n

    def _detach(self) -> None:
        """Clone every parameter of the blocks' projections and conv1s (wrapped ones too) that is a view of the
        pack, so that a dropped pack's storage is freed."""
        if not self.slices:
            return
        packs = {t.untyped_storage().data_ptr() for t in (self.weight, self.b_proj, self.b_conv)}
        with torch.no_grad():
            for b in self.blocks:
                for t in (*b.time_emb_proj.parameters(), *b.conv1.parameters()):
                    if t.untyped_storage().data_ptr() in packs:
                        t.data = t.data.clone()

    # ---- per call -------------------------------------------------------------------------------------
    def lookup(self, block: nn.Module, temb: torch.Tensor) -> torch.Tensor | None:
        """``block``'s ``time_emb_proj(silu(temb))`` + conv1's folded bias, (B, C), a column slice of the packed
        result; None when the block must compute its own (see the module docstring)."""
        if block is self.leader or (self.leader is None and block is self.blocks[0]):
            self._out = self._compute(temb)
            self._key = (weakref.ref(temb), _version(temb))
        elif self._key is None or self._key[0]() is not temb or self._key[1] != _version(temb):
            return None
        if self._out is None or id(block) not in self.slices:
            return None
        first, n = self.slices[id(block)]
        return self._out[:, first:first + n]

    def _compute(self, temb: torch.Tensor) -> torch.Tensor | None:
        if self.state() != self._state:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return None  # no new parameter storage inside a capture: each block computes its own
            n = self.pack()
            # INFO once per pack, then DEBUG: a model offloaded to the CPU between calls moves (repacks) every call
            log.log(logging.DEBUG if self._repacks else logging.INFO,
                    "sdfast: time-embedding projections repacked (a module or parameter changed): %d blocks", n)
            self._repacks += 1
        if self.leader is None or temb.dim() != 2:
            return None
        return F.linear(F.silu(temb), self.weight, self.b_proj + self.b_conv)


def apply(unet: nn.Module) -> int:
    """Pack the time-embedding projections of ``unet``'s norm-fused ResNet blocks (``sdfast.passes.norms``
    first). Returns the blocks packed (0 when fewer than two can share one GEMM, or already applied)."""
    from diffusers.models.resnet import ResnetBlock2D

    if getattr(unet, "_sdfast_temb_pack", None) is not None:
        return 0
    blocks = [m for m in unet.modules() if isinstance(m, ResnetBlock2D) and getattr(m, "_sdfast_norms", False)
              and m.time_emb_proj is not None]
    pack = TembPack(blocks)
    if not pack.slices:
        return 0
    unet._sdfast_temb_pack = pack
    for b in blocks:
        b._sdfast_temb = pack
    return len(pack.slices)


def undo(unet: nn.Module) -> int:
    """Unpack (each parameter its own storage again, same values). Returns the blocks that were packed."""
    pack = getattr(unet, "_sdfast_temb_pack", None)
    if pack is None:
        return 0
    for b in pack.blocks:
        b.__dict__.pop("_sdfast_temb", None)
    del unet._sdfast_temb_pack
    return pack.unpack()
