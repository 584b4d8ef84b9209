"""lm-evaluation-harness against the served model and against the same weights in transformers, side by
side: a multiple-choice task scored by loglikelihood (what `echo` with `logprobs` serves,
/v1/completions) and a generate_until task, both in a local task directory written here, on the embedded
SmolLM2-135M-Instruct (its converted Hugging Face directory) in float32.

lm-eval is not a nanovllm dependency (it pulls datasets, pandas, scikit-learn...): give the `lm_eval`
command of an environment that has it with --lm-eval. One that sees this venv's torch and transformers:

    python3.11 -m venv /tmp/lmeval
    .venv/bin/python -c "import site; print(site.getsitepackages()[0])" > /tmp/lmeval/lib/python3.11/site-packages/main.pth
    /tmp/lmeval/bin/pip install "lm-eval[api]==0.4.13"

Usage:  .venv/bin/python -m bench.eval_harness --lm-eval /tmp/lmeval/bin/lm_eval [--questions 60]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.report import load_average, machine_description
from nanovllm.worker.models.gguf.cache import embedded_model_path, prepare_gguf

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Portugal": "Lisbon",
    "United Kingdom": "London", "Ireland": "Dublin", "Belgium": "Brussels", "Netherlands": "Amsterdam",
    "Austria": "Vienna", "Switzerland": "Bern", "Poland": "Warsaw", "Czechia": "Prague", "Hungary": "Budapest",
    "Greece": "Athens", "Sweden": "Stockholm", "Norway": "Oslo", "Denmark": "Copenhagen", "Finland": "Helsinki",
    "Iceland": "Reykjavik", "Russia": "Moscow", "Ukraine": "Kyiv", "Romania": "Bucharest", "Bulgaria": "Sofia",
    "Serbia": "Belgrade", "Croatia": "Zagreb", "Turkey": "Ankara", "Egypt": "Cairo", "Morocco": "Rabat",
    "Kenya": "Nairobi", "Nigeria": "Abuja", "Ghana": "Accra", "Ethiopia": "Addis Ababa", "South Africa": "Pretoria",
    "Japan": "Tokyo", "China": "Beijing", "South Korea": "Seoul", "India": "New Delhi", "Pakistan": "Islamabad",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta", "Philippines": "Manila",
    "Malaysia": "Kuala Lumpur", "Australia": "Canberra", "New Zealand": "Wellington", "Canada": "Ottawa",
    "United States": "Washington", "Mexico": "Mexico City", "Cuba": "Havana", "Brazil": "Brasilia",
    "Argentina": "Buenos Aires", "Chile": "Santiago", "Peru": "Lima", "Colombia": "Bogota",
    "Venezuela": "Caracas", "Iran": "Tehran", "Iraq": "Baghdad", "Saudi Arabia": "Riyadh", "Israel": "Jerusalem",
    "Afghanistan": "Kabul", "Nepal": "Kathmandu", "Mongolia": "Ulaanbaatar", "Lebanon": "Beirut",
}  # fmt: skip

MC_TASK = """task: capitals_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """task: capitals_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: What is the capital of {{{{country}}}}?\\nA:"
doc_to_target: "{{{{capital}}}}"
filter_list:
  - name: the-answer
    filter:
      - function: regex
        regex_pattern: "is ([A-Z][a-zA-Z ]+)"
      - function: take_first
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--lm-eval", required=True, help="the lm_eval command of an environment with lm-eval")
    parser.add_argument("--questions", type=int, default=len(CAPITALS))
    return parser.parse_args(argv)


def write_tasks(directory: Path, questions: int) -> None:
    rng = random.Random(0)
    countries = list(CAPITALS)[:questions]
    rows = []
    for country in countries:
        wrong = rng.sample([c for c in CAPITALS.values() if c != CAPITALS[country]], 3)
        choices = [CAPITALS[country], *wrong]  # lm-eval puts a space before the choice
        rng.shuffle(choices)
        rows.append({"country": country, "capital": CAPITALS[country], "choices": choices,
                     "answer": choices.index(CAPITALS[country])})  # fmt: skip
    data = directory / "capitals.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "capitals_mc.yaml").write_text(MC_TASK.format(data=data))
    (directory / "capitals_gen.yaml").write_text(GEN_TASK.format(data=data))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_lm_eval(lm_eval: str, model: str, model_args: str, tasks: Path, out: Path) -> dict[str, list[dict]]:
    """Run both tasks; each task's logged samples."""
    subprocess.run(
        [lm_eval, "--model", model, "--model_args", model_args, "--tasks", "capitals_mc,capitals_gen",
         "--include_path", str(tasks), "--batch_size", "1", "--device", "cpu", "--output_path", str(out), "--log_samples"],
        check=True,
    )  # fmt: skip
    samples = {}
    for task in ("capitals_mc", "capitals_gen"):
        (path,) = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = sorted((json.loads(line) for line in path.open()), key=lambda s: s["doc_id"])
    return samples


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = prepare_gguf(embedded_model_path())
    work = Path(tempfile.mkdtemp(prefix="nanovllm-eval-"))
    write_tasks(work, args.questions)
    print(f"date: {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {machine_description()}")
    print(f"load average at start: {load_average()}")
    hf = run_lm_eval(args.lm_eval, "hf", f"pretrained={model_dir},dtype=float32", work, work / "hf")
    http_port = _free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "nanovllm.cli", "serve", "--model", str(model_dir), "--dtype", "float32",
         "--port", "0", "--http-port", str(http_port), "--max-model-len", "512"],
        stdout=subprocess.PIPE, stderr=(work / "serve.log").open("wb"), text=True,
    )  # fmt: skip
    try:
        for line in serve.stdout:  # "nanovllm serving ..." once the router answers
            if line.startswith("nanovllm serving"):
                break
        else:
            raise RuntimeError(f"nanovllm serve exited with {serve.wait()} (log: {work / 'serve.log'})")
        name = Path(model_dir).name
        served = run_lm_eval(
            args.lm_eval,
            "local-completions",
            f"model={name},base_url=http://127.0.0.1:{http_port}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model_dir},tokenized_requests=False,num_concurrent=1,max_retries=1",
            work,
            work / "served",
        )
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(60)
    print(f"load average at end: {load_average()}")

    def loglikelihoods(samples: list[dict]) -> list[float]:
        return [float(r[0]) for s in samples for r in s["filtered_resps"]]

    def accuracy(samples: list[dict]) -> float:
        return sum(s["acc"] for s in samples) / len(samples)

    mc_hf, mc_served = hf["capitals_mc"], served["capitals_mc"]
    differences = [abs(a - b) for a, b in zip(loglikelihoods(mc_hf), loglikelihoods(mc_served), strict=True)]
    gen_same = sum(
        a["filtered_resps"] == b["filtered_resps"]
        for a, b in zip(hf["capitals_gen"], served["capitals_gen"], strict=True)
    )
    print(f"\n| embedded SmolLM2-135M-Instruct, float32, {len(mc_hf)} questions | lm-eval `hf` | lm-eval `local-completions` against `nanovllm serve` |")  # fmt: skip
    print("|---|---:|---:|")
    print(f"| capitals_mc accuracy | {accuracy(mc_hf):.4f} | {accuracy(mc_served):.4f} |")
    print(f"| capitals_gen exact match | {sum(s['exact_match'] for s in hf['capitals_gen']) / len(mc_hf):.4f} | "
          f"{sum(s['exact_match'] for s in served['capitals_gen']) / len(mc_hf):.4f} |")  # fmt: skip
    print(f"\nper-choice loglikelihoods: {len(differences)}, largest difference {max(differences):.2e}, "
          f"mean {sum(differences) / len(differences):.2e}")  # fmt: skip
    print(f"generate_until outputs equal: {gen_same} of {len(hf['capitals_gen'])}")


if __name__ == "__main__":
    main()
