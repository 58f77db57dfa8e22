"""GPU tests (marker ``gpu``): our flash-attention kernel at every SD attention shape against fp32
math attention, every attention backend the dispatcher can pick, CUDA-graph capture, and the
attention pass on real-config SD1.5 / SDXL UNets (random weights, fp16, batch 2) against stock.

Run on the GPU machine: ``python -m pytest -m gpu tests/kernels/attention/test_attention_gpu.py -q``
(needs diffusers: it travels as a wheel). Skipped without CUDA.
"""

import math

import pytest
import torch

from kernels.attention.flash_attention import attention_ref, flash_attention
from kernels.testing import assert_close_rule

pytestmark = pytest.mark.gpu

DEV = "cuda"

# (name, B, H, Lq, Lk, D, upcast)
SD_SHAPES = [
    # SD1.5 512²: 8 heads of 40/80/160 (latent 64², 32², 16², mid 8²), cross over 77 tokens
    ("sd15-self-64x64", 2, 8, 4096, 4096, 40, False),
    ("sd15-cross-64x64", 2, 8, 4096, 77, 40, False),
    ("sd15-self-32x32", 2, 8, 1024, 1024, 80, False),
    ("sd15-cross-32x32", 2, 8, 1024, 77, 80, False),
    ("sd15-self-16x16", 2, 8, 256, 256, 160, False),
    ("sd15-cross-16x16", 2, 8, 256, 77, 160, False),
    ("sd15-self-8x8", 2, 8, 64, 64, 160, False),
    ("sd15-cross-8x8", 2, 8, 64, 77, 160, False),
    # SD2.1 768²: heads of 64 (5/10/20), upcast_attention; latent 96² and a 65x65 odd grid
    ("sd21-self-96x96", 2, 5, 9216, 9216, 64, True),
    ("sd21-cross-96x96", 2, 5, 9216, 77, 64, True),
    ("sd21-self-48x48", 2, 10, 2304, 2304, 64, True),
    ("sd21-self-24x24", 2, 20, 576, 576, 64, True),
    ("sd21-self-65x65", 2, 5, 4225, 4225, 64, True),
    ("sd21-cross-65x65-154", 2, 5, 4225, 154, 64, True),
    # SDXL 1024²: heads of 64 (10 at 64², 20 at 32²), cross over 77 tokens
    ("sdxl-self-64x64", 2, 10, 4096, 4096, 64, False),
    ("sdxl-cross-64x64", 2, 10, 4096, 77, 64, False),
    ("sdxl-self-32x32", 2, 20, 1024, 1024, 64, False),
    ("sdxl-cross-32x32", 2, 20, 1024, 77, 64, False),
    # VAE mid-block: one head of 512 (upcast_softmax), decode of 512² and 1024² images
    ("vae-64x64", 1, 1, 4096, 4096, 512, True),
    ("vae-128x128", 1, 1, 16384, 16384, 512, True),
]
DTYPES = [(torch.float16, 1e-3), (torch.bfloat16, 5e-3)]


def _views(B, H, Lq, Lk, D, dtype, self_attn):
    """q, k, v the way the processor passes them: (B, H, L, D) views of fused projections."""
    if self_attn:
        qkv = torch.randn(B, Lq, 3, H, D, device=DEV, dtype=dtype)
        return tuple(t.transpose(1, 2) for t in qkv.unbind(2))
    q = torch.randn(B, Lq, H, D, device=DEV, dtype=dtype).transpose(1, 2)
    kv = torch.randn(B, Lk, 2, H, D, device=DEV, dtype=dtype)
    k, v = (t.transpose(1, 2) for t in kv.unbind(2))
    return q, k, v


def _ref32(q, k, v, kpm=None):
    # chunked over heads so that the VAE 16384² score matrix stays at 1 GiB
    outs = [
        attention_ref(q[:, h : h + 1].float(), k[:, h : h + 1].float(), v[:, h : h + 1].float(), key_padding_mask=kpm)
        for h in range(q.shape[1])
    ]
    return torch.cat(outs, dim=1)


def _sdpa_lowp(q, k, v, kpm=None):
    mask = None if kpm is None else kpm[:, None, None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,B,H,Lq,Lk,D,upcast", SD_SHAPES, ids=[s[0] for s in SD_SHAPES])
def test_kernel_sd_shapes(name, B, H, Lq, Lk, D, upcast, dtype, atol):
    torch.manual_seed(0)
    q, k, v = _views(B, H, Lq, Lk, D, dtype, self_attn=Lq == Lk)
    out = flash_attention(q, k, v, upcast_softmax=upcast)
    ref32 = _ref32(q, k, v)
    assert_close_rule(out, ref32, _sdpa_lowp(q, k, v), atol=atol, name=name)


@pytest.mark.parametrize("dtype,atol", DTYPES, ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [40, 64, 80, 160, 512])
def test_kernel_key_padding_mask(D, dtype, atol):
    torch.manual_seed(0)
    B, H, Lq, Lk = 2, 2 if D == 512 else 8, 1024, 154
    q, k, v = _views(B, H, Lq, Lk, D, dtype, self_attn=False)
    kpm = torch.ones(B, Lk, dtype=torch.bool, device=DEV)
    kpm[0, 77:] = False  # CFG-style padding of a second 77-token chunk
    kpm[1, ::5] = False
    out = flash_attention(q, k, v, key_padding_mask=kpm)
    assert_close_rule(out, _ref32(q, k, v, kpm), _sdpa_lowp(q, k, v, kpm), atol=atol, name=f"mask D{D}")
    none = torch.zeros_like(kpm)
    assert (flash_attention(q, k, v, key_padding_mask=none) == 0).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_upcast_keeps_p_precision(dtype):
    # probabilities that the input dtype rounds systematically (see the CPU test): plain P.V loses
    # the answer, upcast_softmax recovers it; both on the GPU's tensor cores
    Lk, D = 77, 64
    ulp = 2**-12 if dtype == torch.float16 else 2**-9
    target = 0.75 + 0.8 * ulp
    b1 = torch.tensor(math.log(target)).to(dtype)
    b2 = ((math.log(target) - b1.double()) * 64).to(dtype)
    q = torch.zeros(1, 1, 130, D, dtype=dtype, device=DEV)
    q[..., 0], q[..., 1] = 1.0, 1.0 / 64
    k = torch.zeros(1, 1, Lk, D, dtype=dtype, device=DEV)
    k[0, 0, 1:, 0], k[0, 0, 1:, 1] = b1, b2
    v = torch.zeros(1, 1, Lk, D, dtype=dtype, device=DEV)
    v[0, 0, 0, 0] = -(Lk - 1) * 0.75
    v[0, 0, 1:, 0] = 1.0
    ref = attention_ref(q, k, v, scale=1.0).float()
    assert ref.abs().max() > 1e-4
    plain = flash_attention(q, k, v, scale=1.0).float()
    up = flash_attention(q, k, v, scale=1.0, upcast_softmax=True).float()
    assert (plain - ref).abs().max().item() > 0.3 * ref.abs().max().item()
    assert (up - ref).abs().max().item() < 0.05 * ref.abs().max().item()


@pytest.mark.parametrize("D", [40, 64, 160, 512])
def test_kernel_fp32(D):
    torch.manual_seed(0)
    q, k, v = _views(1, 2, 333, 77, D, torch.float32, self_attn=False)
    out = flash_attention(q, k, v)
    torch.testing.assert_close(out, _ref32(q, k, v), rtol=1e-4, atol=2e-5)


def test_kernel_in_cuda_graph():
    torch.manual_seed(0)
    q, k, v = _views(2, 8, 1024, 1024, 80, torch.float16, self_attn=True)
    flash_attention(q, k, v)  # warm-up: autotune outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = flash_attention(q, k, v)
    for _ in range(2):
        with torch.no_grad():
            q.copy_(torch.randn_like(q))
        g.replay()
        torch.cuda.synchronize()
        assert_close_rule(out, _ref32(q, k, v), _sdpa_lowp(q, k, v), atol=1e-3, name="graph replay")


def test_autotuning_is_shared_within_a_length_bucket():
    """SD1.5's second image size (640x512 after 512x512: 5120 queries after 4096) runs the config tuned for the
    power-of-two bucket of its lengths, with no new timing; another bucket (8192) is tuned. Each result right."""
    from kernels.attention import flash_attention as fa

    torch.manual_seed(0)
    kernel = fa._tuned_kernel(40, 2, "cuda", torch.cuda.current_device())
    keys = []
    for lq in (4096, 5120, 8192):
        q, k, v = _views(1, 8, lq, 77, 40, torch.float16, self_attn=False)
        out = flash_attention(q, k, v)
        assert_close_rule(out, _ref32(q, k, v), _sdpa_lowp(q, k, v), atol=1e-3, name=f"Lq {lq}")
        keys.append({key[:2] for key in kernel.cache})  # (LQ bucket, LK bucket) of every tuned config
    assert (4096, 64) in keys[0] and keys[1] == keys[0]  # 5120 queries: no new tuning
    assert (8192, 64) in keys[2] and all(b in (4096, 8192) for b, _ in keys[2] - keys[0])


# ---------------------------------------------------------------------------------------------
# dispatcher and backends
# ---------------------------------------------------------------------------------------------

DISPATCH_SHAPES = [s for s in SD_SHAPES if s[0] in (
    "sd15-self-64x64", "sd15-cross-64x64", "sd15-self-16x16", "sd21-self-65x65", "sdxl-self-32x32", "vae-64x64",
)]


@pytest.mark.parametrize("name,B,H,Lq,Lk,D,upcast", DISPATCH_SHAPES, ids=[s[0] for s in DISPATCH_SHAPES])
def test_dispatcher_backends(name, B, H, Lq, Lk, D, upcast, caplog, fresh_choices):
    from sdfast.passes import attention as ap

    torch.manual_seed(0)
    q, k, v = _views(B, H, Lq, Lk, D, torch.float16, self_attn=Lq == Lk)
    ref32 = _ref32(q, k, v)
    lowp = _sdpa_lowp(q, k, v)
    d = ap.AttentionDispatcher()
    with caplog.at_level("INFO", logger="sdfast.attention"):
        out = d(q, k, v, upcast=upcast)
    key = d.key_for(q, k, None, upcast)
    decided = d.decision(key)  # kernels.select's record
    picked, timings, excluded = decided.winner, decided.times_us, d.excluded().get(key, {})
    assert picked == min(timings, key=timings.get)
    assert "triton" in timings, f"our kernel was excluded: {excluded}"
    assert "sdpa" in timings, f"SDPA's default was excluded: {excluded}"
    # math is a candidate only below 2**27 score elements (its fp32 score matrix)
    assert ("math" in timings or "math" in excluded) == (B * H * Lq * Lk <= 2**27)
    for n in excluded:
        assert f"{n!r} excluded" in caplog.text
    assert_close_rule(out, ref32, lowp, atol=1e-3, name=f"{name} via {picked}")
    # every backend that is not excluded gives the right answer on this input
    for n in timings:
        o = d.backend_fn(n)(q, k, v, None, D**-0.5, upcast)
        assert_close_rule(o, ref32, lowp, atol=2e-3, name=f"{name} backend {n}")
    # a key first seen during capture: safe default, no measuring
    g = torch.cuda.CUDAGraph()
    q2, k2, v2 = q[:, :, : Lq // 2], k, v
    with torch.cuda.graph(g):
        o2 = d(q2, k2, v2, upcast=not upcast)
    g.replay()
    torch.cuda.synchronize()
    assert d.decision(d.key_for(q2, k2, None, not upcast)) is None
    assert torch.isfinite(o2).all()


def test_xformers_probe_is_safe():
    from sdfast.passes import attention as ap

    assert ap.xformers_works(torch.device(DEV)) in (True, False)  # never raises


# ---------------------------------------------------------------------------------------------
# the pass on real UNet configurations
# ---------------------------------------------------------------------------------------------

SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
)
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
    use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816, norm_num_groups=32,
)


def _unet_case(config, sdxl):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    with torch.device(DEV):
        unet32 = UNet2DConditionModel(**config).eval()
    side = config["sample_size"]
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(2, 4, side, side, device=DEV, generator=g)
    t = torch.tensor([999, 999], device=DEV)
    ehs = torch.randn(2, 77, config["cross_attention_dim"], device=DEV, generator=g)
    kw = {}
    if sdxl:
        kw["added_cond_kwargs"] = {
            "text_embeds": torch.randn(2, 1280, device=DEV, generator=g),
            "time_ids": torch.tensor([[1024, 1024, 0, 0, 1024, 1024]] * 2, device=DEV, dtype=torch.float32),
        }
    with torch.no_grad():
        ref32 = unet32(x, t, ehs, **kw).sample.float()
    unet16 = unet32.half()
    x16, ehs16 = x.half(), ehs.half()
    kw16 = {"added_cond_kwargs": {k: v.half() for k, v in kw["added_cond_kwargs"].items()}} if sdxl else {}
    return unet16, (x16, t, ehs16), kw16, ref32


@pytest.mark.parametrize("backend", [None, "triton"], ids=["dispatch", "triton"])
@pytest.mark.parametrize("model", ["sd15", "sdxl"])
def test_unet_parity(model, backend):
    from sdfast.passes import attention as ap

    sdxl = model == "sdxl"
    unet, args, kw, ref32 = _unet_case(SDXL_UNET if sdxl else SD15_UNET, sdxl)
    with torch.no_grad():
        stock = unet(*args, **kw).sample.float()
        n = ap.apply(unet, dispatcher=ap.AttentionDispatcher(backend))
        assert n == (140 if sdxl else 32)
        ours = unet(*args, **kw).sample.float()
        ours_again = unet(*args, **kw).sample.float()  # dispatcher cache warm
        assert ap.undo(unet) == n
        back = unet(*args, **kw).sample.float()
    assert torch.equal(back, stock)
    if backend == "triton":  # our kernel is deterministic
        assert torch.equal(ours_again, ours)
    assert_close_rule(ours, ref32, stock, atol=2e-3, name=f"{model} UNet via {backend or 'dispatcher'}")


def test_vae_decoder_parity():
    from diffusers import AutoencoderKL

    from sdfast.passes import attention as ap

    torch.manual_seed(0)
    with torch.device(DEV):
        vae = AutoencoderKL(
            block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=2, latent_channels=4, norm_num_groups=32, sample_size=512,
        ).eval()
    z = torch.randn(1, 4, 64, 64, device=DEV)
    with torch.no_grad():
        ref32 = vae.decode(z).sample.float()
        vae.half()
        stock = vae.decode(z.half()).sample.float()
        assert ap.apply(vae, dispatcher=ap.AttentionDispatcher()) == 2
        ours = vae.decode(z.half()).sample.float()
        ap.undo(vae)
    assert_close_rule(ours, ref32, stock, atol=2e-3, name="VAE decode")


@pytest.mark.parametrize("lq", [4096, 16384])
def test_tf32_backend_on_the_fp32_vae_shape_and_in_a_cuda_graph(lq):
    """The SDXL VAE's mid-block attention (1 head of 512, 128x128 latents at 1024²) in TF32: within fp16's
    tolerance of fp32 math, and the same numbers replayed from a CUDA graph (the TF32 flag is read at capture)."""
    from sdfast.passes.attention import backends
    from sdfast.passes.attention.dispatch import mismatch

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 1, lq, 512, device="cuda", generator=g) for _ in range(3))
    scale = 512**-0.5
    before = torch.backends.cuda.matmul.allow_tf32
    out = backends._tf32_backend(q, k, v, None, scale, False)
    ref = backends.reference(q, k, v, None, scale)
    assert mismatch(out, ref, torch.float16) is None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = backends._tf32_backend(q, k, v, None, scale, False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)
    assert torch.backends.cuda.matmul.allow_tf32 == before  # the caller's setting is back
