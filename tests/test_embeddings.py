"""Pooling requests (embeddings, rerank scores) against transformers on the same random Qwen3, in float32.

An embedding is the last token's final hidden state, L2-normalised: transformers' base model
(`AutoModel`) run on each text alone gives the reference. A rerank score is sigmoid(logit("yes") -
logit("no")) at the judge prompt's last token: transformers' causal LM gives those two logits. Tolerances:
the engine and transformers compute the same float32 arithmetic in other orders (chunked attention, fused
kernels), which moves a hidden state by a few ulps of its largest values; normalised (values below 1)
that is well under 1e-5, and a sigmoid's slope is at most 1/4.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoModelForCausalLM

from nanovllm import LLM, SamplingParams
from nanovllm.common.errors import RequestError
from nanovllm.common.pooling import RERANK_FORMAT, RERANK_INSTRUCTION, PoolingParams, normalized
from tests.helpers import greedy
from tests.model_factory import build_model, build_tokenizer

TEXTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks.",
    "café",
    "Continuous batching admits new requests while others decode. " * 4,
    "Prefix caching reuses blocks whose tokens hash the same.",
]
DOCUMENTS = ["The quick brown fox jumps.", "Numbers 0123456789", "Prefix caching reuses blocks."]
QUERY = "What does the fox do?"
ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory": "16MiB", "kvcache_block_size": 16}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Qwen3 with a tokenizer that spells "yes" and "no" as one token each (a reranker's)."""
    path = build_model("qwen3", tmp_path_factory.mktemp("embed") / "qwen3", seed=5, tokenizer=False)
    build_tokenizer(words=("yes", "no")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def base_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights in Qwen3-Embedding's layout: transformers' base model saved (architectures
    ["Qwen3Model"], tensors without the `model.` prefix, no head)."""
    path = tmp_path_factory.mktemp("embed") / "qwen3-base"
    AutoModel.from_pretrained(model_dir, dtype=torch.float32).save_pretrained(path)
    build_tokenizer(words=("yes", "no")).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), **ENGINE)


@pytest.fixture(scope="module")
def reference(model_dir: Path, llm: LLM) -> list[torch.Tensor]:
    """transformers' last-token final hidden state of each text alone, normalised."""
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([llm.tokenizer.encode(text)])
            out.append(F.normalize(model(input_ids=ids).last_hidden_state[0, -1], dim=0))
    return out


def _vectors(results: list[dict]) -> list[torch.Tensor]:
    return [torch.tensor(r["embedding"], dtype=torch.float32) for r in results]


def test_batch_equals_transformers_and_single(llm: LLM, reference: list[torch.Tensor]) -> None:
    batch = _vectors(llm.embed(TEXTS, use_tqdm=False))
    lengths = {len(llm.tokenizer.encode(t)) for t in TEXTS}
    assert len(lengths) == len(TEXTS)  # different lengths: padding or pooling position would show
    for got, want in zip(batch, reference):
        assert (got - want).abs().max().item() < 1e-5
        assert abs(got.norm().item() - 1.0) < 1e-6
    for text, got in zip(TEXTS, batch):
        (single,) = _vectors(llm.embed([text], use_tqdm=False))
        # float32 on a CPU runs batch-invariant kernels by default: bit for bit, not just close.
        assert torch.equal(single, got)


def test_chunked_prefill_and_prefix_hit(model_dir: Path, reference: list[torch.Tensor]) -> None:
    """A prompt split over steps pools only its last chunk; a second request for a text hits the prefix
    cache (its last token recomputed) and pools the same vector."""
    llm = LLM(str(model_dir), **ENGINE, max_num_batched_tokens=16)
    long_text = TEXTS[3]
    assert len(llm.tokenizer.encode(long_text)) > 32
    first, again = llm.embed([long_text, long_text], use_tqdm=False)
    (third,) = llm.embed([long_text], use_tqdm=False)
    want = reference[3]
    for result in (first, again, third):
        assert (torch.tensor(result["embedding"]) - want).abs().max().item() < 1e-5
    assert third["num_cached_tokens"] >= 32


def test_dimensions_truncate_then_renormalise(llm: LLM, reference: list[torch.Tensor]) -> None:
    (result,) = llm.embed([TEXTS[1]], dimensions=16, use_tqdm=False)
    got = torch.tensor(result["embedding"])
    assert got.shape == (16,)
    want = F.normalize(reference[1][:16], dim=0)
    assert (got - want).abs().max().item() < 1e-5
    with pytest.raises(RequestError, match=r"dimensions must be in \[1, 64\].*got 65"):
        llm.embed([TEXTS[1]], dimensions=65, use_tqdm=False)


def test_base_model_layout(base_model_dir: Path, reference: list[torch.Tensor]) -> None:
    """Qwen3-Embedding's layout loads, embeds as the causal LM's checkpoint does, and refuses generation
    and scores by name."""
    llm = LLM(str(base_model_dir), **ENGINE)
    for got, want in zip(_vectors(llm.embed(TEXTS, use_tqdm=False)), reference):
        assert (got - want).abs().max().item() < 1e-5
    with pytest.raises(RequestError, match="Qwen3Model checkpoint without an output head.*not generation"):
        llm.generate([[5, 6, 7]], greedy(4), use_tqdm=False)
    with pytest.raises(RequestError, match="cannot score"):
        llm.score(QUERY, DOCUMENTS, use_tqdm=False)


def test_unprefixed_tensors_under_a_causal_lm_config(
    base_model_dir: Path, reference: list[torch.Tensor], tmp_path: Path
) -> None:
    """The base model's tensors (no `model.` prefix, no head) under a config that names the causal LM with
    tied embeddings, as an embedding checkpoint may ship: they load, the head being the embeddings."""
    path = tmp_path / "causal-lm-config"
    shutil.copytree(base_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config |= {"architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), **ENGINE)
    for got, want in zip(_vectors(llm.embed(TEXTS, use_tqdm=False)), reference):
        assert (got - want).abs().max().item() < 1e-5


def test_rerank_scores_equal_transformers(model_dir: Path, llm: LLM) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yes, no = (llm.tokenizer.encode(w, add_special_tokens=False) for w in ("yes", "no"))
    assert len(yes) == len(no) == 1
    want = []
    with torch.no_grad():
        for doc in DOCUMENTS:
            prompt = RERANK_FORMAT.format(instruction=RERANK_INSTRUCTION, query=QUERY, document=doc)
            logits = model(input_ids=torch.tensor([llm.tokenizer.encode(prompt)])).logits[0, -1]
            want.append(torch.sigmoid(logits[yes[0]] - logits[no[0]]).item())
    got = [r["score"] for r in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-5
    assert len(set(got)) == len(got)  # the documents' scores differ: an order to keep


def test_generation_unchanged_beside_pooling(llm: LLM) -> None:
    """Generation requests and pooling requests in the same steps: the generated tokens are those of the
    generation requests alone, and each pooled vector is the one it has alone."""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    alone = [o["token_ids"] for o in llm.generate(prompts, greedy(12), use_tqdm=False)]
    embeds_alone = _vectors(llm.embed(TEXTS, use_tqdm=False))
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"gen-{i}", prompt, greedy(12))
    tokens: dict[str, list[int]] = {}
    pooled: dict[str, torch.Tensor] = {}
    mixed_steps = steps = 0
    while engine.has_unfinished_requests():
        if steps in (0, 3):  # beside the prompts' prefill, then beside their decodes
            for i in range(3) if steps == 0 else range(3, len(TEXTS)):
                ids = llm.tokenizer.encode(TEXTS[i])
                engine.add_request(f"emb-{i}", ids, SamplingParams(), pooling=PoolingParams())
        steps += 1
        outputs = engine.step().outputs
        kinds = {out.request_id.split("-")[0] for out in outputs}
        mixed_steps += kinds == {"gen", "emb"}
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.pooled is not None:
                pooled[out.request_id] = out.pooled
    assert mixed_steps >= 2  # steps that both generated and pooled: at the prompts' prefill and later
    assert [tokens[f"gen-{i}"] for i in range(len(prompts))] == alone
    for i, want in enumerate(embeds_alone):
        assert tokens[f"emb-{i}"] == []
        assert torch.equal(torch.tensor(normalized(pooled[f"emb-{i}"].tolist())), want)
    assert engine.load().kv_blocks_used == 0  # every request's blocks came back


def test_bad_inputs(llm: LLM) -> None:
    with pytest.raises(RequestError, match="no tokens"):
        llm.embed([[]], use_tqdm=False)
    with pytest.raises(RequestError, match="513 tokens but max_model_len is 512"):
        llm.embed([[5] * 513], use_tqdm=False)
    (full,) = llm.embed([[5] * 512], use_tqdm=False)  # a pooling request may fill max_model_len
    assert len(full["embedding"]) == 64
    with pytest.raises(RequestError, match="score token_ids holds 600"):
        llm.engine.add_request("x", [5, 6], SamplingParams(), pooling=PoolingParams("score", (3, 600)))
    with pytest.raises(RequestError, match="embed request takes no token ids"):
        PoolingParams("embed", (3,))


def test_tensor_parallel_equals_one_rank(model_dir: Path, llm: LLM) -> None:
    """Two ranks (gloo on a CPU): each holds half the head's rows, so a score's two logits are summed over
    the ranks; embeddings and scores equal one rank's within float32 rounding (the all-reduces add the
    row-parallel layers' halves in another order)."""
    tp = LLM(str(model_dir), **ENGINE, tensor_parallel_size=2)
    try:
        for got, want in zip(
            _vectors(tp.embed(TEXTS, use_tqdm=False)), _vectors(llm.embed(TEXTS, use_tqdm=False))
        ):
            assert (got - want).abs().max().item() < 1e-5
        got_scores = [r["score"] for r in tp.score(QUERY, DOCUMENTS, use_tqdm=False)]
        want_scores = [r["score"] for r in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
        assert max(abs(g - w) for g, w in zip(got_scores, want_scores)) < 1e-5
    finally:
        tp.shutdown()
