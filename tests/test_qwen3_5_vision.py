"""Images into Qwen3.5 (worker/models/qwen3_5_vision.py, worker/runner/images.py, common/images.py) against
transformers on a tiny random Qwen3_5ForConditionalGeneration saved with transformers' image processor:
the patches equal the processor's, the 3-D RoPE positions equal `get_rope_index`'s, and the offline `LLM`'s
float32 greedy tokens equal transformers' `generate` for one and two images (sizes that are and are not
multiples of 32 px, text before, between and after), their logprobs within float32 rounding, in one
prefill and in chunks cut through the images, on one rank or two; an image seen again skips the tower, and the prefix cache
keys blocks covering an image by its content; a text request on the vision checkpoint is
transformers' text generation; images a request cannot have are refused naming them.

transformers' Qwen3VLProcessor is not used: it builds a video processor that needs torchvision, which is
not installed here. Its text side is the placeholder expansion (one `<|image_pad|>` per image repeated
once per merged patch), which the test writes out; its image side is the image processor, used as is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nanovllm import LLM, SamplingParams
from nanovllm.common.block_hash import hash_block
from nanovllm.common.errors import RequestError
from nanovllm.common.images import ImageProcessorConfig, expand_placeholders, patchify
from nanovllm.worker.runner.images import mrope_positions
from nanovllm.worker.sequence import ImageInput, Sequence
from tests.helpers import vision_reference
from tests.model_factory import IMAGE_TOKEN_ID, build_vision_model

MAX_NEW = 10
ENGINE = {"max_model_len": 512, "kv_cache_memory": "16MiB", "dtype": "float32"}
PLACE = "<|vision_start|><|image_pad|><|vision_end|>"
# (height, width): 64x96 a multiple of 32 px (2x3 merged patches), 70x100 not (resized to 64x96), 40x150
# not (resized to 32x160: 1x5 merged patches).
SIZES = [(64, 96), (70, 100), (40, 150)]


def _image(height: int, width: int, seed: int):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_model(tmp_path_factory.mktemp("qwen3_5_vision") / "model")


@pytest.fixture(scope="module")
def reference(vision_model: Path):
    return vision_reference(vision_model)


@pytest.fixture(scope="module")
def llm(vision_model: Path) -> LLM:
    return LLM(str(vision_model), **ENGINE)


def _hf_generate(reference, text: str, images: list) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and each step's logprobs [MAX_NEW, vocab] for `text` with `images`."""
    model, processor, tokenizer = reference
    ids = tokenizer.encode(text)
    kwargs = {}
    if images:
        features = processor(images=images, return_tensors="pt")
        counts = (features["image_grid_thw"].prod(-1) // 4).tolist()
        ids = expand_placeholders(ids, IMAGE_TOKEN_ID, counts)
        kwargs = {"pixel_values": features["pixel_values"], "image_grid_thw": features["image_grid_thw"]}
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == IMAGE_TOKEN_ID).int(), max_new_tokens=MAX_NEW, do_sample=False,
            output_logits=True, return_dict_in_generate=True, **kwargs,
        )  # fmt: skip
    tokens = out.sequences[0, input_ids.shape[1] :].tolist()
    return tokens, torch.log_softmax(torch.cat(out.logits).double(), dim=-1)


def _generate(llm: LLM, text: str, images: list) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    prompt = {"prompt": text, "multi_modal_data": {"image": images}} if images else text
    return llm.generate([prompt], params, use_tqdm=False)[0]


def _assert_equal(ours: dict, theirs: tuple[list[int], torch.Tensor], where: str) -> None:
    """Tokens equal; each step's top-5 logprobs within 2e-4 of transformers' (a logprob is the logit less
    the log-sum-exp of all logits: two values each within the 1e-4 float32 bound of the logits)."""
    tokens, logprobs = theirs
    assert ours["token_ids"] == tokens, where
    for step, entry in enumerate(ours["logprobs"]):
        for token, value in [(entry.token_id, entry.logprob), *entry.top]:
            assert abs(value - logprobs[step, token].item()) <= 2e-4, (where, step, token)


def test_patches_equal_transformers_image_processor(vision_model: Path, reference):
    """Exactly: resize (PIL bicubic), rescale, normalise and the merge-block patch order, for sizes that are
    and are not multiples of 32 px, below the minimum pixels and above the maximum."""
    _, processor, _ = reference
    cfg = ImageProcessorConfig.from_model_dir(vision_model)
    for k, (height, width) in enumerate([*SIZES, (8, 9), (300, 301), (33, 200)]):
        image = _image(height, width, k)
        theirs = processor(images=[image], return_tensors="np")
        ours = patchify(image, cfg)
        assert ours.grid_thw == tuple(theirs["image_grid_thw"][0].tolist())
        assert np.array_equal(ours.pixel_values, theirs["pixel_values"])
        assert cfg.num_tokens(height, width) == ours.num_tokens(2)


def test_transparent_and_other_modes_convert_as_transformers(vision_model: Path, reference):
    """RGBA with varying alpha and a palette with a transparent colour composite onto white, grey and
    CMYK convert as PIL does: the patches equal the processor's exactly."""
    _, processor, _ = reference
    cfg = ImageProcessorConfig.from_model_dir(vision_model)
    rng = np.random.default_rng(9)
    rgba = Image.fromarray(rng.integers(0, 256, (50, 70, 4), dtype=np.uint8), "RGBA")
    palette = _image(40, 60, 10).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette.info["transparency"] = 3
    for image in (rgba, palette, _image(40, 60, 11).convert("L"), _image(40, 60, 12).convert("CMYK")):
        theirs = processor(images=[image], return_tensors="np")["pixel_values"]
        assert np.array_equal(patchify(image, cfg).pixel_values, theirs), image.mode


def test_rope_positions_equal_get_rope_index(reference):
    """Two images (2x3 and 3x2 merged patches) with text before, between and after, and an image at the
    very start or end: every token's three positions, over the whole prompt and over chunks cut through
    images; positions past the prompt continue as transformers' rope delta says. (Images always have text
    between them: a prompt writes each between vision start and end tokens, and transformers reads
    adjacent image tokens as one image.)"""
    model = reference[0]
    for layout in ([5, (2, 3), 4, (3, 2), 3], [(2, 3), 2], [1, (1, 4), 1, (2, 2)]):
        ids: list[int] = []
        images, grids = [], []
        for part in layout:
            if isinstance(part, int):
                ids += [7] * part
            else:
                h, w = part
                images.append(ImageInput(len(ids), h * w, part, None))  # type: ignore[arg-type]
                grids.append([1, 2 * h, 2 * w])
                ids += [IMAGE_TOKEN_ID] * (h * w)
        input_ids = torch.tensor([ids])
        want, delta = model.model.get_rope_index(
            input_ids, (input_ids == IMAGE_TOKEN_ID).int(), image_grid_thw=torch.tensor(grids)
        )
        want = want[:, 0].tolist()
        assert list(mrope_positions(images, 0, len(ids))) == want
        for start in range(len(ids)):
            for end in (start + 1, start + 3, len(ids)):
                end = min(end, len(ids))
                got = mrope_positions(images, start, end)
                assert [axis for axis in got] == [axis[start:end] for axis in want], (layout, start, end)
        after = mrope_positions(images, len(ids), len(ids) + 2)
        first = len(ids) + int(delta)
        assert list(after) == [[first, first + 1]] * 3


@pytest.mark.parametrize(
    ("name", "text", "sizes"),
    [
        ("one image, text around it", f"The quick {PLACE} brown fox", [(70, 100)]),
        (
            "two images, text between",
            f"Paged {PLACE} attention stores {PLACE} blocks.",
            [(64, 96), (40, 150)],
        ),
        ("an image first, nothing after", f"{PLACE}", [(64, 96)]),
    ],
)
def test_greedy_tokens_and_logprobs_equal_transformers(llm: LLM, reference, name: str, text: str, sizes):
    images = [_image(h, w, k) for k, (h, w) in enumerate(sizes)]
    _assert_equal(_generate(llm, text, images), _hf_generate(reference, text, images), name)


def test_the_moe_checkpoint_equals_transformers(tmp_path: Path):
    """A Qwen3_5MoeForConditionalGeneration: two images with text between, as above."""
    model_dir = build_vision_model(tmp_path / "moe", arch="qwen3_5_moe")
    reference = vision_reference(model_dir)
    text, images = f"Paged {PLACE} attention stores {PLACE} blocks.", [_image(64, 96, 0), _image(40, 150, 1)]
    ours = _generate(LLM(str(model_dir), **ENGINE), text, images)
    _assert_equal(ours, _hf_generate(reference, text, images), "moe")


def _cached_blocks(llm: LLM, text: str, image) -> list[bool]:
    """Whether the block manager holds each full block of `text` with `image` (their hash chain as the
    block manager computes it, Sequence.block_key)."""
    token_ids, patches = llm._prompt_inputs({"prompt": text, "multi_modal_data": {"image": image}})
    engine = llm.engine
    seq = Sequence(0, "probe", token_ids, SamplingParams(), images=engine._place_images(token_ids, patches))
    block_size, cached, prev = engine.block_manager.block_size, [], None
    for i in range(len(token_ids) // block_size):
        prev = hash_block(prev, seq.block_key(i, block_size))
        cached.append(prev in engine.block_manager.cached)
    return cached


def test_chunked_prefill_through_images_and_the_encoder_cache(vision_model: Path, reference):
    """Steps of 5 tokens cut both images' tokens: the same tokens and logprobs; each image runs through
    the tower once for all its chunks; asked again, neither runs it (the encoder cache) and the tokens do
    not change."""
    llm = LLM(str(vision_model), max_num_batched_tokens=5, kvcache_block_size=4, **ENGINE)
    text = f"Paged {PLACE} attention stores {PLACE} blocks."
    images = [_image(70, 100, 1), _image(64, 96, 2)]
    theirs = _hf_generate(reference, text, images)
    encoder = llm.engine.runner.images
    assert encoder is not None
    _assert_equal(_generate(llm, text, images), theirs, "chunked")
    assert encoder.tower_runs == 2  # later chunks of an image find it in the cache
    hits = encoder.cache_hits
    _assert_equal(_generate(llm, text, images), theirs, "again")
    assert encoder.tower_runs == 2 and encoder.cache_hits > hits


def test_two_ranks_equal_transformers_and_repeated_images_skip_the_tower(vision_model: Path, reference):
    """tensor_parallel_size=2, steps of 5 tokens cut through the images: rank 0 runs the tower and sends
    each step's image rows' embeddings to rank 1, which holds no tower. The greedy tokens and logprobs for
    one image and for two equal transformers'; asked again, the two images skip the tower (rank 0's
    encoder cache) and the tokens do not change."""
    llm = LLM(
        str(vision_model), tensor_parallel_size=2, device="cpu", max_num_batched_tokens=5,
        kvcache_block_size=4, **ENGINE,
    )  # fmt: skip
    try:
        encoder = llm.engine.runner.images
        assert encoder is not None
        one = f"The quick {PLACE} brown fox"
        images = [_image(70, 100, 0)]
        _assert_equal(_generate(llm, one, images), _hf_generate(reference, one, images), "one image")
        two = f"Paged {PLACE} attention stores {PLACE} blocks."
        images = [_image(64, 96, 1), _image(40, 150, 2)]
        theirs = _hf_generate(reference, two, images)
        _assert_equal(_generate(llm, two, images), theirs, "two images")
        assert encoder.tower_runs == 3
        hits = encoder.cache_hits
        _assert_equal(_generate(llm, two, images), theirs, "again")
        assert encoder.tower_runs == 3 and encoder.cache_hits > hits
    finally:
        llm.shutdown()


def test_prefix_cache_blocks_covering_an_image_are_keyed_by_its_content(vision_model: Path, reference):
    """After a request with one image, the prefix cache holds every full block of its prompt under that
    image's content, and of the same prompt with another image of the same size (the same token ids)
    only the blocks before the image; that request's tokens are transformers' for its own image."""
    llm = LLM(str(vision_model), kvcache_block_size=4, **ENGINE)
    text = f"Numbers 0123456789 and {PLACE} punctuation"
    first, second = _image(64, 96, 5), _image(64, 96, 6)
    _generate(llm, text, [first])
    before_image = len(llm.tokenizer.encode("Numbers 0123456789 and <|vision_start|>")) // 4
    assert all(_cached_blocks(llm, text, first))
    other = _cached_blocks(llm, text, second)
    assert other == [True] * before_image + [False] * (len(other) - before_image)
    _assert_equal(_generate(llm, text, [second]), _hf_generate(reference, text, [second]), "another image")
    assert llm.engine.runner.images.tower_runs == 2


def test_text_alone_on_the_vision_checkpoint_equals_transformers(llm: LLM, reference):
    text = "The quick brown fox jumps over the lazy dog."
    _assert_equal(_generate(llm, text, []), _hf_generate(reference, text, []), "text")


def test_images_a_request_cannot_have_are_refused(llm: LLM, qwen3_dir: Path):
    image = _image(64, 96, 0)
    with pytest.raises(RequestError, match="1 image placeholder token.* for 2 image"):
        _generate(llm, f"one {PLACE}", [image, image])
    with pytest.raises(RequestError, match="no vision tower"):
        LLM(str(qwen3_dir), **ENGINE).generate(
            [{"prompt_token_ids": [5, 6], "multi_modal_data": {"image": image}}], use_tqdm=False
        )
    with pytest.raises(RequestError, match="multi_modal_data takes"):
        llm.generate([{"prompt": "x", "multi_modal_data": {"video": image}}], use_tqdm=False)
