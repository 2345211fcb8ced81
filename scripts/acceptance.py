"""Acceptance run of real clients against ``agentcache serve``: lm-evaluation-harness and LangChain.

Not a test (it needs the ``acceptance`` extra and takes minutes): it serves the bundled model on a
loopback port and runs

1. lm-evaluation-harness ``local-completions`` (tokenizing through the server's ``/tokenize``)
   on two tiny local tasks built here: a loglikelihood multiple-choice task (needs ``echo`` and
   prompt ``logprobs``) and a ``generate_until`` task (stop sequences), each with ``--limit``;
2. LangChain ``ChatOpenAI(...).with_structured_output(PydanticModel)`` (``response_format``
   ``json_schema``, strict), which must return a valid object.

NOTE: lm-eval's own tasks download their data sets from the Hugging Face hub; this script writes
its two tasks (stdlib questions, ``dataset_path: json`` + ``data_files``) so it runs offline.
The bundled ``tiny`` model is a toy: expect accuracy near chance; the point is that the clients
run end to end and get well-formed answers.

    pip install -e '.[acceptance]'
    python scripts/acceptance.py --limit 20 [--json results.json]

Exit code 0 when every part ran and the structured output validated, else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

# (module, what it does): the questions of both tasks.
FACTS = [
    ("json", "encodes and decodes JSON documents"),
    ("re", "matches text against regular expressions"),
    ("os", "talks to the operating system: files, processes, environment"),
    ("math", "gives floating-point functions such as sqrt and floor"),
    ("random", "generates pseudo-random numbers"),
    ("datetime", "represents dates, times and durations"),
    ("pathlib", "handles filesystem paths as objects"),
    ("itertools", "builds iterators for efficient looping"),
    ("functools", "offers higher-order functions such as partial and lru_cache"),
    ("collections", "provides container types such as deque and Counter"),
    ("subprocess", "spawns new processes and connects to their pipes"),
    ("threading", "runs code in threads"),
    ("socket", "gives low-level network sockets"),
    ("hashlib", "computes secure hashes such as sha256"),
    ("csv", "reads and writes comma-separated files"),
    ("argparse", "parses command-line options"),
    ("logging", "emits log records to handlers"),
    ("sqlite3", "talks to SQLite databases"),
    ("tempfile", "creates temporary files and directories"),
    ("shutil", "copies and removes whole file trees"),
]

MC_YAML = """task: agentcache_stdlib_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: Which Python standard library module {{{{what}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_YAML = """task: agentcache_stdlib_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: Which Python standard library module {{{{what}}}}?\\nAnswer:"
doc_to_target: " {{{{module}}}}"
generation_kwargs:
  until: ["\\n", "Question:"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
"""


def write_tasks(folder: Path) -> None:
    """The two tasks' data (JSON lines) and YAML configs, with absolute data paths."""
    mc, gen = folder / "stdlib_mc.jsonl", folder / "stdlib_gen.jsonl"
    names = [module for module, _ in FACTS]
    with mc.open("w") as f_mc, gen.open("w") as f_gen:
        for i, (module, what) in enumerate(FACTS):
            # NOTE: distractors rotate deterministically; the answer's slot is i % 4.
            others = [names[(i + k) % len(names)] for k in (3, 7, 11)]
            choices = others[: i % 4] + [module] + others[i % 4 :]
            row = {"what": what, "choices": [f" {c}" for c in choices], "answer": i % 4}
            f_mc.write(json.dumps(row) + "\n")
            f_gen.write(json.dumps({"what": what, "module": module}) + "\n")
    (folder / "agentcache_stdlib_mc.yaml").write_text(MC_YAML.format(data=mc))
    (folder / "agentcache_stdlib_gen.yaml").write_text(GEN_YAML.format(data=gen))


def run_lm_eval(url: str, model: str, limit: int, folder: Path) -> dict[str, Any]:
    """``lm_eval --model local-completions`` on both tasks; returns the results JSON."""
    write_tasks(folder)
    out = folder / "out"
    model_args = f"model={model},base_url={url}/v1/completions,num_concurrent=1,max_retries=1"
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions"]
    command += ["--model_args", model_args, "--include_path", str(folder), "--limit", str(limit)]
    command += ["--tasks", "agentcache_stdlib_mc,agentcache_stdlib_gen"]
    command += ["--output_path", str(out), "--log_samples"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "x"}
    t0 = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"lm_eval exited {proc.returncode}:\n{tail}")
    [results_file] = sorted(out.rglob("results_*.json"))[-1:]
    results: dict[str, Any] = json.loads(results_file.read_text())
    results["wall_s"] = time.perf_counter() - t0
    print(proc.stdout[-2000:])
    return results


def run_langchain(url: str, model: str) -> dict[str, Any]:
    """``ChatOpenAI(...).with_structured_output(Colour)``: must return a valid ``Colour``."""
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Colour(BaseModel):
        """A colour the model picked."""

        name: Literal["red", "green", "blue", "yellow"] = Field(description="the colour")
        is_warm: bool = Field(description="whether it is a warm colour")

    chat = ChatOpenAI(base_url=f"{url}/v1", api_key="x", model=model, temperature=0, max_tokens=64)
    structured = chat.with_structured_output(Colour, method="json_schema", strict=True)
    answer = structured.invoke("Pick a colour and say whether it is warm.")
    assert isinstance(answer, Colour), f"not a Colour: {answer!r}"
    return answer.model_dump()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--model", default="tiny", help="bundled name, local path or hub id")
    parser.add_argument("--limit", type=int, default=20, help="documents per lm-eval task")
    parser.add_argument("--json", default=None, help="also write the summary to this file")
    args = parser.parse_args(argv)
    try:
        import langchain_openai  # noqa: F401
        import lm_eval  # noqa: F401
    except ImportError as exc:
        print(f"acceptance: {exc}; install the extra: pip install -e '.[acceptance]'")
        return 1
    from runtime.engine import Engine
    from runtime.serve.app import create_app
    from runtime.serve.server_thread import ServerThread

    engine = Engine.from_pretrained(args.model)
    summary: dict[str, Any] = {"model": engine.model_id, "limit": args.limit}
    is_ok = True
    with ServerThread(create_app(engine)) as url, tempfile.TemporaryDirectory() as tmp:
        for part, run in (
            ("lm_eval", lambda: run_lm_eval(url, engine.model_id, args.limit, Path(tmp))),
            ("langchain", lambda: run_langchain(url, engine.model_id)),
        ):
            try:
                summary[part] = run()
            except Exception as exc:  # report every part, then fail
                summary[part] = {"error": f"{type(exc).__name__}: {exc}"}
                is_ok = False
    engine.close()
    short = {k: v for k, v in summary.items() if k != "lm_eval"}
    if isinstance(summary.get("lm_eval"), dict):
        short["lm_eval"] = summary["lm_eval"].get("results", summary["lm_eval"])
    print(json.dumps(short, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str))
    return 0 if is_ok else 1


if __name__ == "__main__":
    sys.exit(main())
