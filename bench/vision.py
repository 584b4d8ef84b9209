"""Qwen3.5's vision tower on a CPU: one image's encoding time against transformers' tower on the same
weights, and what the encoder cache saves a request's time to first token.

A random Qwen3_5ForConditionalGeneration of the 0.8B shape (bench/models.py's text model; the published
0.8B's tower: 12 blocks of width 768, 12 heads, MLP 3072, 16-pixel patches merged 2x2 into the text's
1024, a 48x48 position table) is written once with an image processor as the published one sets it (mean
and std 0.5, 65,536 to 16,777,216 pixels).

    .venv/bin/python -m bench.vision [--size 448] [--repeats 3] [--layers N]

Tower: a `size` x `size` random image ((size / 16)^2 patches, a quarter of them tokens) through this
engine's tower (`encode_image`, in the engine's dtype) and transformers' (`model.visual`) in float32 and
bfloat16, each the fastest of `repeats` after a warm-up. Time to first token (`max_tokens=1`, the fastest
of `repeats` after a warm-up): a new image (the tower runs, the prompt is
prefilled); the same image after different text each time (the encoder cache gives its tokens; the prompt
is prefilled again, its first block differing); the same request again (the encoder cache and the prefix
cache). The tower's runs over each row's requests are counted (`ImageEncoder.tower_runs`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.models import DEFAULT_CACHE, SHAPES
from bench.report import machine_description
from nanovllm import LLM, SamplingParams

VISION_0_8B = {
    "depth": 12,
    "hidden_size": 768,
    "num_heads": 12,
    "intermediate_size": 3072,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 1024,
    "num_position_embeddings": 2304,
    "hidden_act": "gelu_pytorch_tanh",
    "deepstack_visual_indexes": [],
}
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, VISION_START_ID, VISION_END_ID = 248056, 248057, 248053, 248054


def build_vision_checkpoint(layers: int | None) -> Path:
    """The random multimodal 0.8B checkpoint (cached: written once), with its preprocessor_config.json."""
    from transformers import AutoModelForImageTextToText, Qwen3_5Config
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    name = f"qwen3.5-0.8b-vision-{layers}-layers" if layers else "qwen3.5-0.8b-vision"
    out_dir = DEFAULT_CACHE / name
    if (out_dir / "config.json").is_file():
        return out_dir
    text = dict(SHAPES["qwen3.5-0.8b"][1])
    text["rope_parameters"] = {
        **text["rope_parameters"],
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    }
    if layers:
        text["num_hidden_layers"] = layers
    config = Qwen3_5Config(
        text_config=text,
        vision_config=VISION_0_8B,
        image_token_id=IMAGE_TOKEN_ID,
        video_token_id=VIDEO_TOKEN_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    tmp_dir = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp_dir)
    Qwen2VLImageProcessorPil(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        size={"shortest_edge": 65536, "longest_edge": 16777216},
    ).save_pretrained(tmp_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in tmp_dir.iterdir():  # config.json last: its presence marks a finished checkpoint
        if item.name != "config.json":
            item.replace(out_dir / item.name)
    (tmp_dir / "config.json").replace(out_dir / "config.json")
    tmp_dir.rmdir()
    return out_dir


def random_image(size: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def fastest(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best


def tower_times(model_dir: Path, llm: LLM, size: int, repeats: int) -> dict[str, float]:
    """Seconds to encode one image: this engine's tower, and transformers' in float32 and bfloat16."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from nanovllm.common.images import ImageProcessorConfig, patchify

    image = random_image(size, 0)
    patches = patchify(image, ImageProcessorConfig.from_model_dir(model_dir))
    pixels = torch.from_numpy(patches.pixel_values)
    model = llm.engine.runner.model
    with torch.inference_mode():
        dtype = str(llm.engine.runner.dtype).removeprefix("torch.")
        times = {
            f"nanovllm ({dtype})": fastest(lambda: model.encode_image(pixels, patches.grid_thw), repeats)
        }
    features = AutoImageProcessor.from_pretrained(model_dir)(images=[image], return_tensors="pt")
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).model.visual.eval()
    for dtype in (torch.float32, torch.bfloat16):
        tower = hf.to(dtype)
        values = features["pixel_values"].to(dtype)
        with torch.inference_mode():
            times[f"transformers ({str(dtype).removeprefix('torch.')})"] = fastest(
                lambda tower=tower, values=values: tower(values, grid_thw=features["image_grid_thw"]), repeats
            )
    return times


def first_token_times(llm: LLM, size: int, repeats: int) -> dict[str, tuple[float, int]]:
    """Seconds to the first token, and the tower's runs over the timed requests, for a new image each time,
    the same image after other text each time, and the same request again."""
    encoder = llm.engine.runner.images
    if encoder is None:
        raise ValueError("the model has no vision tower")
    params = SamplingParams(temperature=0.0, max_tokens=1)
    text = [100 + i for i in range(32)]

    def request(before: list[int], image: Image.Image) -> Callable[[], object]:
        prompt = [*before, VISION_START_ID, IMAGE_TOKEN_ID, VISION_END_ID, 1000, 1001]
        inputs = {"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}
        return lambda: llm.generate([inputs], params, use_tqdm=False)

    def timed(requests: list[Callable[[], object]]) -> tuple[float, int]:
        """The fastest of the requests but the first (a warm-up), and the tower's runs over them all."""
        runs, best = encoder.tower_runs, float("inf")
        for i, run in enumerate(requests):
            began = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - began) if i else best
        return best, encoder.tower_runs - runs

    new_images = [random_image(size, seed) for seed in range(1, repeats + 2)]
    image = random_image(size, 1000)
    texts = [[200 + i + 32 * k for i in range(32)] for k in range(repeats + 1)]
    return {
        "a new image": timed([request(text, new) for new in new_images]),
        "the same image after other text": timed([request(before, image) for before in texts]),
        "the same request again": timed([request(texts[-1], image)] * (repeats + 1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=448, help="the image's width and height in pixels")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--layers", type=int, default=None, help="text decoder layers (default: the 0.8B's 24)"
    )
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    model_dir = build_vision_checkpoint(args.layers)
    llm = LLM(str(model_dir), dtype=args.dtype, max_model_len=4096, kv_cache_memory="1GiB")
    print(f"{datetime.date.today()} {machine_description()}")
    config = json.loads((model_dir / "config.json").read_text())
    print(
        f"random Qwen3.5-0.8B shape, text layers {config['text_config']['num_hidden_layers']}, "
        f"one {args.size}x{args.size} image ({(args.size // 16) ** 2} patches), fastest of {args.repeats}"
    )
    times = tower_times(model_dir, llm, args.size, args.repeats)
    ours = next(v for k, v in times.items() if k.startswith("nanovllm"))
    best_hf = min(v for k, v in times.items() if k.startswith("transformers"))
    print("| tower | ms an image | transformers' fastest / this |")
    print("|---|---:|---:|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {best_hf / seconds:.2f} |")
    print(f"this engine against transformers' fastest: {best_hf / ours:.2f}x")
    rows = first_token_times(llm, args.size, args.repeats)
    new = rows["a new image"][0]
    print("| request | time to first token ms | x a new image's | tower runs |")
    print("|---|---:|---:|---:|")
    for name, (seconds, runs) in rows.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {new / seconds:.2f} | {runs} |")


if __name__ == "__main__":
    main()
