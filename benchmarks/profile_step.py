"""Profile one UNet step (and with ``--vae`` one VAE decoder call) per system and model, on the real inputs captured
from one generation: GPU kernel time per category (``benchmarks.unet_profile``).

    python -m benchmarks.profile_step --models sd15 --systems stock,sdfast
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.unet_profile import format_breakdown, profile_unet_step  # noqa: E402


def main(argv=None) -> int:
    """Profile one UNet step (and with --vae one VAE decoder call) for each system and model, on the real
    inputs captured from one generation."""
    import argparse

    from benchmarks import bench_txt2img as bench

    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_step", description=main.__doc__)
    p.add_argument("--model", default=None, help="a model folder (else random architectures from --models)")
    p.add_argument("--models", default="sd15")
    p.add_argument("--systems", default="stock,sdfast")
    p.add_argument("--size", default=None)
    p.add_argument("--steps", type=int, default=None, help="steps of the capturing generation (default: 2)")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="write profile.json here")
    p.add_argument("--vae", action="store_true", help="also profile one VAE decoder call (its real input)")
    args = p.parse_args(argv)
    ctx = bench.Context(device=args.device)
    results = []
    for spec in bench.model_specs(args, ctx):
        spec.steps = args.steps or 2
        for name in bench.parse_systems(args.systems):
            t0 = time.perf_counter()
            built = None
            try:
                built = bench.SYSTEMS[name].build(spec, ctx)
                pipe = built.engine.pipe
                parts = {"unet": pipe.unet, **({"vae_decoder": pipe.vae.decoder} if args.vae else {})}
                timers = {part: bench.UnetTimer(m, cuda=ctx.cuda, capture=True) for part, m in parts.items()}
                with contextlib.ExitStack() as stack:
                    for t in timers.values():
                        stack.enter_context(t)
                    built.engine.txt2img(**bench.gen_kwargs(spec, ctx))
                for part, module in parts.items():
                    prof = profile_unet_step(module, *timers[part].captured)
                    results.append({"system": name, "model": spec.label, "part": part, "profile": prof})
                    label = f"{spec.label}/{name}" + ("" if part == "unet" else f" {part} (per call)")
                    print(format_breakdown(prof, label) + "\n")
            except Exception as e:  # one failing system must not stop the others
                results.append({"system": name, "model": spec.label, "error": f"{type(e).__name__}: {e}"})
                print(f"{spec.label}/{name}: failed: {type(e).__name__}: {e}\n")
            finally:
                bench.free(built)
                built = None
            print(f"[{spec.label}/{name}] {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if args.out:
        from benchmarks.report import env_metadata, write_json

        write_json(Path(args.out) / "profile.json", {"env": env_metadata(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
