"""Issue 6: the benchmark's format on the CPU (random:tiny, 2 steps; numbers meaningless), the kernel
benchmark aggregator, the reference table and the profile breakdown's categories."""

import csv
import json
import math
import sys
import types

import pytest

from benchmarks import bench_kernels, bench_txt2img, profile_step, reference, unet_profile
from benchmarks.report import PUBLISHED_LABEL, fmt, markdown_table

TINY = ["--models", "tiny", "--steps", "2", "--size", "64", "--repeats", "1"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One end-to-end run: stock, sdfast, and a system that fails at build (must become an error row)."""
    def broken(spec, ctx):
        raise RuntimeError("deliberately broken system")

    import io
    from contextlib import redirect_stdout

    out = tmp_path_factory.mktemp("bench")
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(bench_txt2img.SYSTEMS, "broken", bench_txt2img.System("broken", broken, "fails at build (test)"))
        # sdfast's Triton kernels run their PyTorch references in this run (kernels.dispatch reads
        # TRITON_INTERPRET per call): the interpreter would take minutes here, and tests/kernels covers them.
        mp.setenv("TRITON_INTERPRET", "0")
        with redirect_stdout(buf):
            rc = bench_txt2img.main([*TINY, "--systems", "stock,broken,sdfast", "--profile", "--fp32-ref",
                                     "--second-size", "--out", str(out)])
    return rc, buf.getvalue(), out


def _rows(out):
    return json.loads((out / "txt2img.json").read_text())


def test_run_writes_every_file(tiny_run):
    rc, _, out = tiny_run
    assert rc == 0
    for name in ("txt2img.csv", "txt2img.json", "txt2img.png", "txt2img.md", "profile.csv"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "txt2img.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measured_rows_have_every_column(tiny_run):
    _, _, out = tiny_run
    rows = {r["system"]: r for r in _rows(out)["rows"]}
    assert list(rows) == ["stock", "broken", "sdfast"]  # stock first, order of --systems otherwise
    measured = [rows["stock"], rows["sdfast"]]
    for r in measured:
        for key in bench_txt2img.MEASURED_KEYS + ["peak_reserved_gib", "load_s", "unet_timing", "config", "env"]:
            assert r[key] not in (None, ""), (r["system"], key)
        assert r["size"] == "64x64" and r["steps"] == 2 and r["model"] == "tiny"
        assert r["second_size"] == "192x64" and r["second_size_s"] > 0
        assert r["unet_calls_per_image"] == 3  # tiny's PNDM (skip_prk_steps) runs steps + 1 UNet calls, CFG batched
        assert 0 < r["load_s"] <= r["warmup_s"]
        assert r["e2e_s"] > 0 and math.isclose(r["img_s"], 1 / r["e2e_s"])
        assert r["fp32_check"] == "n/a" and r["err_fp32_step"] is not None and r["err_fp32_steps"] is not None
        assert r["profile"]["categories"]["conv"]["kernels"] > 0
        assert r["env"]["torch"] and r["env"]["date"]
    # stock on a CPU is deterministic: its timed image equals its first one
    assert rows["stock"]["psnr_db"] == "inf"
    assert rows["stock"]["config"]["optimize"] is False


def test_e2e_breakdown_adds_up(tiny_run):
    _, text, out = tiny_run
    for r in (r for r in _rows(out)["rows"] if r["system"] != "broken"):
        b = r["e2e_breakdown"]
        assert math.isclose(b["e2e_ms"], r["e2e_s"] * 1e3)
        assert b["text_encoder_ms"] > 0 and b["vae_decoder_ms"] > 0 and b["unet_sum_ms"] > 0
        assert b["denoise_loop_ms"] >= b["unet_sum_ms"] and math.isclose(b["loop_gaps_ms"], b["denoise_loop_ms"] - b["unet_sum_ms"])
        # the spans are measured apart from the wall clock: together they fit inside it
        assert b["denoise_loop_ms"] <= b["e2e_ms"] and b["rest_ms"] >= 0
    assert "Where one image's time goes" in text


def test_sdfast_row_config_comes_from_the_pipeline(tiny_run):
    _, _, out = tiny_run
    r = {r["system"]: r for r in _rows(out)["rows"]}["sdfast"]
    assert r["error"] is None
    from sdfast import KernelPolicy, OptimizeConfig

    expected = OptimizeConfig(kernels=KernelPolicy.from_env()).as_dict()  # the policy optimize resolved
    assert {k: r["config"][k] for k in expected} == expected
    assert r["config"]["optimize"] is True and "counts" in r["info"]
    assert r["psnr_db"] == "inf" or r["psnr_db"] >= 35  # the engine's parity bar, against stock's image


def test_failing_system_gives_an_error_row(tiny_run):
    _, text, out = tiny_run
    row = {r["system"]: r for r in _rows(out)["rows"]}["broken"]
    assert row["error"] == "build: RuntimeError: deliberately broken system"
    assert row["e2e_s"] is None and row["model"] == "tiny"
    assert "tiny/broken failed: build: RuntimeError: deliberately broken system" in text


def test_stdout_table_and_reference_rows_are_labelled(tiny_run):
    _, text, _ = tiny_run
    measured, _, published = text.partition("## Reference")
    header = "| " + " | ".join(h for _, h in bench_txt2img.TABLE_COLUMNS) + " |"
    assert header in measured
    assert "| stock | tiny | 64x64 | 2 |" in measured
    assert "TensorRT" not in measured.split("TensorRT:")[0]  # no reference row among the measured ones
    assert PUBLISHED_LABEL in published
    for r in reference.REFERENCE:
        assert f"| {r['system']} | {r['gpu']} | {r['model_size_steps']} | {r['figure']} |" in published
    assert "tensorrt" in text.lower() and ("not importable" in text or "is importable" in text)


def test_csv_has_measured_and_labelled_reference_rows(tiny_run):
    _, _, out = tiny_run
    with (out / "txt2img.csv").open() as f:
        rows = list(csv.DictReader(f))
    measured = [r for r in rows if not r.get("published")]
    published = [r for r in rows if r.get("published")]
    assert [r["system"] for r in measured] == ["stock", "broken", "sdfast"]
    assert all(r["env_torch"] for r in measured)
    assert len(published) == len(reference.REFERENCE)
    assert all(r["published"] == PUBLISHED_LABEL and r["source"] and r["gpu"] for r in published)
    assert json.loads(measured[0]["config"])["optimize"] is False


# ----------------------------------------------------------------------------- img2img and inpainting (issue 31)


def _quiet_main(argv, monkeypatch=None, tasks=None):
    """``bench_txt2img.main(argv)`` with sdfast's kernels on their PyTorch references (as ``tiny_run``), extra
    ``tasks`` put in ``TASKS``; returns (exit code, stdout)."""
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        mp.setitem(bench_txt2img.SYSTEMS, "broken", bench_txt2img.System("broken", _broken, "fails at build (test)"))
        for task in tasks or []:
            mp.setitem(bench_txt2img.TASKS, task.name, task)
        with redirect_stdout(buf):
            rc = bench_txt2img.main(argv)
    return rc, buf.getvalue()


def _broken(spec, ctx):
    raise RuntimeError("deliberately broken system")


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    """txt2img, img2img and inpaint on stock and sdfast in one run (tasks given out of order), images saved, at a
    size that is not the model's native one (64x64): the stock inpaint pipeline must be given it."""
    out = tmp_path_factory.mktemp("bench-tasks")
    rc, text = _quiet_main([*TINY, "--size", "96x64", "--task", "inpaint,img2img,txt2img", "--systems", "stock,sdfast", "--no-fp32-ref",
                            "--save-images", "--out", str(out)])
    return rc, text, out


def _image(out, name):
    from PIL import Image

    return Image.open(out / "images" / f"{name}.png")


def test_tasks_give_one_row_per_system_and_task(task_run):
    rc, _, out = task_run
    assert rc == 0
    rows = _rows(out)["rows"]
    assert [(r["system"], r["task"]) for r in rows] == [(s, t) for s in ("stock", "sdfast")  # txt2img first
                                                        for t in ("txt2img", "inpaint", "img2img")]
    by = {(r["system"], r["task"]): r for r in rows}
    for (system, task), r in by.items():
        assert r["error"] is None, (system, task, r["error"])
        assert r["size"] == "96x64" and r["steps"] == 2 and r["e2e_s"] > 0 and r["unet_ms_step"] > 0
        assert r["peak_gib"] > 0 and r["config"]["optimize"] is (system == "sdfast")
        base = by[(system, "txt2img")]
        # one build and one txt2img warm-up per system, shared by its rows
        assert (r["load_s"], r["warmup_s"], r["info"]) == (base["load_s"], base["warmup_s"], base["info"])
        # only the steps that run are timed: int(steps * strength); PNDM (skip_prk_steps) adds one UNet call
        assert r["unet_calls_per_image"] - r["steps_run"] == base["unet_calls_per_image"] - base["steps"] == 1
        if task == "txt2img":
            assert (r["strength"], r["steps_run"], r["first_image_s"], r["step_vs_txt2img"]) == (None, 2, None, None)
            assert "vae_encoder_ms" not in r["e2e_breakdown"]
        else:
            assert r["first_image_s"] > 0
            assert math.isclose(r["step_vs_txt2img"], r["unet_ms_step"] / base["unet_ms_step"])
            assert r["e2e_breakdown"]["vae_encoder_ms"] > 0  # the init image's encode: a phase of its own
            assert r["e2e_breakdown"]["rest_ms"] >= 0
    assert (by[("sdfast", "img2img")]["strength"], by[("sdfast", "img2img")]["steps_run"]) == (0.6, 1)
    assert (by[("sdfast", "inpaint")]["strength"], by[("sdfast", "inpaint")]["steps_run"]) == (1.0, 2)
    with (out / "txt2img.csv").open() as f:
        measured = [r for r in csv.DictReader(f) if not r.get("published")]
    assert [(r["system"], r["task"], r["strength"]) for r in measured][:3] == [
        ("stock", "txt2img", ""), ("stock", "inpaint", "1.0"), ("stock", "img2img", "0.6")]


def test_task_fidelity_is_against_stock_diffusers_pipeline_of_the_task(task_run):
    """Each task's PSNR is against diffusers' own pipeline of that task (not txt2img's image): made again here,
    straight from diffusers, it is the saved reference pixel for pixel."""
    import numpy as np
    import torch
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline

    import sdfast

    _, _, out = task_run
    by = {(r["system"], r["task"]): r for r in _rows(out)["rows"]}
    for task in ("img2img", "inpaint"):
        assert by[("stock", task)]["psnr_db"] == "inf"  # the stock engine runs that pipeline (CPU: deterministic)
        assert by[("sdfast", task)]["psnr_db"] == "inf" or by[("sdfast", task)]["psnr_db"] >= 35
    init, mask = _image(out, "tiny-img2img-image"), _image(out, "tiny-inpaint-mask_image")
    assert np.array_equal(np.asarray(init), np.asarray(bench_txt2img.init_image(96, 64)))
    assert np.array_equal(np.asarray(mask), np.asarray(bench_txt2img.centre_mask(96, 64)))
    pipe = sdfast.load("random:tiny", optimize=False).pipe
    def common():  # a fresh generator per call: the pipelines draw from it
        return dict(prompt=bench_txt2img.PROMPT, num_inference_steps=2, guidance_scale=7.5,
                    generator=[torch.Generator("cpu").manual_seed(0)])

    img2img = StableDiffusionImg2ImgPipeline.from_pipe(pipe)(image=init, strength=0.6, **common()).images[0]
    inpaint = StableDiffusionInpaintPipeline.from_pipe(pipe)(image=init, mask_image=mask, strength=1.0, height=64,
                                                             width=96, **common()).images[0]
    assert bench_txt2img.psnr(img2img, _image(out, "tiny-stock_diffusers-img2img")) == math.inf
    assert bench_txt2img.psnr(inpaint, _image(out, "tiny-stock_diffusers-inpaint")) == math.inf
    # the tasks' images are not txt2img's, nor each other's: a wrong reference would show in the PSNR
    txt2img = _image(out, "tiny-stock-txt2img")
    assert bench_txt2img.psnr(img2img, txt2img) < 30 and bench_txt2img.psnr(inpaint, txt2img) < 30
    assert bench_txt2img.psnr(img2img, inpaint) < 30
    assert bench_txt2img.psnr(_image(out, "tiny-sdfast-img2img"), img2img) >= 35


def test_task_table_labels_the_tasks(task_run):
    _, text, out = task_run
    header = "| " + " | ".join(h for _, h in bench_txt2img.TASK_TABLE_COLUMNS) + " |"
    assert header in text and "| stock | tiny | img2img | 0.600 | 96x64 | 2 | 1 |" in text
    assert "| sdfast | tiny | txt2img | — | 96x64 | 2 | 2 |" in text
    assert "| tiny/sdfast/inpaint |" in text  # the breakdown's rows, with the task
    assert (out / "txt2img.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_result_rows_from_before_tasks_render_as_txt2img(tiny_run):
    """Old result files (rows without task, strength, ...) render with txt2img's columns, as they did."""
    from benchmarks import report

    _, _, out = tiny_run
    data = _rows(out)
    new = {"task", "strength", "steps_run", "first_image_s", "step_vs_txt2img"}
    old = [{k: v for k, v in r.items() if k not in new} for r in data["rows"]]
    text = bench_txt2img.render(old, data["env"])
    assert "| " + " | ".join(h for _, h in bench_txt2img.TABLE_COLUMNS) + " |" in text
    assert "first image s" not in text and "tiny/broken failed: build:" in text
    report.plot_txt2img(out / "old.png", old, reference.REFERENCE)


def test_a_task_is_one_table_entry_and_stock_references_come_without_stock(tmp_path):
    """A new task is one ``Task``; without 'stock' among the systems its reference is still stock diffusers'
    pipeline of the task; --strength sets every task's strength; a broken system fails each of its task rows."""
    variation = bench_txt2img.Task("variation", "img2img", bench_txt2img.TASKS["img2img"].stock_pipeline,
                                   bench_txt2img.TASKS["img2img"].inputs, strength=0.9)
    rc, text = _quiet_main([*TINY, "--task", "variation", "--strength", "0.5", "--systems", "sdfast,broken",
                            "--no-fp32-ref", "--out", str(tmp_path)], tasks=[variation])
    assert rc == 0
    rows = _rows(tmp_path)["rows"]
    assert [(r["system"], r["task"]) for r in rows] == [("sdfast", "variation"), ("broken", "variation")]
    r = rows[0]
    assert r["error"] is None and (r["strength"], r["steps_run"]) == (0.5, 1)
    assert r["psnr_db"] == "inf" or r["psnr_db"] >= 35
    assert r["step_vs_txt2img"] is None and r["warmup_s"] > 0 and r["first_image_s"] > 0  # txt2img warmed it up
    assert rows[1]["error"] == "build: RuntimeError: deliberately broken system"
    assert "tiny/broken/variation failed: build: RuntimeError" in text


def test_init_image_and_mask_are_deterministic_smooth_and_centred():
    import numpy as np

    a = np.asarray(bench_txt2img.init_image(96, 64), np.float64)
    assert a.shape == (64, 96, 3) and np.array_equal(a, np.asarray(bench_txt2img.init_image(96, 64)))
    assert a.std() > 20 and a.min() >= 0 and (a > 0).all(axis=-1).mean() > 0.99  # not flat, not black
    assert np.abs(np.diff(a, axis=0)).mean() < 4 and np.abs(np.diff(a, axis=1)).mean() < 4  # smooth
    assert not np.array_equal(a, np.asarray(bench_txt2img.init_image(96, 64, seed=1)))
    m = np.asarray(bench_txt2img.centre_mask(96, 64))
    assert m.shape == (64, 96) and set(np.unique(m)) == {0, 255}
    assert (m == 255).mean() == 0.25 and m[32, 48] == 255 and m[0, 0] == m[-1, -1] == 0
    assert np.array_equal(m, m[::-1, ::-1])  # centred


def test_e2e_breakdown_with_a_second_step_module():
    """A step that runs a second model before the UNet (a ControlNet): the loop's span starts at its first call,
    both sums are reported and only the rest is counted as gaps."""
    def timer(pairs):
        t = bench_txt2img.UnetTimer(None, cuda=False)
        t.pairs = pairs
        return t

    # seconds; two images of two steps: controlnet then unet in each step
    control = timer([(0.0, 0.1), (0.35, 0.45), (1.0, 1.1), (1.35, 1.45)])
    unet = timer([(0.1, 0.3), (0.45, 0.65), (1.1, 1.3), (1.45, 1.65)])
    phases = {"vae_decoder": timer([(0.7, 0.8), (1.7, 1.8)])}
    b = bench_txt2img.e2e_breakdown({"controlnet": control, "unet": unet}, phases, [0.9, 0.9], 2)
    assert math.isclose(b["denoise_loop_ms"], 650) and math.isclose(b["controlnet_sum_ms"], 200)
    assert math.isclose(b["unet_sum_ms"], 400) and math.isclose(b["loop_gaps_ms"], 50)
    assert math.isclose(b["vae_decoder_ms"], 100) and math.isclose(b["rest_ms"], 900 - 650 - 100)
    only = bench_txt2img.e2e_breakdown(unet, phases, [0.9, 0.9], 2)  # txt2img's: the keys and order as before
    assert list(only) == ["e2e_ms", "denoise_loop_ms", "unet_sum_ms", "loop_gaps_ms", "vae_decoder_ms", "rest_ms"]
    assert math.isclose(only["denoise_loop_ms"], 550) and math.isclose(only["loop_gaps_ms"], 150)


def test_cli_bench_forwards_its_arguments(monkeypatch):
    from sdfast.cli import main

    seen = []
    monkeypatch.setattr(bench_txt2img, "main", lambda argv=None: seen.append(argv) or 0)
    assert main(["bench", *TINY, "--systems", "stock", "--no-fp32-ref"]) == 0
    assert seen == [[*TINY, "--systems", "stock", "--no-fp32-ref"]]


@pytest.mark.parametrize("argv, message", [
    (["--systems", "stock,nope"], "unknown system"),
    (["--models", "nope"], "random:tiny"),
    (["--repeats", "0"], ">= 1"),
    (["--task", "txt2img,video"], "unknown task(s) ['video']"),
    (["--task", "img2img", "--strength", "0"], "(0, 1]"),
    (["--models", "tiny", "--steps", "1", "--task", "img2img", "--strength", "0.5"], "run no denoising step"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_txt2img.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_match_the_issue():
    args = bench_txt2img.build_parser().parse_args([])
    ctx = bench_txt2img.Context(device="cpu")
    specs = {s.label: s for s in bench_txt2img.model_specs(args, ctx)}
    assert list(specs) == ["sd15", "sdxl"]
    assert (specs["sd15"].steps, specs["sdxl"].steps) == (50, 30)
    assert specs["sd15"].fp32_ref and specs["sdxl"].fp32_ref  # the fp32 check covers SD1.5 and SDXL (issue 29)
    assert specs["sd15"].height is None  # native size
    assert args.repeats == 3 and args.batch == 1 and args.guidance == 7.5
    assert bench_txt2img.parse_systems(args.systems) == ["stock", "compile", "sdfast"]
    assert bench_txt2img.COMPILE_KWARGS == {"mode": "reduce-overhead", "fullgraph": True}
    assert bench_txt2img.parse_size("768x512") == (512, 768) and bench_txt2img.parse_size("64") == (64, 64)
    for bad in ("63", "0", "-8", "9000", "abc", "64x", "8x8x8"):
        with pytest.raises(ValueError, match="--size"):
            bench_txt2img.parse_size(bad)
    assert args.task == "txt2img" and args.strength is None  # txt2img alone, as before
    assert bench_txt2img.parse_tasks("inpaint,txt2img,img2img,inpaint") == ["txt2img", "inpaint", "img2img"]
    assert (bench_txt2img.TASKS["img2img"].strength, bench_txt2img.TASKS["inpaint"].strength) == (0.6, 1.0)


def test_psnr_and_error():
    import numpy as np
    from PIL import Image

    a = Image.fromarray(np.full((8, 8, 3), 100, np.uint8))
    b = Image.fromarray(np.full((8, 8, 3), 110, np.uint8))
    assert bench_txt2img.psnr(a, a) == math.inf
    assert math.isclose(bench_txt2img.psnr(a, b), 10 * math.log10(255**2 / 100))
    assert bench_txt2img.mean_abs_error(a, b) == 10


def test_reference_rows():
    assert len(reference.REFERENCE) == 13
    for r in reference.REFERENCE:
        assert r["label"] == PUBLISHED_LABEL and r["source"] and r["gpu"] and r["figure"]
        assert r["arch"] in ("sd15", "sdxl")
        if r["unit"] == "images/s per GPU":  # a throughput row (MLPerf): compared with --throughput's best_img_s
            assert r["value"] > 0 and r["e2e_s"] is None and r["unet_ms_step"] is None
        else:
            assert r["e2e_s"] is not None or r["unet_ms_step"] is not None
    by = {(r["system"], r["arch"]): r for r in reference.REFERENCE}
    assert by[("TensorRT 9.0 (static shapes, CUDA graph)", "sd15")]["e2e_s"] == 0.819
    assert math.isclose(by[("stable-fast", "sd15")]["unet_ms_step"], 1000 / 104.6)
    assert by[("TensorRT", "sdxl")]["gpu"] in ("H100", "A100")


@pytest.mark.parametrize("name, category", [
    ("void cudnn::ops::nchwToNhwcKernel<__half, __half, float, false, true>(...)", "layout copies"),
    ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}>", "layout copies"),
    ("void at::native::(anonymous namespace)::RowwiseMomentsCUDAKernel<c10::Half>(long, float, c10::Half const*, float*, float*)", "GroupNorm"),
    ("void at::native::elementwise_kernel<128, 2, at::native::(anonymous namespace)::GroupNormKernelImplInternal<c10::Half>", "GroupNorm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel(at::TensorIteratorBase&)", "SiLU/elementwise"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>, std::array<char*, 3ul> >", "adds"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, at::native::GeluType)", "GELU/GEGLU"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::Half, float>", "LayerNorm"),
    ("sm90_xmma_fprop_implicit_gemm_f16f16_f16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "conv"),
    ("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_f16_s16816fprop_optimized_f16_128x128_32x3_nhwc_align8>", "conv"),
    ("sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "GEMM"),
    ("nvjet_hsh_128x256_64x4_1x2_h_bz_coopB_NTN", "GEMM"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 64, 4>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "attention"),
    ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", "attention"),
    ("triton_red_fused_native_group_norm_silu_3", "GroupNorm"),
    ("triton_poi_fused_add_convolution_5", "adds"),
    ("triton_tem_fused_mm_7", "GEMM"),
    ("Memcpy DtoD (Device -> Device)", "memcpy/memset"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>", "other"),
])
def test_categorize_kernel_names(name, category):
    assert unet_profile.categorize(name, sdfast_names=frozenset()) == category


def test_sdfast_triton_kernels_by_name(tmp_path):
    (tmp_path / "k.py").write_text("import triton\n@triton.autotune(configs=[])\n@triton.jit\ndef _gn_silu_fwd(\n  x_ptr,\n):\n  pass\n")
    names = unet_profile.sdfast_kernel_names.__wrapped__(str(tmp_path))
    assert names == frozenset({"_gn_silu_fwd"})
    assert unet_profile.categorize("_gn_silu_fwd", sdfast_names=names) == "sdfast:_gn_silu_fwd"
    events = [("_gn_silu_fwd", 30.0, "kernel"), ("void cudnn::ops::nhwcToNchwKernel<>", 10.0, "kernel"),
              ("void cudnn::ops::nhwcToNchwKernel<>", 6.0, "kernel"), ("nvjet_hsh_x", 20.0, "kernel")]
    b = unet_profile.breakdown(events, steps=2, sdfast_names=names)
    assert b["layout_copies_per_step"] == 1 and b["categories"]["layout copies"]["us"] == 8
    assert b["categories"]["sdfast:_gn_silu_fwd"] == {"us": 15.0, "kernels": 0.5}
    assert b["total_us"] == 33 and b["kernels_per_step"] == 2
    assert set(unet_profile.CATEGORIES) <= set(b["categories"])


def test_sdfast_cuda_kernels_by_name(tmp_path):
    (tmp_path / "k.cu").write_text("template <typename T, int J>\n__global__ void __launch_bounds__(512, 1) "
                                   "gn_cluster_nhwc_kernel(const Params p) {}\n"
                                   "__global__ void __launch_bounds__(max_threads(J), J < 5 ? 1 : 2) "
                                   "other_kernel(const Params p) {}\n")
    names = unet_profile.sdfast_kernel_names.__wrapped__(str(tmp_path))
    assert names == frozenset({"gn_cluster_nhwc_kernel", "other_kernel"})  # launch bounds with calls in them too
    traced = "void (anonymous namespace)::gn_cluster_nhwc_kernel<__half, 8>((anonymous namespace)::Params)"
    assert unet_profile.categorize(traced, sdfast_names=names) == "sdfast:gn_cluster_nhwc_kernel"
    assert unet_profile.categorize("void at::native::reduce_kernel<512, 1>", sdfast_names=names) == "other"


def test_format_helpers():
    assert fmt(None) == "—" and fmt(float("inf")) == "inf" and fmt(2.4567) == "2.46" and fmt(1234.5) == "1234"
    assert fmt(0.01234) == "0.0123"
    assert markdown_table([{"a": 1.0, "b": "x|y"}], ["a", ("b", "B")]).splitlines() == ["| a | B |", "| --- | --- |", "| 1.00 | x\\|y |"]


def test_bench_kernels_sections(tmp_path, monkeypatch, capsys):
    fake = types.ModuleType("benchmarks.ops.fake_ok")
    fake.run = lambda quick=False: [{"op": "group_norm", "shape": "(2, 320, 64, 64)", "us": 12.5, "quick": quick}]
    bad = types.ModuleType("benchmarks.ops.fake_bad")
    bad.run = lambda quick=False: 1 / 0
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(sys.modules, bad.__name__, bad)
    monkeypatch.setattr(bench_kernels, "SECTIONS", {"fake_ok": fake.__name__, "fake_bad": bad.__name__,
                                                    "does_not_exist": "benchmarks.ops.does_not_exist"})
    assert bench_kernels.main(["--only", "fake_ok,fake_bad,does_not_exist", "--quick", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "### fake_ok" in text and "| group_norm | (2, 320, 64, 64) | 12.5 | yes |" in text
    data = json.loads((tmp_path / "kernels.json").read_text())
    rows = {r["section"]: r for r in data["rows"]}
    assert rows["fake_ok"]["us"] == 12.5 and rows["fake_ok"]["quick"] is True
    assert rows["fake_bad"]["error"] == "ZeroDivisionError: division by zero"
    assert "No module named" in rows["does_not_exist"]["error"]
    assert data["env"]["torch"]
    assert (tmp_path / "kernels.csv").read_text().startswith("section,")
    # only broken sections: exit code 1
    assert bench_kernels.main(["--only", "fake_bad"]) == 1
    # a name that is not a section: a usage error naming it
    with pytest.raises(SystemExit) as e:
        bench_kernels.main(["--only", "fake_ok,nope"])
    assert e.value.code == 2 and "unknown section(s) nope" in capsys.readouterr().err


def test_bench_kernels_keeps_finished_sections_when_killed(tmp_path, monkeypatch):
    """A stage time limit kills the process mid-section: what the finished sections measured is on disk."""
    fake = types.ModuleType("benchmarks.ops.fake_done")
    fake.run = lambda quick=False: [{"op": "layer_norm", "us": 3.0}]
    killed = types.ModuleType("benchmarks.ops.fake_killed")

    def run(quick=False):
        raise SystemExit(124)  # as if `timeout` ended the process here

    killed.run = run
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setitem(sys.modules, killed.__name__, killed)
    monkeypatch.setattr(bench_kernels, "SECTIONS", {"fake_done": fake.__name__, "fake_killed": killed.__name__})
    with pytest.raises(SystemExit):
        bench_kernels.main(["--only", "fake_done,fake_killed", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert [r["section"] for r in rows] == ["fake_done"] and "### fake_done" in (tmp_path / "kernels.md").read_text()


def test_unet_timer_fires_around_replaced_forward_and_compiled_module():
    """The hooks see every call when forward is an instance attribute (sdfast's CUDA-graph runner) and
    when the pipeline's unet is a torch.compile OptimizedModule."""
    import torch

    class Runner:  # stands in for sdfast.runtime.cuda_graphs.GraphedForward
        def __init__(self, eager):
            self.eager, self.calls = eager, 0

        def __call__(self, *args, **kwargs):
            self.calls += 1
            return self.eager(*args, **kwargs)

    lin = torch.nn.Linear(4, 4)
    lin.forward = runner = Runner(lin.forward)
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="eager", fullgraph=True)
    for module in (lin, compiled):
        timer = bench_txt2img.UnetTimer(module, cuda=False, capture=True)
        x = torch.randn(2, 4)
        with timer, torch.no_grad():
            for _ in range(3):
                module(x)
        module(x)  # after exit: hooks removed
        assert len(timer.times_ms()) == 3 and all(t >= 0 for t in timer.times_ms())
        args, kwargs = timer.captured
        assert torch.equal(args[0], x) and args[0] is not x and kwargs == {}
    assert runner.calls == 4


def test_compressed_presets_run_and_report_their_layers(tmp_path, monkeypatch, capsys):
    """Issues 7/8: W8A8 and 2:4 presets are systems of the txt2img benchmark: calibrated on real prompts,
    then optimized; each row reports the layers converted, their weight bytes against fp16, and PSNR."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the kernels' PyTorch references: fast on the CPU
    rc = bench_txt2img.main([*TINY, "--systems", "stock,sdfast-w8a8,sdfast-sparse24,sdfast-fp8-static-convs",
                             "--out", str(tmp_path)])
    assert rc == 0
    rows = {r["system"]: r for r in _rows(tmp_path)["rows"]}
    for name in ("sdfast-w8a8", "sdfast-sparse24", "sdfast-fp8-static-convs"):
        r = rows[name]
        assert not r.get("error"), r.get("error")
        assert r["info"]["layers"] > 0 and r["psnr_db"] > 10
        assert r["config"]["optimize"] is True
    # int8 weights + per-channel scales against the original weights (fp32 here: ~0.25 + scales; fp16 on a GPU: ~0.5)
    assert 0.25 < rows["sdfast-w8a8"]["info"]["weight_ratio"] < 0.35
    # the 3x3 convolutions too (the ResNets' and the upsamplers'), each keeping its 16-bit weight beside the FP8 one
    assert rows["sdfast-fp8-static-convs"]["info"]["layers"] > rows["sdfast-w8a8"]["info"]["layers"]
    assert rows["sdfast-fp8-static-convs"]["config"]["convs"] is True
    assert "tiny/sdfast-w8a8: " in capsys.readouterr().out and "x the original bytes" in (tmp_path / "txt2img.md").read_text()


def test_device_time_splits_calls_at_the_flush_marker():
    from benchmarks.ops._timing import MARKER, split_by_marker

    flush = f"void at::native::vectorized_elementwise_kernel<4, {MARKER}_kernel_cuda>"
    events = [  # (name, start µs, duration µs), deliberately out of order
        ("stats", 12.0, 3.0), (flush, 0.0, 60.0), ("warm-up kernel", -5.0, 9.0), ("apply", 16.0, 2.5),
        (flush, 20.0, 60.0), ("stats", 81.0, 3.5), ("apply", 85.0, 2.5), (flush, 90.0, 60.0),
    ]
    assert split_by_marker(events) == [5.5, 6.0]  # the trailing marker without a call adds nothing
    assert split_by_marker([("k", 0.0, 1.0)]) == []


def test_trace_e2e_gaps_and_frames():
    from benchmarks import trace_e2e as te

    ev = [{"cat": "kernel", "ts": 10, "dur": 5}, {"cat": "kernel", "ts": 12, "dur": 10}, {"cat": "gpu_memcpy", "ts": 40, "dur": 2},
          {"cat": "cuda_runtime", "ts": 0, "dur": 100},
          {"cat": "python_function", "name": "outer", "ts": 0, "dur": 100, "tid": 1},
          {"cat": "python_function", "name": "inner", "ts": 23, "dur": 10, "tid": 1},
          {"cat": "python_function", "name": "other_thread", "ts": 25, "dur": 2, "tid": 2}]
    busy = te.gpu_intervals(ev)
    assert busy == [(10, 22), (40, 42)]
    assert te.idle_gaps(busy, 0, 50, 5) == [(0, 10), (22, 40), (42, 50)]
    assert te.idle_gaps(busy, 0, 50, 9) == [(0, 10), (22, 40)]
    assert te.frames_at(ev, 26, tid=1) == ["outer", "inner"]
    text = te.summarize(ev, 0, 50, 9, tid=1)
    assert "GPU busy 0.0 ms" in text and "| 0.02 | 0.02 | outer > inner |" in text


def test_profile_step_also_profiles_the_vae_decoder(tmp_path):
    import json

    assert profile_step.main(["--models", "tiny", "--systems", "sdfast", "--vae", "--device", "cpu",
                              "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "profile.json").read_text())["results"]
    assert [r["part"] for r in rows] == ["unet", "vae_decoder"]
    assert all(not r.get("error") and r["profile"]["kernels_per_step"] > 0 for r in rows)
    assert rows[1]["profile"]["categories"]["conv"]["us"] > 0  # the decoder is mostly convolutions


def test_write_sweep_writes_rows_env_and_table(tmp_path):
    from benchmarks.report import write_sweep

    write_sweep(tmp_path / "sweep", "conv", [{"us": 1.5}], "| us |\n| 1.5 |\n")
    data = json.loads((tmp_path / "sweep" / "conv.json").read_text())
    assert data["rows"] == [{"us": 1.5}] and "torch" in data["env"]
    md = (tmp_path / "sweep" / "conv.md").read_text()
    assert md.startswith("GPU ") and "torch " in md and md.endswith("| 1.5 |\n")


@pytest.mark.parametrize("epilogue", [None, "geglu"])
def test_gemm_benchmark_candidates_run_on_cpu(epilogue):
    """The benchmark's backends (minus cuBLAS-only and CUDA C++ ones) give the product they claim."""
    from benchmarks.ops import gemm as bench

    shape = dict(model="t", layer="t", M=20, K=64, N=16, epilogue=epilogue, count=1)
    cands = bench._candidates(shape, "main", {}, device="cpu")
    refs = cands.pop("_refs")
    assert {"cublas_fp16", "w8a8_int8", "w8a8_fp8", "w4a16_triton", "int8_outlier"} <= set(cands)
    for name, (fn, kind) in cands.items():
        if kind not in refs:
            continue
        out = fn()
        ref = refs[kind]
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        assert rel < (0.12 if "w4a16" in name or "fp8" in name else 0.03), f"{name}: rel err {rel:.3f}"
    assert bench.run.__doc__ and bench._shapes(True) and len(bench._shapes(False)) == 20


def test_a_controlnet_run_times_the_controlnet_and_compares_with_stock_controlnet_pipelines(tmp_path):
    out = tmp_path / "cn"
    rc, _ = _quiet_main([*TINY, "--size", "32x32", "--controlnet", "random:tiny-controlnet", "--task", "txt2img,img2img",
                         "--systems", "stock,sdfast", "--no-fp32-ref", "--out", str(out)])
    assert rc == 0
    rows = _rows(out)["rows"]
    assert [(r["system"], r["task"], r["model"]) for r in rows] == [
        (s, t, "tiny+tiny-controlnet") for s in ("stock", "sdfast") for t in ("txt2img", "img2img")]
    for r in rows:
        assert r["error"] is None, r["error"]
        assert r["controlnet_ms_step"] > 0 and r["unet_ms_step"] > 0 and r["size"] == "32x32"
        assert r["e2e_breakdown"]["controlnet_sum_ms"] > 0
    by = {(r["system"], r["task"]): r for r in rows}
    # the references are stock diffusers' ControlNet pipelines (txt2img: the stock engine's own image)
    assert float(by[("stock", "img2img")]["psnr_db"]) == float("inf")  # JSON holds it as "inf"
    assert float(by[("sdfast", "txt2img")]["psnr_db"]) >= 35 and float(by[("sdfast", "img2img")]["psnr_db"]) >= 35


@pytest.fixture(scope="module")
def tier_run(tmp_path_factory):
    """DeepCache speed tiers (issue 34) on stock and sdfast, with a scheduler for every generation, and the
    throughput sweep of the exact rows (issue 32)."""
    out = tmp_path_factory.mktemp("bench-tiers")
    rc, text = _quiet_main([*TINY, "--steps", "4", "--systems", "stock,sdfast", "--no-fp32-ref", "--scheduler", "euler",
                            "--cache-interval", "2,3", "--throughput", "1,2", "--out", str(out)])
    return rc, text, out


def test_speed_tiers_give_a_row_per_setting_against_the_exact_row(tier_run):
    rc, text, out = tier_run
    assert rc == 0
    rows = _rows(out)["rows"]
    assert [(r["system"], r["tier"]) for r in rows] == [
        (s, t) for s in ("stock", "sdfast") for t in (None, "deepcache 2/0", "deepcache 3/0")]
    exact = {r["system"]: r for r in rows if r["tier"] is None}
    for r in rows:
        assert r["scheduler"] == "euler" and not r["error"], r["error"]
        if r["tier"] is None:
            continue
        assert (r["cache_branch"], r["unet_calls_per_image"]) == (0, 4)
        assert r["cache_interval"] in (2, 3) and r["psnr_vs_exact_db"] < float("inf")
        assert 0 < r["ssim_vs_exact"] <= 1 and r["psnr_db"] is not None
        assert math.isclose(r["speedup_vs_exact"], exact[r["system"]]["e2e_s"] / r["e2e_s"])
        assert r["unet_ms_full"] > 0 and r["unet_ms_shallow"] > 0 and r["e2e_breakdown"]
    assert "### Speed tiers" in text and "| stock | tiny | deepcache 3/0 |" in text
    assert "scheduler euler" in text


def test_the_throughput_sweep_reports_images_per_second_per_batch(tier_run):
    rc, text, out = tier_run
    rows = _rows(out)["rows"]
    for r in rows:
        if r["tier"] is not None:
            assert r.get("throughput") is None  # the sweep runs on the exact txt2img row only
            continue
        points = r["throughput"]
        assert [p["batch"] for p in points] == [1, 2]
        assert all(math.isclose(p["img_s"], p["batch"] / p["e2e_s"]) for p in points)
        best = max(points, key=lambda p: p["img_s"])
        assert (r["best_img_s"], r["best_batch"]) == (best["img_s"], best["batch"])
    assert "### Throughput" in text and "| tiny/sdfast |" in text


def test_the_throughput_sweep_stops_at_out_of_memory(monkeypatch):
    import torch

    calls = []

    class Engine:
        def txt2img(self, **kw):
            calls.append(kw["num_images_per_prompt"])
            if kw["num_images_per_prompt"] >= 4:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    ctx = bench_txt2img.Context(device="cpu", repeats=2, throughput=(1, 4, 8))
    got = bench_txt2img.measure_throughput(Engine(), {"num_images_per_prompt": 1}, ctx, "t")
    assert [p["batch"] for p in got["throughput"]] == [1, 4] and "OutOfMemoryError" in got["throughput"][1]["error"]
    assert got["best_batch"] == 1 and calls == [1, 1, 1, 4]
    from benchmarks import reference

    mlperf = [r for r in reference.reference_rows("sdxl") if r["unit"] == "images/s per GPU"]
    assert len(mlperf) == 1 and math.isclose(mlperf[0]["value"], 17.42 / 8)


def test_ssim_and_the_full_shallow_split():
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    a = Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8))
    b = Image.fromarray(np.clip(np.asarray(a, np.int16) + rng.integers(-30, 31, (40, 48, 3)), 0, 255).astype(np.uint8))
    assert bench_txt2img.ssim(a, a) == (pytest.approx(1.0), None)
    value, note = bench_txt2img.ssim(a, b)
    assert note is None and 0 < value < 0.99
    # 2 images of 5 calls at interval 2: calls 0, 2, 4 of each are full
    split = bench_txt2img._full_and_shallow([10, 1, 10, 1, 10, 12, 2, 12, 2, 12], 2, 2)
    assert split == {"unet_ms_full": 11, "unet_ms_shallow": 1.5}


def test_presets_set_flags_and_flags_given_win(monkeypatch):
    seen = []
    monkeypatch.setattr(bench_txt2img, "model_specs", lambda args, ctx: seen.append(args) or [])
    monkeypatch.setattr(bench_txt2img, "env_metadata", lambda: {}, raising=False)
    import benchmarks.report as report

    monkeypatch.setattr(report, "env_metadata", lambda: {})
    bench_txt2img.main(["--preset", "turbo-sdxl-512"])
    bench_txt2img.main(["--preset", "deepcache-sd15", "--steps", "20"])
    turbo, dc = seen
    assert (turbo.models, turbo.size, turbo.steps, turbo.guidance, turbo.scheduler) == (
        "sdxl", "512", 4, 0.0, "euler_a_trailing")
    assert (dc.models, dc.steps, dc.cache_interval, dc.cache_branch, dc.systems, dc.fp32_ref) == (
        "sd15", 20, "2,3,5", "0,2", "sdfast", False)
    assert set(bench_txt2img.PRESETS) == {"deepcache-sd15", "deepcache-sdxl", "turbo-sdxl-512", "lcm-sdxl-1024",
                                          "lcm-sd15-512", "throughput-sdxl", "throughput-sd15"}


@pytest.mark.parametrize("argv, message", [
    (["--cache-interval", "1"], "--cache-interval takes integers >= 2"),
    (["--cache-interval", "2,x"], "comma list of integers"),
    (["--cache-interval", "2", "--cache-branch", "-1"], "--cache-branch takes integers >= 0"),
    (["--scheduler", "nope"], "--scheduler: unknown scheduler 'nope'"),
    (["--throughput", "0,2"], "--throughput takes integers >= 1"),
    (["--preset", "nope"], "invalid choice"),
])
def test_bad_tier_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench_txt2img.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_startup_children_compile_and_thread_shapes_are_tabled(tmp_path, monkeypatch):
    """``benchmarks.startup``'s child scripts are valid Python (they only run on a GPU), and ``--thread-shapes``
    tables each kind's first calls per thread from the child's report."""
    import json
    import subprocess
    from types import SimpleNamespace

    from benchmarks import startup

    for name in ("CHILD", "FIRST_CALLS", "THREAD_SHAPES"):
        compile(getattr(startup, name), name, "exec")
    report = {"cuDNN convolution": [[["conv a", 0.5, 0.001]], [["conv a", 0.004, 0.001]], [["conv a", 0.004, 0.001]]]}
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(
        stdout="noise\nTHREADSHAPES " + json.dumps(report) + "\n", stderr="", returncode=0))
    assert startup.thread_shapes(tmp_path) == report
    text = (tmp_path / "thread_shapes.md").read_text()
    assert "| conv a | 500.00 / 1.000 | 4.00 / 1.000 | 4.00 / 1.000 |" in text
    assert "- first thread: first calls together 500.0 ms" in text
