"""llama.cpp as a peer in ``bench prefix``: the W1 weights as an f32 GGUF, timed in a subprocess.

``llama_cpp`` (llama-cpp-python) is never imported here: a child process of the interpreter that
``--llama-cpp`` names loads the GGUF and answers one JSON line per request, so the bench can
alternate it with this engine in one run and the test suite never needs it. The GGUF comes from
llama.cpp's own ``convert_hf_to_gguf.py`` (the sdist's vendored copy), run on the weights saved
with a byte-level BPE tokenizer that it writes as ``gpt-2`` (the benches feed token ids, so the
tokenizer only has to load). It knows nothing of this engine's internals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

__all__ = [
    "BUILD_HELP",
    "LlamaCppPeer",
    "PeerRun",
    "export_gguf",
    "gguf_problem",
    "peer_python",
    "save_hf",
]

BUILD_HELP = """\
llama.cpp peer (optional, never a test dependency): build llama-cpp-python from its sdist in a
separate venv (15-40 min on 2 cores), e.g. `python -m venv /opt/llama && /opt/llama/bin/pip
install --no-binary llama-cpp-python llama-cpp-python`, then pass --llama-cpp /opt/llama (the
venv or its python). The f32 GGUF of the W1 weights is made with the sdist's vendored
vendor/llama.cpp/convert_hf_to_gguf.py (`pip download --no-deps --no-binary :all:
llama-cpp-python` and unpack it): pass that file as --llama-cpp-convert; it runs in this
interpreter (torch, transformers) with its own gguf-py, and needs no sentencepiece here.
Both engines use --threads (default: torch's count). On a machine where other work competes for
the cores prefer --threads 1: llama.cpp's worker threads spin at each barrier, so oversubscribed
they lose far more than torch does (measured on a loaded 2-core machine: 2 threads, llama.cpp
decoded 0.5-3.4 tok/s and this engine 3.9-6.7; 1 thread, 5.1-8.5 and 6.2-9.5)."""

_CONVERT = r"""
import sys
src, model_dir, out = sys.argv[1:4]  # NOTE: sys.argv[4] is the outtype (f32 or bf16)
sys.path[:0] = [src, src + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py", model_dir, "--outfile", out, "--outtype", sys.argv[4]]
import conversion.base as base
import convert_hf_to_gguf as convert
from conversion.llama import LlamaModel
# NOTE: the bench tokenizer is byte-level BPE (GPT-2's scheme) but its vocabulary hash is
# not in llama.cpp's table of known pre-tokenizers, and Llama's set_vocab tries SentencePiece.
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
convert.main()
"""

_SERVE = r"""
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.stdin.readline())
llm = Llama(model_path=cfg["gguf"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"], verbose=False)
print(json.dumps({"n_batch": llm.n_batch}), flush=True)
greedy = dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
for line in sys.stdin:
    cmd = json.loads(line)
    start = time.perf_counter()
    gen = llm.generate(cmd["tokens"], **greedy)
    out = [next(gen)]
    first = time.perf_counter()
    while len(out) < cmd["n"]:
        out.append(next(gen))
    end = time.perf_counter()
    gen.close()
    print(json.dumps({"ttft_s": first - start, "decode_s": end - first, "tokens": out}),
          flush=True)
"""


class PeerRun(NamedTuple):
    """One request on the peer: time to first token, decode time after it, greedy tokens."""

    ttft_s: float
    decode_s: float
    """Seconds from the first token to the last (``len(tokens) - 1`` decode steps)."""
    tokens: list[int]


def peer_python(spec: str) -> str:
    """The interpreter ``--llama-cpp`` names: a Python executable, or a venv folder.

    Raises:
        ValueError: neither an executable file nor a folder with ``bin/python``.
    """
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "bin" / "python"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise ValueError(f"--llama-cpp {spec!r}: no Python executable there (a venv or python)")
    return str(path)


def _byte_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer (256 byte tokens, one merge) for a model of ``vocab_size``.

    Every other id is a word `` w<id>`` (never produced by encoding: no merge makes it), so any
    token a random model generates decodes to text, alike here and in llama.cpp (an id missing
    from the vocabulary would decode to nothing in both, and a stream would carry no text).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["Ġt"] = len(vocab)  # NOTE: llama.cpp refuses a BPE vocabulary without merges
    assert len(vocab) < vocab_size, "the model's vocabulary must hold the byte tokens"
    vocab.update({f"Ġw{i}": i for i in range(len(vocab), vocab_size)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, eos_token="!", bos_token="!"
    )


def gguf_problem(gguf: str | None, convert: str | None, flag: str) -> str | None:
    """Why llama.cpp cannot get the W1 weights (None when it can): ``--gguf`` must name a file,
    else ``--llama-cpp-convert`` llama.cpp's converter; ``flag`` names the option asking for it."""
    if gguf is not None:
        return None if Path(gguf).is_file() else f"--gguf {gguf!r}: no such file"
    if convert is None or not Path(convert).is_file():
        return f"{flag} needs --llama-cpp-convert path/to/convert_hf_to_gguf.py (or --gguf)"
    return None


def save_hf(model: Any, folder: Path) -> Path:
    """Save ``model`` (a transformers Llama) and a byte tokenizer to ``folder/hf``; return it."""
    hf_dir = folder / "hf"
    # NOTE: once an Engine runs ``model`` on the compact forward, its projections are transposed
    # views of input-major storage, which transformers' shared-tensor check cannot measure.
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    model.save_pretrained(hf_dir, state_dict=state)
    _byte_tokenizer(model.config.vocab_size).save_pretrained(hf_dir)
    return hf_dir


def export_gguf(model: Any, folder: Path, convert_script: Path, *, outtype: str = "f32") -> Path:
    """``save_hf(model, folder)``, then write ``folder/w1-<outtype>.gguf`` with llama.cpp's
    converter (``outtype``: ``f32``, or ``bf16`` for ``--weights bfloat16``: the weights are
    already bf16 values, so the conversion is exact).

    Raises:
        RuntimeError: the converter failed (its last output lines are in the message).
    """
    hf_dir, out = save_hf(model, folder), folder / f"w1-{outtype}.gguf"
    args = [sys.executable, "-c", _CONVERT, str(convert_script.parent), str(hf_dir), str(out),
            outtype]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-8:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {done.returncode}):\n{tail}")
    return out


class LlamaCppPeer:
    """A child process holding one ``llama_cpp.Llama`` on ``gguf``; one request at a time.

    Each ``run`` is ``Llama.generate`` (greedy): it reuses the longest common prefix of the
    context it holds, as llama.cpp's server does with ``cache_prompt``. The child waits on its
    input between requests, so it never competes with the caller for the cores.

    Raises:
        RuntimeError: (on construction or ``run``) the child died; its stderr tail says why.
    """

    def __init__(self, python: str, gguf: Path, *, n_ctx: int, threads: int) -> None:
        # NOTE: stderr goes to a file, so a chatty child never blocks on a full pipe.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self._proc = subprocess.Popen(
            [python, "-c", _SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
        )
        self.info = self._ask({"gguf": str(gguf), "n_ctx": n_ctx, "threads": threads})

    def run(self, tokens: list[int], num_tokens: int) -> PeerRun:
        """Prefill ``tokens`` (after whatever prefix it shares with the last request) and
        decode ``num_tokens`` greedy tokens in all."""
        answer = self._ask({"tokens": tokens, "n": num_tokens})
        return PeerRun(answer["ttft_s"], answer["decode_s"], answer["tokens"])

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self._proc.wait()
            self._stderr.seek(0)
            err = self._stderr.read()
            self.close()
            raise RuntimeError(f"llama.cpp peer exited: {err.strip()[-600:]}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        """End the child (closing its input ends its loop)."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()
